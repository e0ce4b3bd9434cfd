"""configs/ddpm.sx: a short training run, then `sexpgpu generate` from its checkpoint writes
the samples a plain JAX U-Net and DDIM loop, written here over the checkpoint's parameters
with the same noise, computes (to 1e-5), and a PNG grid of them."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# a U-Net's training step, its sampler and the JAX loop compile: over 20 s on 2 loaded cores
pytestmark = pytest.mark.slow

ROOT = os.path.join(os.path.dirname(__file__), "..")
DDPM = os.path.join(ROOT, "configs", "ddpm.sx")
# tiny: 4 channels, a schedule of 10 steps walked back in 5, 3 images, 2 training steps. The
# betas stay small so the clean image a step infers, (x - sqrt(1 - ab) eps) / sqrt(ab), is not
# divided by a tiny sqrt(ab): there the last bits of f32 rounding grow past 1e-5 whoever
# computes it (this loop eagerly and under jax.jit differ by 1.4e-5 with beta-max 0.5).
SETS = {"channels": 4, "timesteps": 10, "ddim-steps": 5, "samples": 3, "steps": 2,
        "beta-max": 0.05}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  import sexpgpu
  from sexpgpu.cli.main import main
  from sexpgpu.models import source
  tmp = tmp_path_factory.mktemp("ddpm")
  exp = sexpgpu.compile(DDPM, set=SETS)
  summary = exp.run(checkpoint_dir=str(tmp / "ck"))
  step_dir = source.step_dir_of("latest", str(tmp / "ck"), exp._c.slug)
  sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
  out = str(tmp / "out" / "samples.npz")
  assert main(["generate", DDPM, *sets, "--resume", step_dir, "-o", out]) == 0
  params, _ = source.checkpoint_params(step_dir)
  return tmp, exp, summary, params, out


# --- the same model and sampler in plain JAX ----------------------------------------------

def _conv(x, w, b=None):
  y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return y if b is None else y + b


def _norm(p, name, x, groups=4, eps=1e-5):
  b, h, w, c = x.shape
  g = x.reshape(b, h, w, groups, c // groups)
  mu = g.mean((1, 2, 4), keepdims=True)
  var = jnp.square(g - mu).mean((1, 2, 4), keepdims=True)
  y = ((g - mu) * jax.lax.rsqrt(var + eps)).reshape(b, h, w, c)
  return y * p[f"{name}/scale"] + p[f"{name}/shift"]


def _res(p, name, x, temb, out):
  b = x.shape[0]
  h = _conv(jax.nn.silu(_norm(p, f"{name}/norm1", x)), p[f"{name}/conv1/w"], p[f"{name}/conv1/b"])
  h = h + (jax.nn.silu(temb) @ p[f"{name}/time/w"] + p[f"{name}/time/b"]).reshape(b, 1, 1, out)
  h = _conv(jax.nn.silu(_norm(p, f"{name}/norm2", h)), p[f"{name}/conv2/w"], p[f"{name}/conv2/b"])
  return h + (x if x.shape[-1] == out else _conv(x, p[f"{name}/skip"]))


def _unet(p, x, t, ch):
  p = {k[len("unet/"):]: v for k, v in p.items() if k.startswith("unet/")}
  half = ch // 2
  freqs = jnp.exp(-9.210340371976184 / half * jnp.arange(half, dtype=jnp.float32))
  args = t.astype(jnp.float32)[:, None] * freqs
  temb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], -1)
  temb = jax.nn.silu(temb @ p["temb1/w"] + p["temb1/b"]) @ p["temb2/w"] + p["temb2/b"]
  h1 = _res(p, "down1", _conv(x, p["stem/w"], p["stem/b"]), temb, ch)
  b, hh, ww, c = h1.shape
  pooled = h1.reshape(b, hh // 2, 2, ww // 2, 2, c).mean((2, 4))
  h3 = _res(p, "mid", _res(p, "down2", pooled, temb, 2 * ch), temb, 2 * ch)
  up = jnp.repeat(jnp.repeat(h3, 2, 1), 2, 2)
  h4 = _res(p, "up1", jnp.concatenate([up, h1], -1), temb, ch)
  return _conv(jax.nn.silu(_norm(p, "out-norm", h4)), p["head/w"], p["head/b"])


def _ddim(p, noise, T, S, ch):
  beta = 1e-3 + np.arange(T, dtype=np.float32) / (T - 1) * (0.05 - 1e-3)
  table = jnp.concatenate([jnp.ones(1), jnp.cumprod(1.0 - jnp.asarray(beta, jnp.float32))])
  k = T // S
  x = noise
  for t in range(k * (S - 1), -1, -k):
    ab, prev = table[t + 1], table[max(t - k, -1) + 1]
    eps = _unet(p, x, jnp.full((x.shape[0],), t, jnp.int32), ch)
    x0 = jnp.clip((x - jnp.sqrt(1.0 - ab) * eps) / jnp.sqrt(ab), -1.0, 1.0)
    x = jnp.sqrt(prev) * x0 + jnp.sqrt(1.0 - prev) * eps
  return x


def test_generate_equals_a_plain_jax_ddim_loop(trained):
  from sexpgpu.models import generate
  tmp, exp, _, params, out = trained
  got = np.load(out)["out"]
  assert got.shape == (3, 12, 12, 1) and np.isfinite(got).all()
  # the noise the graph draws: the defgenerate's :seed 0, folded with the draw's site
  (site,) = [n.attr("site") for n in generate.graph(exp._c, "ddim-sample").nodes()
             if n.op == "random-normal"]
  noise = jax.random.normal(jax.random.fold_in(jax.random.key(0), site), (3, 12, 12, 1))
  want = np.asarray(_ddim({k: jnp.asarray(v) for k, v in params.items()}, noise, 10, 5, 4))
  assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()
  assert np.abs(got).max() > 0.1  # not all zero: the loop ran


def test_the_png_grid_is_written(trained):
  from PIL import Image
  from sexpgpu.models import generate
  tmp, _, _, _, out = trained
  png = Image.open(str(tmp / "out" / "samples.png"))
  assert png.mode == "L" and png.size == (2 * 13 + 1, 2 * 13 + 1)  # 3 images, 2 a row
  assert np.array_equal(np.asarray(png), generate.grid(np.load(out)["out"])[..., 0])


def test_training_reports_a_noise_prediction_loss(trained):
  _, _, summary, _, _ = trained
  assert summary.steps == 2 and np.isfinite(summary.train_loss)
  assert 0.0 < summary.train_loss < 3.0  # a mean square error of unit-variance noise

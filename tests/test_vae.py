"""configs/vae.sx, smoke: a few training steps with its defgenerate running during training,
then `sexpgpu generate` from the checkpoint: images from the prior, the decoder's
probabilities at the key's draws (checked against numpy over the checkpoint's parameters),
and a KL term that is never negative."""

import json
import os

import jax
import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
VAE = os.path.join(ROOT, "configs", "vae.sx")
SETS = {"hidden": 8, "latent": 3, "samples": 4, "steps": 3}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  import sexpgpu
  from sexpgpu.models import source
  tmp = tmp_path_factory.mktemp("vae")
  exp = sexpgpu.compile(VAE, set=SETS)
  summary = exp.run(checkpoint_dir=str(tmp / "ck"), metrics=f"jsonl:{tmp / 'm.jsonl'}")
  step_dir = source.step_dir_of("latest", str(tmp / "ck"), exp._c.slug)
  return tmp, exp, summary, step_dir


def test_training_writes_prior_samples_and_a_finite_bound(trained):
  tmp, _, summary, _ = trained
  assert summary.steps == 3 and np.isfinite(summary.train_loss)
  assert summary.eval["eval/kl-term"] >= 0.0 and summary.eval["eval/neg-elbo"] > 0.0
  events = [json.loads(line) for line in open(tmp / "m.jsonl")]
  (gen,) = [e for e in events if e["kind"] == "generate"]  # :every 200: only the last step's
  assert gen["step"] == 3 and gen["outputs"] == {"out": [4, 12, 12, 1]}
  got = np.load(tmp / "m.files" / "generate" / "prior" / "step-3.npz")["out"]
  assert got.min() >= 0.0 and got.max() <= 1.0


def test_generate_decodes_draws_from_the_prior(trained, capsys):
  from sexpgpu.cli.main import main
  from sexpgpu.models import generate, source
  tmp, exp, _, step_dir = trained
  sets = [a for k, v in SETS.items() for a in ("--set", f"{k}={v}")]
  out = str(tmp / "prior.npz")
  assert main(["generate", VAE, *sets, "--resume", step_dir, "-o", out, "--seed", "7"]) == 0
  got = np.load(out)["out"]
  p, _ = source.checkpoint_params(step_dir)
  (site,) = [n.attr("site") for n in generate.graph(exp._c, "sample-prior").nodes()
             if n.op == "random-normal"]
  z = np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(7), site), (4, 3)))
  h = np.maximum(z @ p["decode/in/w"] + p["decode/in/b"], 0)
  want = 1 / (1 + np.exp(-(h @ p["decode/out/w"] + p["decode/out/b"])))
  np.testing.assert_allclose(got.reshape(4, 144), want, rtol=1e-5, atol=1e-6)
  assert os.path.exists(tmp / "prior.png")


def test_the_kl_term_is_zero_at_the_prior_and_positive_elsewhere(trained):
  _, exp, _, _ = trained
  mu = np.array([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]], np.float32)
  log_var = np.array([[0.0, 0.0, 0.0], [0.3, -0.7, 0.0]], np.float32)
  got = np.asarray(exp.call("kl", {}, mu, log_var))
  want = -0.5 * (1 + log_var - mu ** 2 - np.exp(log_var)).sum(1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert got[0] == 0.0 and got[1] > 0.0

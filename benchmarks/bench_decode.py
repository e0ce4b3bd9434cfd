"""Decoding benchmark: `sexpgpu sample`'s incremental and recompute paths vs hand decoders.

Usage:
  python benchmarks/bench_decode.py [--model gpt2|mamba] [--shape small|tiny] [--tokens N]
                                    [--rounds R] [--json F]

`--model mamba` decodes a `mamba` (configs/mamba-tiny.sx, the knobs of MAMBA_SHAPES) two
ways: sexpgpu's incremental decoder (the compiler keeps each layer's conv window and scan
state) and a recurrent decoder written by hand in JAX (`hand_mamba_decoder`: the same two
states a layer, one token a step in a `lax.fori_loop`, the prompt fed one token at a time);
the recompute path is left out (a Mamba's window is 8192 positions). The default below is
GPT-2's:

One `gpt2` model (configs/gpt2-small.sx, variant smoke, with the knobs of SHAPES) and one
set of initial parameters, decoded greedily (temperature 0) for N new tokens after a short
prompt, four ways:

  incremental  sexpgpu.models.sample's compiler-derived KV cache (`path="incremental"`);
  recompute    the same, the window recomputed for every token (`path="recompute"`);
  hand         a GPT-2 decoder written by hand in JAX, reading the same parameter dict: one
               jitted call of a prefill over the prompt and a `lax.fori_loop` of one-token
               steps over a preallocated cache, layers unrolled (nanoGPT / MaxText style);
  hand-window  the hand decoder with sexpgpu's cache length (the model's whole window) and
               its prefill over the padded window: reported, no target.

All legs must choose the same tokens (the correctness check, asserted). `generate` compiles
its decoder on every call and times that executable's first run; the rounds time warm runs
instead, so the sexpgpu legs are built with `generate`'s own pieces (`sexpgpu_decoder`) and
checked to give `generate`'s tokens. Each leg is compiled once (its compile time reported
apart), run once to warm up, then timed in R rounds with the legs in a rotating order; a
ratio is the median of the rounds' paired ratios, with their range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SX = os.path.join(ROOT, "configs", "gpt2-small.sx")
FN = "lm"

# `small` fits a 2-core CPU with GPT-2's 1024 positions: the recompute leg runs the whole
# window for every token, so its cost grows with context x tokens. The vocabulary is cut
# from 50257 because the Markov loader's stationary solve is V x V and the recompute leg's
# logits are 1024 x V a token; `tiny` is the smoke test's.
SHAPES = {
    "small": {"vocab": 2048, "width": 192, "layers": 2, "heads": 4, "context": 1024},
    "tiny": {"vocab": 64, "width": 32, "layers": 1, "heads": 2, "context": 64},
}
DEFAULT_TOKENS = {"small": 512, "tiny": 16}
MAMBA_SX = os.path.join(ROOT, "configs", "mamba-tiny.sx")
MAMBA_SHAPES = {  # configs/mamba-tiny.sx's knobs
    "small": {"vocab": 2048, "width": 256, "layers": 4, "state": 16, "dt-rank": 16},
    "tiny": {"vocab": 64, "width": 32, "layers": 1, "state": 4, "dt-rank": 2},
}
MAMBA_LEGS = ("incremental", "hand")
PROMPT = [5, 17, 3, 42, 8, 1, 29, 11]  # ids below every shape's vocabulary
# hand-window: the hand decoder with sexpgpu's cache of the whole window and its prefill over
# the padded window; reported, no target (incremental/hand-window is sexpgpu's own overhead).
LEGS = ("incremental", "recompute", "hand", "hand-window")
# The goals: incremental against the hand cache, and against recomputing the window.
TARGETS = {"hand": 0.9, "recompute": 5.0}


def _cpu_flags() -> None:
  """sexpgpu's XLA CPU flags, before the backend starts (as `sexpgpu sample` runs)."""
  from sexpgpu.run.backend import cpu_flags
  cpu_flags()


def build(shape_name: str, seed: int = 1, model: str = "gpt2"):
  """The compiled experiment and its host parameters (`exp.init(seed)`).

  Returns:
    (c, params): the Compiled experiment and path -> numpy array.
  """
  import numpy as np
  import sexpgpu
  if model == "mamba":
    exp = sexpgpu.compile(MAMBA_SX, set=dict(MAMBA_SHAPES[shape_name]))
  else:
    exp = sexpgpu.compile(SX, variant="smoke", set=dict(SHAPES[shape_name]))
  return exp._c, {k: np.asarray(v) for k, v in exp.init(seed).params.items()}


# --- sexpgpu's paths ----------------------------------------------------------------------
def sexpgpu_decoder(c, params: dict, prompt: list[int], s, path: str):
  """`generate`'s decoder for `path`, compiled, and its arguments; nothing run yet.

  `sexpgpu.models.sample.decoder`, as `generate` and defsample build it, compiled once so
  that the benchmark can run one executable many times (generate compiles on every call).

  Returns:
    (compiled, args, chosen): `compiled(*args)` returns the ids; chosen is the path taken.
  """
  from sexpgpu.models import sample
  d = sample.decoder(c, FN, len(prompt), s, path)
  if path != "recompute" and d.path != "incremental":
    raise RuntimeError(f"sexpgpu does not decode this model incrementally: {d.reason}")
  args = d.args(c, params, prompt)
  chosen, decoder = d.path, d.decode
  return decoder.lower(*args).compile(), args, chosen


# --- the hand-written decoder -------------------------------------------------------------
def hand_params(c, params: dict) -> tuple[dict, dict]:
  """The gpt2's weights under short names (per-layer ones stacked on axis 0), and its shape.

  The `.sx` paths are the twin's (sexpgpu/models/twin.py): `<root>wte`, `<root>wpe`,
  `<root>ln_f/…` and `<root>h/gpt2-block/{ln_1,attn/c_attn,attn/c_proj,ln_2,mlp/…}`.
  """
  import jax.numpy as jnp
  from sexpgpu.models import twin
  g = twin.find(c.params, c.stages[0].graph, "bench_decode")
  blk = g.root + twin.GPT2_SCOPE
  p = {"wte": params[g.root + "wte"], "wpe": params[g.root + "wpe"],
       "ln_f_s": params[g.root + "ln_f/scale"], "ln_f_b": params[g.root + "ln_f/bias"]}
  for rel in twin.GPT2_BLOCK:
    p[rel.replace("/", "_")] = params[blk + rel]
  return ({k: jnp.asarray(v, jnp.float32) for k, v in p.items()},
          {"layers": g.config["n_layer"], "heads": g.config["n_head"],
           "eps": g.config["layer_norm_epsilon"], "positions": g.positions})


def hand_decoder(cfg: dict, n_prompt: int, tokens: int, window: int | None = None):
  """A jitted `ids = decode(p, prompt)`: GPT-2 with a KV cache, greedy, written by hand.

  The cache holds exactly the positions the call needs (prompt + new tokens, a static
  length), as a static-cache generate allocates it; every step writes its key and value in
  place (`dynamic_update_slice` on the loop's carry) and attends over the cache with the
  positions after it masked. With `window`, the cache has `window` positions and the
  prefill runs over the prompt padded to them (`prompt` is then [window]), as sexpgpu's
  incremental decoder does: the `hand-window` leg, which shows what those two choices cost.
  """
  import jax
  import jax.numpy as jnp
  L, H, eps = cfg["layers"], cfg["heads"], cfg["eps"]
  T = window or n_prompt + tokens

  def layernorm(x, scale, bias):
    mu = jnp.mean(x, -1, keepdims=True)
    xc = x - mu
    return xc * jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + eps) * scale + bias

  def block(p, i, x, cache, pos):
    """One layer on x [1 t d] at positions pos.. pos+t-1; returns x and the layer's cache."""
    b, t, d = x.shape
    dh = d // H
    heads = lambda y: y.reshape(b, t, H, dh).transpose(0, 2, 1, 3)
    h = layernorm(x, p["ln_1_scale"][i], p["ln_1_bias"][i])
    q, k, v = jnp.split(h @ p["attn_c_attn_w"][i] + p["attn_c_attn_b"][i], 3, -1)
    ck, cv = cache
    ck = jax.lax.dynamic_update_slice(ck, heads(k), (0, 0, pos, 0))
    cv = jax.lax.dynamic_update_slice(cv, heads(v), (0, 0, pos, 0))
    s = jnp.einsum("bhqd,bhkd->bhqk", heads(q), ck) * (1.0 / dh ** 0.5)
    keep = jnp.arange(T)[None, :] <= pos + jnp.arange(t)[:, None]
    a = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), -1)
    o = jnp.einsum("bhqk,bhkd->bhqd", a, cv).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + o @ p["attn_c_proj_w"][i] + p["attn_c_proj_b"][i]
    h = layernorm(x, p["ln_2_scale"][i], p["ln_2_bias"][i])
    h = jax.nn.gelu(h @ p["mlp_c_fc_w"][i] + p["mlp_c_fc_b"][i], approximate=True)
    return x + h @ p["mlp_c_proj_w"][i] + p["mlp_c_proj_b"][i], (ck, cv)

  def forward(p, ids, caches, pos):
    """Logits [1 t V] of ids [1 t] at positions pos.., and the caches with them written."""
    t = ids.shape[1]
    x = p["wte"][ids] + jax.lax.dynamic_slice_in_dim(p["wpe"], pos, t)[None]
    new = []
    for i in range(L):  # unrolled: L is small and static
      x, kv = block(p, i, x, caches[i], pos)
      new.append(kv)
    return layernorm(x, p["ln_f_s"], p["ln_f_b"]) @ p["wte"].T, new

  def decode(p, prompt):
    d = p["wte"].shape[1]
    zeros = jnp.zeros((1, H, T, d // H), jnp.float32)
    caches = [(zeros, zeros) for _ in range(L)]
    logits, caches = forward(p, prompt[None], caches, 0)
    first = jnp.argmax(logits[0, n_prompt - 1]).astype(jnp.int32)
    out = jnp.zeros((tokens,), jnp.int32).at[0].set(first)

    def step(i, carry):
      out, caches = carry
      logits, caches = forward(p, out[i - 1].reshape(1, 1), caches, n_prompt + i - 1)
      return out.at[i].set(jnp.argmax(logits[0, 0]).astype(jnp.int32)), caches

    return jax.lax.fori_loop(1, tokens, step, (out, caches))[0]

  return jax.jit(decode)


# --- the hand-written Mamba decoder ------------------------------------------------------
def hand_mamba_params(c, params: dict) -> tuple[dict, dict]:
  """The mamba's weights under short names (per-layer ones stacked on axis 0), and its shape.

  The `.sx` paths are the twin's (sexpgpu/models/twin_families.py): `<root>embeddings`,
  `<root>norm_f/scale` and `<root>layers/mamba-block/{norm/scale,mixer/…}`.
  """
  import jax.numpy as jnp
  from sexpgpu.models import twin, twin_families
  g = twin.find(c.params, c.stages[0].graph, "bench_decode")
  blk = g.root + twin_families.MAMBA_SCOPE
  p = {"emb": params[g.root + "embeddings"], "norm_f": params[g.root + "norm_f/scale"]}
  for rel in twin_families.MAMBA_BLOCK:
    p[rel.replace("/", "_")] = params[blk + rel]
  k = g.config
  return ({n: jnp.asarray(v, jnp.float32) for n, v in p.items()},
          {"layers": k["num_hidden_layers"], "state": k["state_size"], "rank":
           k["time_step_rank"], "eps": k["layer_norm_epsilon"], "kernel": k["conv_kernel"],
           "inner": k["intermediate_size"]})


def hand_mamba_decoder(cfg: dict, n_prompt: int, tokens: int):
  """A jitted `ids = decode(p, prompt)`: Mamba's recurrent form, greedy, written by hand.

  Each layer keeps the conv's last kernel-1 inputs [1 k-1 e] and the scan's state [1 e N];
  a step takes one token through every layer (unrolled) and updates both, as transformers'
  MambaMixer does when it decodes with its cache. The prompt goes through the same step
  one token at a time, then the new tokens, all in `lax.fori_loop`s.
  """
  import jax
  import jax.numpy as jnp
  L, N, r, eps, k, e = (cfg["layers"], cfg["state"], cfg["rank"], cfg["eps"], cfg["kernel"],
                        cfg["inner"])

  def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

  def layer(p, i, x, conv, ssm):
    """x [1 d], conv [1 k-1 e], ssm [1 e N] → x, conv, ssm after one position."""
    v, gate = jnp.split(rms(x, p["norm_scale"][i]) @ p["mixer_in_proj_w"][i], 2, -1)
    win = jnp.concatenate([conv, v[:, None]], 1)  # [1 k e], the oldest input first
    v = jax.nn.silu(jnp.sum(win * p["mixer_conv1d_w"][i][:, 0], 1) + p["mixer_conv1d_b"][i])
    dbc = v @ p["mixer_x_proj_w"][i]
    dt = jax.nn.softplus(dbc[:, :r] @ p["mixer_dt_proj_w"][i] + p["mixer_dt_proj_b"][i])
    b, cc = dbc[:, r:r + N], dbc[:, r + N:]
    a = -jnp.exp(p["mixer_A_log"][i])  # [e N]
    ssm = jnp.exp(dt[..., None] * a) * ssm + dt[..., None] * b[:, None] * v[..., None]
    y = jnp.einsum("ben,bn->be", ssm, cc) + v * p["mixer_D"][i]
    return x + (y * jax.nn.silu(gate)) @ p["mixer_out_proj_w"][i], win[:, 1:], ssm

  def step(p, token, states):
    x = p["emb"][token][None]  # [1 d]
    new = []
    for i in range(L):  # unrolled: L is small and static
      x, conv, ssm = layer(p, i, x, *states[i])
      new.append((conv, ssm))
    return (rms(x, p["norm_f"]) @ p["emb"].T)[0], new

  def decode(p, prompt):
    states = [(jnp.zeros((1, k - 1, e), jnp.float32), jnp.zeros((1, e, N), jnp.float32))
              for _ in range(L)]
    logits = jnp.zeros((p["emb"].shape[0],), jnp.float32)

    def feed(i, carry):
      return step(p, prompt[i], carry[1])

    logits, states = jax.lax.fori_loop(0, n_prompt, feed, (logits, states))
    out = jnp.zeros((tokens,), jnp.int32).at[0].set(jnp.argmax(logits).astype(jnp.int32))

    def gen(i, carry):
      out, states = carry
      logits, states = step(p, out[i - 1], states)
      return out.at[i].set(jnp.argmax(logits).astype(jnp.int32)), states

    return jax.lax.fori_loop(1, tokens, gen, (out, states))[0]

  return jax.jit(decode)


# --- the driver ---------------------------------------------------------------------------
def _timed(f, args) -> tuple[list[int], float]:
  import numpy as np
  t = time.perf_counter()
  ids = np.asarray(f(*args))  # host sync: the ids on the host
  return [int(i) for i in ids], time.perf_counter() - t


def bench(shape_name: str, tokens: int, rounds: int) -> dict:
  """Builds the legs, checks that they agree, and times them in rotating rounds."""
  import jax.numpy as jnp
  from sexpgpu.models import sample
  t0 = time.perf_counter()
  c, params = build(shape_name)
  setup_s = time.perf_counter() - t0
  s = sample.Settings(tokens=tokens, temperature=0.0)
  prompt = PROMPT
  w = sample.window(c, FN)
  if len(prompt) + tokens - 1 > w:  # past it, generate slides the window: no cache
    raise SystemExit(f"--tokens {tokens}: the {len(prompt)}-token prompt and the continuation "
                     f"pass the model's {w} positions")
  legs, compile_s, sample_tok_s, ids = {}, {}, {}, {}
  for path in ("incremental", "recompute"):
    # the tokens and the path `generate` itself gives, and its own tokens/s figure
    res = sample.generate(c, FN, params, prompt, s, path=path)
    if res.path != path:
      raise RuntimeError(f"generate took the {res.path} path, not {path}: {res.reason}")
    sample_tok_s[path] = res.tokens_per_s
    ids[path + " (generate)"] = res.ids
    t = time.perf_counter()
    f, args, _ = sexpgpu_decoder(c, params, prompt, s, path)
    compile_s[path] = time.perf_counter() - t
    legs[path] = (f, args)
  t = time.perf_counter()
  p, cfg = hand_params(c, params)
  args = (p, jnp.asarray(prompt, jnp.int32))
  legs["hand"] = (hand_decoder(cfg, len(prompt), tokens).lower(*args).compile(), args)
  compile_s["hand"] = time.perf_counter() - t
  t = time.perf_counter()
  args = (p, jnp.asarray(prompt + [0] * (w - len(prompt)), jnp.int32))
  legs["hand-window"] = (hand_decoder(cfg, len(prompt), tokens, w).lower(*args).compile(), args)
  compile_s["hand-window"] = time.perf_counter() - t
  for leg, (f, a) in legs.items():  # the warm-up run, and the tokens checked below
    ids[leg], _ = _timed(f, a)
  ref = ids["incremental"]
  agree = {k: v == ref for k, v in ids.items()}
  times = {leg: [] for leg in LEGS}
  for r in range(rounds):
    order = LEGS[r % len(LEGS):] + LEGS[:r % len(LEGS)]
    for leg in order:
      got, secs = _timed(*legs[leg])
      agree[leg] = agree[leg] and got == ref
      times[leg].append(secs)
  return {"shape": shape_name, "model": SHAPES[shape_name], "prompt": len(prompt),
          "tokens": tokens, "rounds": rounds, "setup_s": setup_s, "agree": agree,
          "ids": ref, "sample_tok_s": sample_tok_s,
          "legs": {leg: {"round_s": times[leg], "tok_s": tokens / statistics.median(times[leg]),
                         "compile_s": compile_s[leg]} for leg in LEGS}}


def bench_mamba(shape_name: str, tokens: int, rounds: int) -> dict:
  """The mamba's two legs (sexpgpu's incremental decoder, the hand recurrent decoder),
  checked to agree and timed in rotating rounds, as `bench` does."""
  import jax.numpy as jnp
  from sexpgpu.models import sample
  t0 = time.perf_counter()
  c, params = build(shape_name, model="mamba")
  setup_s = time.perf_counter() - t0
  s = sample.Settings(tokens=tokens, temperature=0.0)
  prompt = PROMPT
  res = sample.generate(c, FN, params, prompt, s)
  if res.path != "incremental":
    raise RuntimeError(f"generate took the {res.path} path: {res.reason}")
  ids = {"incremental (generate)": res.ids}
  t = time.perf_counter()
  f, args, _ = sexpgpu_decoder(c, params, prompt, s, "incremental")
  legs, compile_s = {"incremental": (f, args)}, {"incremental": time.perf_counter() - t}
  t = time.perf_counter()
  p, cfg = hand_mamba_params(c, params)
  args = (p, jnp.asarray(prompt, jnp.int32))
  legs["hand"] = (hand_mamba_decoder(cfg, len(prompt), tokens).lower(*args).compile(), args)
  compile_s["hand"] = time.perf_counter() - t
  for leg, (f, a) in legs.items():
    ids[leg], _ = _timed(f, a)
  ref = ids["incremental"]
  agree = {k: v == ref for k, v in ids.items()}
  times = {leg: [] for leg in MAMBA_LEGS}
  for r in range(rounds):
    for leg in MAMBA_LEGS[r % 2:] + MAMBA_LEGS[:r % 2]:
      got, secs = _timed(*legs[leg])
      agree[leg] = agree[leg] and got == ref
      times[leg].append(secs)
  return {"model_kind": "mamba", "shape": shape_name, "model": MAMBA_SHAPES[shape_name],
          "prompt": len(prompt), "tokens": tokens, "rounds": rounds, "setup_s": setup_s,
          "agree": agree, "ids": ref, "sample_tok_s": {"incremental": res.tokens_per_s},
          "legs": {leg: {"round_s": times[leg], "tok_s": tokens / statistics.median(times[leg]),
                         "compile_s": compile_s[leg]} for leg in MAMBA_LEGS}}


def report(res: dict) -> list[str]:
  """The legs' table and the ratio lines."""
  L = res["legs"]
  lines = [f"== {res['shape']} {res.get('model_kind', 'gpt2')} {res['model']}: "
           f"{res['prompt']}-token prompt, "
           f"{res['tokens']} new tokens greedy, {res['rounds']} rounds",
           f"{'leg':12} {'tok/s':>9} {'compile s':>10}  rounds s"]
  for leg, x in L.items():
    lines.append(f"{leg:12} {x['tok_s']:9.1f} {x['compile_s']:10.2f}  "
                 + " ".join(f"{t:.3f}" for t in x["round_s"]))
  lines.append("sample's own tok/s (generate, first run after compile): " + ", ".join(
      f"{k} {v:.1f}" for k, v in res["sample_tok_s"].items()))
  inc = L["incremental"]["round_s"]
  for other in list(L)[1:]:
    # a round runs the legs back to back: its ratio is a paired comparison
    per = [o / i for i, o in zip(inc, L[other]["round_s"])]
    r = statistics.median(per)
    target = TARGETS.get(other)
    lines.append(f"ratio decode incremental/{other} {r:.3g} ({min(per):.3g}..{max(per):.3g})"
                 + ("" if target is None else
                    f"  target >= {target}: {'met' if r >= target else 'MISSED'}"))
  bad = [k for k, ok in res["agree"].items() if not ok]
  lines.append("tokens agree: " + ("all legs" if not bad else "NO: " + ", ".join(bad)))
  return lines


def main(argv=None) -> int:
  """Runs the benchmark; exit 1 when the legs choose different tokens."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="gpt2", choices=("gpt2", "mamba"))
  ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
  ap.add_argument("--tokens", type=int, default=None, help="new tokens a call (default: "
                  + ", ".join(f"{k} {v}" for k, v in DEFAULT_TOKENS.items()) + ")")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--json", default=None, help="also write the results here")
  a = ap.parse_args(argv)
  _cpu_flags()
  run = bench_mamba if a.model == "mamba" else bench
  res = run(a.shape, a.tokens or DEFAULT_TOKENS[a.shape], a.rounds)
  print("\n".join(report(res)), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
  return 0 if all(res["agree"].values()) else 1


if __name__ == "__main__":
  sys.path.insert(0, ROOT)  # sexpgpu from this checkout, however it is installed
  sys.exit(main())

"""Side-by-side training benchmark: sexpgpu vs hand-written JAX+optax vs PyTorch eager.

Usage:
  python benchmarks/bench_train.py [--shape tiny|compute|both] [--steps N] [--rounds R]

Each leg (a: sexpgpu, b: JAX+optax, c: PyTorch) trains the transformer of
benchmarks/transformer.sx (std/lm.sx's `transformer-lm`) on the same Markov
batches from the same initial parameters. Every leg runs in its own
subprocess (so its peak RSS is its own), R rounds in a rotating order, and the
ratios are the medians of the rounds' paired ratios (each round's legs run
back to back; a round's leg time is the median of its post-warm-up steps).

The baselines (b) and (c) do the work sexpgpu's step does: every step's loss,
gradient norm and learning rate reach the host, and a step whose loss or
gradient norm is not finite leaves the state as it was (`:on-nan`). The
`jax-bare` and `torch-bare` legs are the same loops without that: the loss
only, the update always applied.
`jax-kept` is the `jax` loop with the host allocator setting sexpgpu makes for
the shape (`sexpgpu.run.backend.keep_host_memory`, when
`run.setup.wants_kept_host_memory`): the same compiled step on the same
allocator, so sexpgpu/jax-kept is sexpgpu's own overhead.

Two per-step times are measured, the same way in every leg:
  step  in the baselines, the step call up to its numbers on the host; in sexpgpu,
        `time/step`: the device's time for the step (sexpgpu draws the next batches
        in a thread and reads a step's numbers one step late, so its host work
        overlaps the step);
  loop  the period between the ends of consecutive steps: what a user waits for a
        step, host work included. The goals (TARGETS) are judged on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SX = os.path.join(HERE, "transformer.sx")

SHAPES = {
    "tiny": {"vocab": 32, "width": 32, "layers": 1, "heads": 4, "seq": 16, "batch": 4,
             "microbatches": 2},
    "compute": {"vocab": 256, "width": 256, "layers": 4, "heads": 4, "seq": 96, "batch": 8,
                "microbatches": 2},
}
DEFAULT_STEPS = {"tiny": 1500, "compute": 10}
# Steps dropped before timing. At the tiny shape a process's first few hundred steps
# run slower than its steady state (measured in 3000-step legs: sexpgpu's first 300
# ~10% slower, the hand loop's ~4%), and 150 steps take a tenth of a second, too short
# to outlast this machine's slow spells; so tiny legs warm up for 300 steps and time 1500.
DEFAULT_WARMUP = {"tiny": 300, "compute": 3}
LEGS = ("sexpgpu", "jax", "jax-kept", "jax-bare", "torch", "torch-bare")
# The goals, against the plain loops that skip the gradient norm
# and the NaN guard, on the loop's period: what a user waits for a step, host work included.
TARGETS = {"jax-bare": {"tiny": 1.0, "compute": 1.05}, "torch-bare": {"tiny": 4.0, "compute": 1.0}}
PRE = "lm/transformer-lm/"
BLK = PRE + "repeat/block/"
# sexpgpu parameter path -> short name used by the baselines (per-layer ones are stacked)
NAMES = {PRE + "embed": "embed", PRE + "pos": "pos", PRE + "norm/scale": "norm",
         PRE + "unembed": "unembed", BLK + "norm1/scale": "norm1", BLK + "norm2/scale": "norm2",
         BLK + "attention/q/w": "wq", BLK + "attention/k/w": "wk", BLK + "attention/v/w": "wv",
         BLK + "attention/o/w": "wo", BLK + "mlp/up/w": "up", BLK + "mlp/down/w": "down"}
LAYER = ("norm1", "wq", "wk", "wv", "wo", "norm2", "up", "down")
EPS = 1e-6


# --- shared pieces (run inside a leg's subprocess) ------------------------------
def _proc_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


def write_init(shape: dict, path: str) -> None:
  """Saves sexpgpu's initial parameters (seed 1, the run's) under the baselines' names."""
  import numpy as np
  import sexpgpu
  exp = sexpgpu.compile(SX, set=shape)
  np.savez(path, **{NAMES[k]: np.asarray(v) for k, v in exp.init(1).params.items()})


def _setup(shape: dict, init_path: str):
  """The train loader (position 0: the batches the sexpgpu leg trains on) and the init.

  Nothing here starts a JAX backend, so the legs' RSS baselines are alike.
  """
  import numpy as np
  import sexpgpu
  loader = sexpgpu.compile(SX, set=shape)._c.loaders["train"]
  with np.load(init_path) as f:
    params = {k: f[k] for k in f.files}
  return loader, params


def _draw(loader, k: int):
  import numpy as np
  return np.stack([loader.next()["tokens"] for _ in range(k)])


# --- (a) sexpgpu ----------------------------------------------------------------
def leg_sexpgpu(shape: dict, total: int, stacking: int | None = None,
                old_cache: bool = False) -> dict:
  """Runs `exp.run` and reads the step events back from its jsonl metrics.

  Each leg starts from a fresh cache folder (no remembered stacking), or, with
  `old_cache`, from one holding the choice the previous cost model made for this
  graph (degree 1, written without a model version); `stacking` fixes the degree.
  """
  import sexpgpu
  os.environ["SEXPGPU_CACHE_DIR"] = tempfile.mkdtemp(prefix="sexpgpu-bench-cache-")
  if stacking is not None:
    os.environ["SEXPGPU_STACKING"] = str(stacking)
  else:
    os.environ.pop("SEXPGPU_STACKING", None)
  exp = sexpgpu.compile(SX, set=shape)
  if old_cache:
    with open(os.path.join(os.environ["SEXPGPU_CACHE_DIR"], "choices.json"), "w") as f:
      json.dump({f"{exp._c.graph_fingerprint}|cpu:cpu": {"degree": 1, "measured_s": {}}}, f)
  rss0 = _proc_kib("VmRSS")
  path = tempfile.mktemp(suffix=".jsonl")
  t0 = time.time()  # exp.run re-reads the file, inits, compiles the step, then trains
  exp.run(steps=total, metrics="jsonl:" + path)
  events = [json.loads(line) for line in open(path)]
  os.unlink(path)
  steps = [e for e in events if e["kind"] == "step"]
  ends = [e["time"] for e in steps]
  chosen = [e for e in events if e["kind"] == "annotation" and e["name"] == "stacking"][-1]
  return {"stacking": f"{chosen['degree']} ({chosen['how']})",
          "first": ends[0] - t0, "step": [e["time/step"] for e in steps],
          "loop": [b - a for a, b in zip(ends, ends[1:])],
          "loss": [e["train/loss"] for e in steps], "rss0": rss0}


# --- (b) JAX + optax ----------------------------------------------------------
def jax_model(p: dict, tokens, heads: int, unroll: bool = True):
  """std/lm.sx's transformer-lm in plain JAX; per-layer params stacked on axis 0."""
  import jax
  import jax.numpy as jnp

  def rmsnorm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + EPS) * scale

  b, t = tokens.shape
  d = p["embed"].shape[1]
  dh = d // heads
  keep = jnp.tril(jnp.ones((t, t), bool))

  def block(x, lp):
    h = rmsnorm(x, lp["norm1"])
    split = lambda y: y.reshape(b, t, heads, dh).transpose(0, 2, 1, 3)
    q, k, v = split(h @ lp["wq"]), split(h @ lp["wk"]), split(h @ lp["wv"])
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (1.0 / math.sqrt(dh))
    a = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), -1)
    o = jnp.einsum("bhqk,bhkd->bhqd", a, v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + o @ lp["wo"]
    return x + jax.nn.gelu(rmsnorm(x, lp["norm2"]) @ lp["up"], approximate=True) @ lp["down"]

  stacked = {k: p[k] for k in LAYER}
  x = jnp.take(p["embed"], tokens, axis=0) + p["pos"]
  if unroll:
    for i in range(p["wq"].shape[0]):
      x = block(x, {k: v[i] for k, v in stacked.items()})
  else:
    x, _ = jax.lax.scan(lambda c, lp: (block(c, lp), None), x, stacked)
  return rmsnorm(x, p["norm"]) @ p["unembed"]


def leg_jax(shape: dict, total: int, init_path: str, unroll: bool = True,
            bare: bool = False) -> dict:
  """A hand-written JAX loop: scan over microbatches, f32 grad sum, optax adamw, donated state.

  Unless `bare`, it also returns the gradient norm and learning rate with the loss and
  keeps the old state on a non-finite step, as sexpgpu's step does.
  """
  import jax
  import jax.numpy as jnp
  import optax
  loader, init = _setup(shape, init_path)
  rss0 = _proc_kib("VmRSS")
  heads, k = shape["heads"], shape["microbatches"]
  lr = 1e-3
  opt = optax.adamw(lr, weight_decay=0.0)

  def loss_fn(p, tokens):
    logits = jax_model(p, tokens[:, :-1], heads, unroll)
    targets = tokens[:, 1:]
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(nll)

  def step(state, batches):
    params, opt_state = state

    def body(acc, tokens):
      loss, g = jax.value_and_grad(loss_fn)(params, tokens)
      return jax.tree_util.tree_map(jnp.add, acc, (loss, g)), None

    zeros = (jnp.float32(0), jax.tree_util.tree_map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zeros, batches)
    grads = jax.tree_util.tree_map(lambda g: g / k, grads)
    updates, new_opt = opt.update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt)
    if bare:
      return new, loss / k
    norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(norm)
    new = jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, state)
    return new, jnp.stack([loss / k, norm, jnp.float32(lr)])

  step = jax.jit(step, donate_argnums=(0,))
  t0 = time.time()
  params = jax.device_put(init)
  state = (params, opt.init(params))
  fetch = ((lambda loss: float(jax.device_get(loss))) if bare else
           (lambda m: float(jax.device_get(m)[0])))  # one transfer of the step's numbers
  return _loop(loader, k, total, t0, jax.device_put, step, state, fetch, rss0)


# --- (c) PyTorch eager ----------------------------------------------------------
def leg_torch(shape: dict, total: int, init_path: str, bare: bool = False) -> dict:
  """The same model and loop in PyTorch eager on the CPU (SDPA for causal attention).

  Unless `bare`, it also takes the gradient norm (clip_grad_norm_ with no limit) and
  skips the optimizer step when the loss or the norm is not finite.
  """
  import torch
  import torch.nn.functional as F
  loader, init = _setup(shape, init_path)
  torch.set_num_threads(os.cpu_count() or 1)
  rss0 = _proc_kib("VmRSS")
  heads, k = shape["heads"], shape["microbatches"]
  t0 = time.time()
  # one leaf tensor per layer and weight, as an nn.Module would hold them
  p = {n: torch.tensor(v, requires_grad=True) for n, v in init.items() if n not in LAYER}
  layers = [{n: torch.tensor(init[n][i], requires_grad=True) for n in LAYER}
            for i in range(shape["layers"])]
  leaves = list(p.values()) + [v for lp in layers for v in lp.values()]
  opt = torch.optim.AdamW(leaves, lr=1e-3, weight_decay=0.0)

  def rmsnorm(x, scale):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * scale

  def model(tokens):
    b, t = tokens.shape
    d = p["embed"].shape[1]
    x = p["embed"][tokens] + p["pos"]
    for lp in layers:
      h = rmsnorm(x, lp["norm1"])
      split = lambda y: y.view(b, t, heads, d // heads).transpose(1, 2)
      o = F.scaled_dot_product_attention(split(h @ lp["wq"]), split(h @ lp["wk"]),
                                         split(h @ lp["wv"]), is_causal=True)
      x = x + o.transpose(1, 2).reshape(b, t, d) @ lp["wo"]
      x = x + F.gelu(rmsnorm(x, lp["norm2"]) @ lp["up"], approximate="tanh") @ lp["down"]
    return rmsnorm(x, p["norm"]) @ p["unembed"]

  def step(state, batches):
    opt.zero_grad(set_to_none=True)
    total_loss = 0.0
    for tokens in batches:
      logits = model(tokens[:, :-1])
      loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
      (loss / k).backward()
      total_loss = total_loss + loss.detach()
    if bare:
      opt.step()
      return state, total_loss / k
    norm = torch.nn.utils.clip_grad_norm_(leaves, float("inf"))
    numbers = torch.stack([total_loss / k, norm, torch.tensor(opt.param_groups[0]["lr"])])
    if bool(torch.isfinite(numbers[:2]).all()):
      opt.step()
    return state, numbers

  return _loop(loader, k, total, t0, lambda b: torch.from_numpy(b).long(), step, None,
               (lambda loss: float(loss.item())) if bare else (lambda m: m.tolist()[0]), rss0)


def _loop(loader, k, total, t0, put, step, state, fetch, rss0) -> dict:
  """The baselines' loop, timed as sexpgpu's session times its own (after the batch is put)."""
  times, ends, losses = [], [], []
  for _ in range(total):
    batches = put(_draw(loader, k))
    t = time.perf_counter()
    state, loss = step(state, batches)
    losses.append(fetch(loss))  # host sync: the step's numbers on the host
    times.append(time.perf_counter() - t)
    ends.append(time.time())
  return {"first": ends[0] - t0, "step": times, "loop": [b - a for a, b in zip(ends, ends[1:])],
          "loss": losses, "rss0": rss0}


def run_leg(leg: str, shape_name: str, total: int, init_path: str, jax_scan: bool) -> dict:
  """One leg in this process; adds its peak RSS growth (VmHWM - VmRSS before the model)."""
  shape = SHAPES[shape_name]
  if leg == "init":
    write_init(shape, init_path)
    return {}
  if leg == "sexpgpu":
    out = leg_sexpgpu(shape, total)
  elif leg == "sexpgpu-old":
    out = leg_sexpgpu(shape, total, old_cache=True)
  elif leg.startswith("sexpgpu-s"):
    out = leg_sexpgpu(shape, total, stacking=int(leg[len("sexpgpu-s"):]))
  elif leg in ("jax", "jax-kept", "jax-bare"):
    if leg == "jax-kept":  # sexpgpu's choice for this shape, before the backend starts
      import sexpgpu
      from sexpgpu.run.backend import keep_host_memory
      from sexpgpu.run.setup import wants_kept_host_memory
      if wants_kept_host_memory(sexpgpu.compile(SX, set=shape)._c):
        keep_host_memory()
    out = leg_jax(shape, total, init_path, unroll=not jax_scan, bare=leg == "jax-bare")
  else:
    out = leg_torch(shape, total, init_path, bare=leg == "torch-bare")
  out["rss_growth_mib"] = (_proc_kib("VmHWM") - out.pop("rss0")) / 1024
  return out


# --- the driver -----------------------------------------------------------------
def _subprocess(leg, shape_name, total, init_path, jax_scan) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--leg", leg, "--shape", shape_name,
         "--steps", str(total), "--init", init_path] + (["--jax-scan"] if jax_scan else [])
  # the repo root first on the path: sexpgpu imports from this checkout however it is installed
  root = os.path.dirname(HERE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  # The hand-written JAX leg gets the XLA CPU flags sexpgpu sets for itself, so (a)/(b)
  # compares the two programs on the same compiler settings.
  from sexpgpu.run.backend import CPU_XLA_FLAGS
  if "xla_cpu_experimental_ynn_fusion_type" not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CPU_XLA_FLAGS).strip()
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
  if r.returncode != 0:
    raise RuntimeError(f"leg {leg} ({shape_name}) failed:\n{r.stderr[-4000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def have_torch() -> bool:
  """Whether PyTorch is importable here."""
  import importlib.util
  return importlib.util.find_spec("torch") is not None  # found, not imported: the driver idles


def bench_shape(shape_name: str, steps: int, warmup: int, rounds: int, legs, jax_scan) -> dict:
  """Runs every leg `rounds` times in a rotating order; pools the post-warm-up steps."""
  runs = {leg: [] for leg in legs}
  with tempfile.TemporaryDirectory() as tmp:
    init_path = os.path.join(tmp, "init.npz")
    _subprocess("init", shape_name, 0, init_path, jax_scan)
    for r in range(rounds):
      order = legs[r % len(legs):] + legs[:r % len(legs)]
      for leg in order:
        runs[leg].append(_subprocess(leg, shape_name, warmup + steps, init_path, jax_scan))
  shape = SHAPES[shape_name]
  tokens = shape["seq"] * shape["batch"] * shape["microbatches"]
  out = {"shape": shape_name, "tokens_per_step": tokens, "legs": {}}
  for leg, rs in runs.items():
    step = [t for x in rs for t in x["step"][warmup:]]
    loop = [t for x in rs for t in x["loop"][warmup:]]
    out["legs"][leg] = {
        "step_s": statistics.median(step), "loop_s": statistics.median(loop),
        "tok_s": tokens / statistics.median(step), "loop_tok_s": tokens / statistics.median(loop),
        "first_s": statistics.median([x["first"] for x in rs]),
        "rss_mib": max(x["rss_growth_mib"] for x in rs), "loss": rs[0]["loss"],
        "round_step_s": [statistics.median(x["step"][warmup:]) for x in rs],
        "round_loop_s": [statistics.median(x["loop"][warmup:]) for x in rs],
        "stacking": sorted({x["stacking"] for x in rs if "stacking" in x})}
  return out


def report(res: dict) -> list[str]:
  """The table and ratio lines of one shape."""
  L = res["legs"]
  lines = [f"== {res['shape']} {SHAPES[res['shape']]} ({res['tokens_per_step']} tokens/step)",
           f"{'leg':10} {'tok/s step':>11} {'tok/s loop':>11} {'first step s':>13} "
           f"{'peak RSS +MiB':>14} {'loss@1':>9} {'loss@3':>9}"]
  for leg, x in L.items():
    lines.append(f"{leg:10} {x['tok_s']:11.0f} {x['loop_tok_s']:11.0f} {x['first_s']:13.2f} "
                 f"{x['rss_mib']:14.0f} {x['loss'][0]:9.5f} {x['loss'][2]:9.5f}")
  a = L["sexpgpu"]
  for other in ("jax-bare", "torch-bare", "jax", "jax-kept", "torch"):
    if other not in L:
      continue
    o = L[other]
    # Each round runs the legs back to back, so a round's ratio is a paired comparison
    # that the machine's drift between rounds does not bias; the ratio is their median.
    per_round = [y / x for x, y in zip(a["round_step_s"], o["round_step_s"])]
    per_loop = [y / x for x, y in zip(a["round_loop_s"], o["round_loop_s"])]
    r_step, r_loop = statistics.median(per_round), statistics.median(per_loop)
    target = TARGETS.get(other, {}).get(res["shape"])
    lines.append(f"ratio {res['shape']} sexpgpu/{other}: loop {r_loop:.3f} (median of "
                 f"{len(per_loop)} rounds, {min(per_loop):.2f}..{max(per_loop):.2f})  step "
                 f"{r_step:.3f} ({min(per_round):.2f}..{max(per_round):.2f})  "
                 f"first-step time {a['first_s'] / o['first_s']:.2f}" + (
                     "" if target is None else f"  target loop >= {target}: "
                     f"{'met' if r_loop >= target else 'MISSED'}"))
  fixed = {int(x[len("sexpgpu-s"):]): L[x] for x in L if x.startswith("sexpgpu-s")}
  if fixed:
    best = min(fixed, key=lambda d: fixed[d]["loop_s"])
    for name in ("sexpgpu", "sexpgpu-old"):
      if name in L:
        # paired by round, as the ratios above: the machine's drift between rounds is larger
        # than the difference between two close degrees
        per = [x / y for x, y in zip(L[name]["round_loop_s"], fixed[best]["round_loop_s"])]
        r = statistics.median(per)
        source = "an older model's cache" if name.endswith("old") else "a fresh cache"
        lines.append(f"stacking {res['shape']} {name} (auto, {source}, chose "
                     f"{', '.join(L[name]['stacking'])}): loop {L[name]['loop_s'] * 1e3:.2f} ms "
                     f"against the best fixed degree {best}'s {fixed[best]['loop_s'] * 1e3:.2f} "
                     f"ms; paired by round {r:.3f} ({min(per):.2f}..{max(per):.2f})  target "
                     f"<= 1.05: {'met' if r <= 1.05 else 'MISSED'}")
  n = min(3, len(a["loss"]))
  d = max(abs(x["loss"][i] - a["loss"][i]) for x in L.values() for i in range(n))
  lines.append(f"loss {res['shape']}: max |difference| over the first 3 steps, all legs: {d:.2e}")
  return lines


def main(argv=None) -> int:
  """Runs the benchmark (or, with --leg, one leg, printing its JSON)."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shape", default="both", choices=["tiny", "compute", "both"])
  ap.add_argument("--steps", type=int, default=None, help="measured steps a leg a round")
  ap.add_argument("--warmup", type=int, default=None, help="steps dropped before timing")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--legs", default=",".join(LEGS))
  ap.add_argument("--stacking", action="store_true",
                  help="add legs at each fixed stacking degree and from an older model's cache")
  ap.add_argument("--jax-scan", action="store_true",
                  help="the JAX baseline scans over layers (as sexpgpu's repeat) not unrolled")
  ap.add_argument("--json", default=None, help="also write the results here")
  ap.add_argument("--leg", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--init", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.leg:
    print(json.dumps(run_leg(a.leg, a.shape, a.steps, a.init, a.jax_scan)))
    return 0
  legs = [x for x in a.legs.split(",") if not x.startswith("torch") or have_torch()]
  if a.stacking:
    ks = {SHAPES[n]["microbatches"] for n in (["tiny", "compute"] if a.shape == "both"
                                                else [a.shape])}
    legs += ["sexpgpu-old"] + [f"sexpgpu-s{d}" for d in sorted(
        {d for k in ks for d in range(1, k + 1) if k % d == 0})]
  if "torch" in a.legs and not any(x.startswith("torch") for x in legs):
    print("torch is not importable: skipping the PyTorch leg")
  results = []
  for name in (["tiny", "compute"] if a.shape == "both" else [a.shape]):
    warmup = DEFAULT_WARMUP[name] if a.warmup is None else a.warmup
    res = bench_shape(name, a.steps or DEFAULT_STEPS[name], warmup, a.rounds, legs, a.jax_scan)
    results.append(res)
    print("\n".join(report(res)), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

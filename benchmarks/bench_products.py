"""The recipe's matrix products on one core and on two: XLA's (as sexpgpu runs them) against
PyTorch's.

    python benchmarks/bench_products.py [--rounds 3] [--cores 1,2] [--reps 60] [--quick]
                                        [--json F]

nanoGPT's shakespeare_char recipe (configs/shakespeare-char.sx: 768 tokens a step, width
128, 4 layers, 78 characters) multiplies by its weights in three forms: the forward `A·W`,
the data gradient `G·Wᵀ` and the weight gradient `Aᵀ·G`. For each of its five weight
shapes and each form this times a chain of 16 dependent products (each one's left operand
plus a number of the one before, so none starts early and none is left out):

- `xla`: one jitted executable, XLA's CPU backend with sexpgpu's flags (YNNPACK products);
- `xla-eigen`: the same without YNNPACK (XLA's own dot emitter and Eigen);
- `torch`: the same chain in PyTorch, eager, as the recipe's twin runs it.

Each leg runs in a child process pinned to the first C usable cores (`sched_setaffinity`,
and `torch.set_num_threads(C)`), for C in --cores, in an order rotated round by round. A
leg reports the median of --reps calls of each chain, divided by 16: µs a product. The
table gives each leg's medians over rounds and its gain from the second core; the last
lines sum one step's products (the four layers' four weights and the tied head, each in
the three forms) at each leg's two-core speed. The legs' products are checked against
NumPy's in float64 first (relative error below 1e-3).

Attention's batched products are not in it. Timings depend on the processor: its header
names it (benchmarks/README.md, "The products on one core and on two").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench_nanogpt's processor()

TOKENS = 768  # batch 12 × block 64
WIDTH = 128
VOCAB = 78
# [k, n] of the recipe's weights and how many of each a step multiplies by
WEIGHTS = [((WIDTH, 3 * WIDTH), 4), ((WIDTH, WIDTH), 4), ((WIDTH, 4 * WIDTH), 4),
           ((4 * WIDTH, WIDTH), 4), ((WIDTH, VOCAB), 1)]
FORMS = ("A·W", "G·Wᵀ", "Aᵀ·G")
CHAIN = 16
LEGS = ("xla", "xla-eigen", "torch")


def operands(k: int, n: int, seed: int = 0):
  """A [TOKENS, k], W [k, n], G [TOKENS, n] as float32 NumPy arrays, CHAIN of each."""
  import numpy as np
  rng = np.random.default_rng(seed)
  f = lambda *s: (rng.standard_normal((CHAIN,) + s) / np.sqrt(s[-1])).astype(np.float32)
  return f(TOKENS, k), f(k, n), f(TOKENS, n)


def chain(form: str, a, w, g) -> list:
  """The chain's products in `form`; NumPy arrays, JAX's (traced) or PyTorch's tensors."""
  out, prev = [], None
  for i in range(CHAIN):
    x = (g if form == "G·Wᵀ" else a)[i]
    x = x if prev is None else x + prev[0, 0]
    prev = x @ w[i] if form == "A·W" else x @ w[i].T if form == "G·Wᵀ" else x.T @ g[i]
    out.append(prev)
  return out


def chain_numpy(form: str, a, w, g) -> list:
  """The chain's products in float64: the reference."""
  import numpy as np
  return chain(form, *(v.astype(np.float64) for v in (a, w, g)))


def leg_xla(form: str, a, w, g):
  """(a call that runs the chain and waits, its products) in one XLA executable."""
  import functools
  import jax
  import jax.numpy as jnp
  args = [jnp.asarray(v) for v in (a, w, g)]
  fn = jax.jit(functools.partial(chain, form)).lower(*args).compile()
  return lambda: jax.block_until_ready(fn(*args)), [jax.device_get(o) for o in fn(*args)]


def leg_torch(form: str, a, w, g):
  """(a call that runs the chain, its products) in PyTorch, eager."""
  import torch
  a, w, g = (torch.from_numpy(v) for v in (a, w, g))

  def call():
    with torch.no_grad():
      return chain(form, a, w, g)

  return call, [o.numpy() for o in call()]


def child(leg: str, cores: int, reps: int) -> dict:
  """µs a product for each weight shape and form, in this process (pinned already)."""
  import numpy as np
  from bench_blas_ffi import median_us
  if leg == "torch":
    import torch
    torch.set_num_threads(cores)
  else:
    import jax  # noqa: F401  (XLA_FLAGS was set by the parent)
  out = {}
  for (k, n), _ in WEIGHTS:
    for form in FORMS:
      a, w, g = operands(k, n)
      call, got = (leg_torch if leg == "torch" else leg_xla)(form, a, w, g)
      want = chain_numpy(form, a, w, g)
      err = max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(got, want))
      if err > 1e-3:
        raise SystemExit(f"bench_products: {leg} {form} [{k}, {n}] differs from NumPy's "
                         f"float64 products by {err:.2e}")
      out[f"{k}x{n} {form}"] = median_us(call, reps, warm=5) / CHAIN
  return out


def run_child(leg: str, cores: int, reps: int) -> dict:
  """One leg in a child process pinned to the first `cores` usable cores."""
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "")
  if leg == "xla":
    sys.path.insert(0, ROOT)
    from sexpgpu.run.backend import CPU_XLA_FLAGS
    env["XLA_FLAGS"] = (flags + " " + CPU_XLA_FLAGS).strip()
  elif leg == "xla-eigen":
    env["XLA_FLAGS"] = (flags + " --xla_cpu_experimental_ynn_fusion_type=").strip()
  done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", leg,
                         "--cores", str(cores), "--reps", str(reps)],
                        capture_output=True, text=True, env=env)
  if done.returncode:
    raise SystemExit(f"bench_products: the {leg} leg on {cores} core(s) failed:\n"
                     f"{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def step_sum(us: dict) -> float:
  """ms of one step's products (each weight's count × its three forms) at these µs."""
  return sum(count * us[f"{k}x{n} {form}"] for (k, n), count in WEIGHTS for form in FORMS) / 1e3


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--cores", default="1,2", help="core counts, comma-separated")
  p.add_argument("--reps", type=int, default=60, help="timed calls of each chain a leg")
  p.add_argument("--legs", default=",".join(LEGS))
  p.add_argument("--quick", action="store_true", help="1 round of 5 calls: a smoke")
  p.add_argument("--json", help="write the medians here")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.quick:
    args.rounds, args.reps = 1, 5
  usable = sorted(os.sched_getaffinity(0))
  try:
    cores = [int(c) for c in args.cores.split(",")]
  except ValueError:
    p.error(f"--cores takes counts such as 1,2, not {args.cores!r}")
  if args.rounds < 1 or args.reps < 1:
    p.error("--rounds and --reps take 1 or more")
  if any(c < 1 or c > len(usable) for c in cores):
    p.error(f"--cores: this process may use {len(usable)} core(s), asked for {args.cores}")
  if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
    p.error(f"--json: the folder of {args.json} does not exist")
  legs = args.legs.split(",")
  if not legs or any(leg not in LEGS for leg in legs):
    p.error(f"--legs takes some of {','.join(LEGS)}")
  if args.child:
    os.sched_setaffinity(0, usable[:cores[0]])
    print(json.dumps(child(args.child, cores[0], args.reps)))
    return

  from bench_nanogpt import processor
  print(f"bench_products: {args.rounds} round(s), {args.reps} calls a chain of {CHAIN}, "
        f"cores {cores}, {processor()}, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True)
  runs = [(leg, c) for leg in legs for c in cores]
  got: dict = {run: [] for run in runs}
  try:
    for r in range(args.rounds):
      order = runs[r % len(runs):] + runs[:r % len(runs)]
      for leg, c in order:
        got[(leg, c)].append(run_child(leg, c, args.reps))
      print(f"round {r + 1} done, load {os.getloadavg()[0]:.2f}", flush=True)
  except KeyboardInterrupt:
    sys.exit("bench_products: interrupted")
  med = {run: {key: statistics.median(d[key] for d in got[run]) for key in got[run][0]}
         for run in runs}

  head = f"{'product':>18}" + "".join(f"{f'{leg} {c}c':>14}" for leg, c in runs)
  if len(cores) > 1:
    head += "".join(f"{leg + ' gain':>16}" for leg in legs)
  print("\nµs a product (median over rounds)")
  print(head)
  for key in med[runs[0]]:
    shape, form = key.split(" ", 1)
    row = f"{form + ' [' + shape.replace('x', ',') + ']':>18}"
    row += "".join(f"{med[run][key]:14.0f}" for run in runs)
    if len(cores) > 1:
      row += "".join(f"{med[(leg, cores[0])][key] / med[(leg, cores[-1])][key]:15.2f}x"
                     for leg in legs)
    print(row)
  print(f"\none step's products ({sum(c for _, c in WEIGHTS)} weights × 3 forms), ms:")
  for leg, c in runs:
    print(f"  {leg:>10} on {c} core(s): {step_sum(med[(leg, c)]):6.2f}")
  top = cores[-1]
  if "torch" in legs:
    for leg in legs:
      if leg != "torch":
        print(f"  {leg} ÷ torch on {top} core(s): "
              f"{step_sum(med[(leg, top)]) / step_sum(med[('torch', top)]):.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({f"{leg} {c}": med[(leg, c)] for leg, c in runs}, f, indent=1)


if __name__ == "__main__":
  main()

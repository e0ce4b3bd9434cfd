"""XLA's CPU products against a BLAS called from inside the step, as an XLA FFI custom call.

    python benchmarks/bench_blas_ffi.py [--data DIR] [--rounds 5] [--steps 100]

Compiles benchmarks/blas_ffi.cc with the system's C++ compiler ($CXX, else c++) against
jaxlib's FFI headers into a temporary folder, binds it to the OpenBLAS that NumPy bundles
(its 64-bit-integer `cblas_sgemm`), registers it with `jax.ffi.register_ffi_target`, then
measures, in this one process:

- products: 16 chained products `A·W` at the shapes of nanoGPT's shakespeare_char recipe
  (768 tokens a step, width 128) in one executable, XLA's own against the custom call, and
  8 weight gradients `Aᵀ·G` the same way; the median of 200 calls, µs a product;
- the step: `sexpgpu run configs/shakespeare-char.sx --steps N` (one batch a pass), in
  child processes alternated round by round on warm caches of their own, with the shipped
  matmul rule (`lower/matmul.py`) and with one whose forward product and both gradients
  are the custom call (the transposes passed as BLAS flags); each run's median period
  between its `step` events (as bench_nanogpt.py times sexpgpu); the median of each over
  the rounds and of their paired ratios, and the first step's loss of each.

sexpgpu does not ship the custom call: this measures whether a BLAS could take XLA's
products on the CPU (benchmarks/README.md, "A BLAS inside the step").
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "configs", "shakespeare-char.sx")
SHAPES = [(128, 384), (128, 128), (128, 512), (512, 128)]  # [k, n] of the recipe's products
TOKENS = 768  # batch 12 × block 64


def build(out_dir: str) -> str:
  """The custom call's shared library, compiled from blas_ffi.cc into out_dir."""
  import jax.ffi
  cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not cxx:
    sys.exit("bench_blas_ffi: no C++ compiler found (set CXX to one)")
  lib = os.path.join(out_dir, "libsx_blas_ffi.so")
  done = subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
                         "-I" + jax.ffi.include_dir(), os.path.join(HERE, "blas_ffi.cc"),
                         "-o", lib, "-ldl"], capture_output=True, text=True)
  if done.returncode:
    sys.exit(f"bench_blas_ffi: {cxx} could not compile blas_ffi.cc:\n{done.stderr[-3000:]}")
  return lib


def numpy_blas() -> tuple[str, str]:
  """NumPy's bundled OpenBLAS and its 64-bit-integer cblas_sgemm's symbol."""
  import numpy as np
  libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs",
                                "libscipy_openblas64_*.so"))
  if not libs:
    sys.exit("bench_blas_ffi: NumPy's bundled OpenBLAS (numpy.libs/libscipy_openblas64_*.so) "
             "was not found; this benchmark needs NumPy's wheel")
  return libs[0], "scipy_cblas_sgemm64_"


def register(lib_path: str):
  """Registers the custom call; returns blas_matmul(a, b, ta, tb) and a matmul rule with VJP."""
  import ctypes
  import jax
  import jax.numpy as jnp
  lib = ctypes.cdll.LoadLibrary(lib_path)
  blas, symbol = numpy_blas()
  if lib.sx_blas_init(blas.encode(), symbol.encode()) != 0:
    sys.exit(f"bench_blas_ffi: {symbol} not found in {blas}")
  jax.ffi.register_ffi_target("sx_blas_gemm", jax.ffi.pycapsule(lib.SxBlasGemm), platform="cpu")

  def blas_matmul(a, b, ta=False, tb=False):
    m = a.shape[1] if ta else a.shape[0]
    n = b.shape[0] if tb else b.shape[1]
    return jax.ffi.ffi_call("sx_blas_gemm", jax.ShapeDtypeStruct((m, n), jnp.float32))(
        a, b, ta=ta, tb=tb)

  @jax.custom_vjp
  def rule(a, w):
    return blas_matmul(a.reshape(-1, a.shape[-1]), w).reshape(*a.shape[:-1], w.shape[1])

  def fwd(a, w):
    return rule(a, w), (a, w)

  def bwd(res, g):
    a, w = res
    k, n = w.shape
    g2 = g.reshape(-1, n)
    return (blas_matmul(g2, w, tb=True).reshape(a.shape),
            blas_matmul(a.reshape(-1, k), g2, ta=True))

  rule.defvjp(fwd, bwd)
  return blas_matmul, rule


def median_us(fn, calls: int = 200, warm: int = 10) -> float:
  """The median of `calls` timed calls of fn, after `warm` untimed ones, in µs."""
  for _ in range(warm):
    fn()
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e6


def products(blas_matmul) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.RandomState(0)
  print("products, µs each (16 chained A·W; 8 weight gradients Aᵀ·G):")
  for k, n in SHAPES:
    a = jnp.asarray(rng.randn(TOKENS, k).astype(np.float32))
    ws = [jnp.asarray(rng.randn(k, n).astype(np.float32) * 0.05) for _ in range(8)]
    vs = [jnp.asarray(rng.randn(n, k).astype(np.float32) * 0.05) for _ in range(8)]
    g = jnp.asarray(rng.randn(TOKENS, n).astype(np.float32))

    def chain(mm):
      def f(a, ws, vs):
        for w, v in zip(ws, vs):
          a = mm(mm(a, w), v)
        return a
      return jax.jit(f)

    xla_fwd, ffi_fwd = chain(jnp.matmul), chain(blas_matmul)
    xla_wg = jax.jit(lambda a, g: [(a * (i + 1)).T @ g for i in range(8)])
    ffi_wg = jax.jit(lambda a, g: [blas_matmul(a * (i + 1), g, ta=True) for i in range(8)])
    diff = float(jnp.abs(xla_fwd(a, ws, vs) - ffi_fwd(a, ws, vs)).max())
    diff = max([diff] + [float(jnp.abs(x - y).max()) for x, y in zip(xla_wg(a, g), ffi_wg(a, g))])
    row = [median_us(lambda f=f: jax.block_until_ready(f(a, ws, vs))) / 16
           for f in (xla_fwd, ffi_fwd)]
    row += [median_us(lambda f=f: jax.block_until_ready(f(a, g))) / 8 for f in (xla_wg, ffi_wg)]
    print(f"  [{TOKENS}, {k}] x [{k}, {n}]  A·W XLA {row[0]:6.0f}  BLAS {row[1]:6.0f}   "
          f"Aᵀ·G XLA {row[2]:6.0f}  BLAS {row[3]:6.0f}   max |difference| {diff:.1e}")


def step_ab(lib: str, text: str, rounds: int, steps: int, tmp: str) -> None:
  """The run with each rule, as alternated child processes on warm caches of their own."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "xla"),
             SEXPGPU_CACHE_DIR=os.path.join(tmp, "sexpgpu"))
  periods = {"xla": [], "blas": []}
  losses = {}
  for r in range(rounds + 1):  # round 0 fills the caches with both steps: not counted
    for leg in periods:
      metrics = os.path.join(tmp, f"{leg}-{r}.jsonl")
      child = subprocess.run([sys.executable, os.path.abspath(__file__), "--leg", leg,
                              "--lib", lib, "--text", text, "--steps", str(steps),
                              "--metrics", metrics], env=env, capture_output=True, text=True)
      if child.returncode:
        sys.exit(f"bench_blas_ffi: the {leg} run failed:\n{child.stderr[-3000:]}")
      events = [json.loads(line) for line in open(metrics)]
      stamps = [e["time"] for e in events if e["kind"] == "step"]
      losses[leg] = next(e["train/loss"] for e in events if e["kind"] == "step")
      if r:  # the median period between steps' numbers, after the first two steps
        periods[leg].append(statistics.median(b - a for a, b in zip(stamps[2:], stamps[3:]))
                            * 1000)
  ratios = [b / x for b, x in zip(periods["blas"], periods["xla"])]
  for leg, ms in periods.items():
    print(f"step {leg:4s} ms {statistics.median(ms):6.2f} ({min(ms):.2f}..{max(ms):.2f})  "
          f"first step's loss {losses[leg]:.6f}")
  print(f"step blas ÷ xla {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        f" over {rounds} rounds of {steps} steps")


def leg(args) -> int:
  """A child: `sexpgpu run` of the config, its products the custom call's for --leg blas."""
  from sexpgpu.cli.main import main as sexpgpu_main
  if args.leg == "blas":
    from sexpgpu.lower import matmul
    matmul._matmul_t = register(args.lib)[1]
  return sexpgpu_main(["run", CONFIG, "--set", f"text={args.text}", "--set", "eval-batches=1",
                       "--steps", str(args.steps), "--metrics", "jsonl:" + args.metrics])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--data", default=os.path.join(ROOT, "cache", "shakespeare"),
                  help="the prepared text's folder (benchmarks/prepare_shakespeare.py)")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=100)
  for hidden in ("--leg", "--lib", "--text", "--metrics"):
    ap.add_argument(hidden, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.rounds < 1 or args.steps < 5:
    ap.error("--rounds must be at least 1 and --steps at least 5 (the periods after step 2)")
  sys.path.insert(0, ROOT)
  if args.leg:
    sys.exit(leg(args))
  text = os.path.abspath(os.path.join(args.data, "input.txt"))
  if not os.path.exists(text):
    sys.exit(f"bench_blas_ffi: {text} is missing: python benchmarks/prepare_shakespeare.py "
             f"{args.data}")
  from sexpgpu.run.backend import cpu_flags
  cpu_flags()  # the run's XLA flags, for the products too
  try:
    with tempfile.TemporaryDirectory() as tmp:
      lib = build(tmp)
      print(f"bench_blas_ffi: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
      products(register(lib)[0])
      step_ab(lib, text, args.rounds, args.steps, tmp)
  except KeyboardInterrupt:  # the child run stops on the same Ctrl-C
    sys.exit("bench_blas_ffi: interrupted; nothing measured is printed past this point")


if __name__ == "__main__":
  main()

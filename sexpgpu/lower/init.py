"""Parameter initializers: randomness from the run's seed and each parameter's path."""

from __future__ import annotations

import concurrent.futures
import zlib

import jax
import jax.numpy as jnp

from sexpgpu.ir.graph import Param
from sexpgpu.ir.ops import DTYPES, fan_in_std
from sexpgpu.ir.reference import PREFIX


def _one(key, p: Param, shape):
  dt = DTYPES[p.dtype]
  k, v = p.init.kind, p.init.value
  if k == "zeros":
    return jnp.zeros(shape, dt)
  if k == "ones":
    return jnp.ones(shape, dt)
  if k == "constant":
    return jnp.full(shape, v, dt)
  if k == "normal":
    return (v * jax.random.normal(key, shape, jnp.float32)).astype(dt)
  if k == "truncated-normal":
    return (v * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dt)
  if k == "uniform":
    return jax.random.uniform(key, shape, jnp.float32, -v, v).astype(dt)
  if k == "fan-in":
    return (fan_in_std(shape, v) * jax.random.normal(key, shape, jnp.float32)).astype(dt)
  raise ValueError(f"unknown initializer {k}")


def init_param(seed: int, p: Param):
  """One parameter's initial value; layer i of a repeat folds in i. A reference copy
  (ir/reference.py) draws as the parameter it copies: a cold start's values, bitwise."""
  path = p.path[len(PREFIX):] if p.path.startswith(PREFIX) else p.path
  key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()) & 0x7FFFFFFF)

  def make(key, stack):
    if not stack:
      return _one(key, p, p.shape)
    return jax.vmap(lambda i: make(jax.random.fold_in(key, i), stack[1:]))(jnp.arange(stack[0]))

  return make(key, p.stack)


def init_params(seed: int, params: dict[str, Param]) -> dict:
  """Every parameter, by path, initialized on the default device."""
  fn = jax.jit(lambda: {path: init_param(seed, p) for path, p in sorted(params.items())})
  return fn()


# XLA's LLVM optimisation level for the initial state's executable on the CPU. Its random
# draws (threefry's rounds, unrolled, once for each random parameter) take LLVM's default
# level (3) about a second each to compile, for an executable that runs once; level 1
# compiles them in about half the time and gives the same bits (tests/test_init_executable.py
# compares every initializer kind; level 0 does not: a last bit in 4% of a normal draw).
# On a GPU, or when XLA_FLAGS sets a level, the options are XLA's.
CPU_INIT_OPTIONS = {"xla_backend_optimization_level": 1}


def init_options(platform: str, xla_flags: str | None = None) -> dict | None:
  """The compile options of the initial state's executable on `platform`, or None (XLA's).

  Args:
    platform: the run's platform.
    xla_flags: XLA_FLAGS (the environment's when None); a level set there is kept.
  """
  import os
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  if platform != "cpu" or "xla_backend_optimization_level" in flags:
    return None
  return CPU_INIT_OPTIONS


def compile_init(fn, platform: str, device=None, **jit_kw):
  """Compiles `fn` (no arguments; it makes the initial state) ahead of time.

  Args:
    fn: the function; its name is the compile's (the transient compile line shows it).
    platform: the run's platform (its options: init_options).
    device: the device it runs on (JAX's default device when None).
    jit_kw: jax.jit's keywords (out_shardings).

  Returns:
    The compiled executable: call it with no arguments.
  """
  def lower():
    return jax.jit(fn, **jit_kw).lower()
  if device is None:
    lowered = lower()
  else:
    with jax.default_device(device):
      lowered = lower()
  return lowered.compile(init_options(platform))


def compile_init_soon(fn, platform: str, device=None) -> concurrent.futures.Future:
  """compile_init in a thread of its own, started now: XLA's compile releases the GIL, so
  the initial state builds while the caller compiles the steps. Its result (or error) is
  the future's. The thread is not a daemon: a process that ends meanwhile waits for it."""
  return in_thread("sexpgpu-init", compile_init, fn, platform, device)


def in_thread(name: str, fn, *args) -> concurrent.futures.Future:
  """`fn(*args)` started now in a thread of its own named `name` (a compile: XLA releases
  the GIL while it compiles). Its result (or error) is the future's. The thread is not a
  daemon: a process that ends meanwhile waits for it."""
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
  try:
    return pool.submit(fn, *args)
  finally:
    pool.shutdown(wait=False)

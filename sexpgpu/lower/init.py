"""Parameter initializers: randomness from the run's seed and each parameter's path."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from sexpgpu.ir.graph import Param
from sexpgpu.ir.ops import DTYPES, fan_in_std


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
  """One parameter's initial value; layer i of a repeat folds in i."""
  key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(p.path.encode()) & 0x7FFFFFFF)

  def make(key, stack):
    if not stack:
      return _one(key, p, p.shape)
    return jax.vmap(lambda i: make(jax.random.fold_in(key, i), stack[1:]))(jnp.arange(stack[0]))

  return make(key, p.stack)


def init_params(seed: int, params: dict[str, Param]) -> dict:
  """Every parameter, by path, initialized on the default device."""
  fn = jax.jit(lambda: {path: init_param(seed, p) for path, p in sorted(params.items())})
  return fn()

"""The CPU's lowering of broadcasting: a gradient summed over leading axes as a product.

The gradient of an operand broadcast along leading axes (a bias added to every token, a
layernorm's gain, the position table added to every row of a batch) is its cotangent
summed over those axes: a column sum such as [12, 64, 512] -> [512]. XLA's CPU backend
rewrites a sum over more than 32 elements into a windowed reduction (reduce-window of 32,
then a reduce), which it runs element by element, strided, without vectorizing across the
kept columns: measured 0.5 ms for [768, 512] -> [512], against 0.06 ms for the same sum as
a product with a vector of ones. In nanoGPT's recipe (benchmarks/bench_nanogpt.py) the
column sums were 14% of the train step's op time, and summed as products the step takes
0.89-0.90 of the time (paired rounds in one process), with the same losses to float32
rounding. XLA's default YNNPACK fusions (reductions too, not only products) gain as much
but change every reduction's order, the loss's included; this changes only these sums.
GPUs sum columns at full speed: not used there.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sexpgpu.ir.ops import OPS
from sexpgpu.lower.registry import register_lowering

# The fewest summed rows that take the product. The gain measured the same from 2 rows up
# (nanoGPT's position table is summed over a batch of 12); below 8 there is little to sum.
MIN_ROWS = 8


def _lead_axes(shape: tuple, out: tuple) -> int | None:
  """k when `shape` broadcast to `out` repeats it along out's first k axes only, else None."""
  if shape == out or len(shape) > len(out):
    return None
  padded = (1,) * (len(out) - len(shape)) + tuple(shape)
  k = 0
  while k < len(out) and padded[k] == 1 and out[k] != 1:
    k += 1
  if k == 0 or padded[k:] != tuple(out[k:]) or math.prod(out[k:]) < 2:
    return None
  return k


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _spread(x, shape, out):
  return jnp.broadcast_to(x, out)


def _spread_fwd(x, shape, out):
  return jnp.broadcast_to(x, out), None


def _spread_bwd(shape, out, _, g):
  n = math.prod(shape)
  rows = g.size // n
  return ((jnp.ones((rows,), g.dtype) @ g.reshape(rows, n)).reshape(shape),)


_spread.defvjp(_spread_fwd, _spread_bwd)


def spread(x, shape: tuple):
  """x broadcast to `shape`; its gradient summed as a product when that is the faster way.

  A float32 operand repeated along leading axes over at least MIN_ROWS rows takes the
  product; anything else is jnp.broadcast_to.
  """
  shape = tuple(shape)
  k = _lead_axes(tuple(x.shape), shape)
  if (k is None or x.dtype != jnp.float32 or math.prod(shape[:k]) < MIN_ROWS):
    return jnp.broadcast_to(x, shape)
  return _spread(x, tuple(x.shape), shape)


def _spreading(fn):
  """A broadcasting binary op whose broadcast operand is spread (above) first."""
  def rule(ctx, a, b):
    if (isinstance(a, jax.Array) and isinstance(b, jax.Array)
        and a.shape != b.shape and a.dtype == b.dtype == jnp.float32):
      out = jnp.broadcast_shapes(a.shape, b.shape)
      a, b = spread(a, out), spread(b, out)
    return fn(a, b)
  return rule


for _name, _fn in (("+", jnp.add), ("-", jnp.subtract), ("*", jnp.multiply),
                   ("/", jnp.divide)):
  register_lowering(_name, _spreading(_fn), platform="cpu")


def broadcast_cpu(ctx, x, *, shape):
  """broadcast on the CPU: new leading axes whose gradient is summed as a product."""
  if isinstance(x, jax.Array):  # a tracer is one too
    return spread(x, shape)
  return OPS["broadcast"].lower(ctx, x, shape=shape)


register_lowering("broadcast", broadcast_cpu, platform="cpu")

"""The CPU's lowering of matmul: a gradient that XLA's CPU backend runs as plain products."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sexpgpu.ir.ops import OPS
from sexpgpu.lower.registry import register_lowering


# On the CPU, the gradient of A @ W with respect to A is G @ Wᵀ, which XLA hands to
# YNNPACK as a product with a transposed operand: measured 1.5x slower per flop than
# the plain product (benchmarks/, the compute shape). Materializing Wᵀ first (behind an
# optimization barrier, so XLA does not fold the transpose back into the product) makes
# it a plain product: 6% off a whole train step at the compute shape, 9% at the tiny one,
# with bitwise the same losses there. GPUs take either layout at full speed: not used.
@jax.custom_vjp
def _matmul_t(a, w):
  return jnp.matmul(a, w)


def _matmul_t_fwd(a, w):
  return jnp.matmul(a, w), (a, w)


def _matmul_t_bwd(res, g):
  a, w = res
  da = jnp.matmul(g, jax.lax.optimization_barrier(w.T))
  k, n = w.shape
  dw = jnp.matmul(a.reshape(-1, k).T, g.reshape(-1, n))
  return da, dw


_matmul_t.defvjp(_matmul_t_fwd, _matmul_t_bwd)


def matmul_cpu(ctx, a, b):
  """matmul on the CPU: f32 products by a weight matrix take the plain-product gradient."""
  if (b.ndim == 2 and a.ndim >= 1 and ctx.compute_dtype(a) == jnp.float32
      and a.dtype == b.dtype == jnp.float32):
    return _matmul_t(a, b)
  return OPS["matmul"].lower(ctx, a, b)


register_lowering("matmul", matmul_cpu, platform="cpu")

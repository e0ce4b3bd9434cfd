"""Lowering rules that differ by device: the registry, the CPU's matmul gradient."""

import re

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from sexpgpu.ir.ops import OPS, LowerCtx
from sexpgpu.lower.rules import lowering, register_lowering, registered


def _loss(platform):
  ctx = LowerCtx("f32", platform=platform)

  def f(a, w):
    return jnp.sum(jnp.tanh(lowering("matmul", platform)(ctx, a, w)))
  return f


def test_cpu_matmul_gradient_equals_the_plain_one():
  ka, kw = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (3, 5, 16), jnp.float32)
  w = jax.random.normal(kw, (16, 24), jnp.float32)
  want = jax.jit(jax.value_and_grad(_loss(None), argnums=(0, 1)))(a, w)
  got = jax.jit(jax.value_and_grad(_loss("cpu"), argnums=(0, 1)))(a, w)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def _dgrad_dots(platform):
  """The compiled gradient's products with the upstream gradient: their contracted axes."""
  a = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((128, 256), jnp.float32)
  hlo = jax.jit(jax.grad(_loss(platform), argnums=0)).lower(a, w).compile().as_text()
  return re.findall(r"f32\[64,128\]\{1,0\} dot\([^)]*\), lhs_contracting_dims=\{(\d)\}, "
                    r"rhs_contracting_dims=\{(\d)\}", hlo)


def test_cpu_matmul_gradient_multiplies_by_a_materialized_transpose():
  # plain: dA = G·Wᵀ contracts W's second axis; on the CPU, Wᵀ is materialized first and
  # the product contracts its first axis (the layout YNNPACK runs at full speed)
  assert _dgrad_dots(None) == [("1", "1")]
  assert _dgrad_dots("cpu") == [("1", "0")]


def test_bf16_products_keep_the_plain_rule():
  ctx = LowerCtx("bf16", platform="cpu")
  a = jnp.ones((4, 8), jnp.float32)
  w = jnp.ones((8, 2), jnp.float32)
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda a: jnp.sum(lowering("matmul", "cpu")(ctx, a, w))))(a))
  assert "optimization_barrier" not in jaxpr and "bf16" in jaxpr


def test_a_platform_rule_replaces_the_reference_only_there():
  assert lowering("matmul", "cpu") is not OPS["matmul"].lower
  assert lowering("matmul", "gpu") is OPS["matmul"].lower
  assert lowering("matmul", None) is OPS["matmul"].lower
  assert lowering("sdpa", "cuda") is lowering("sdpa", "gpu")  # a CUDA device's platform name
  assert lowering("sdpa", "gpu") is not lowering("sdpa", "cpu")
  assert lowering("relu", "gpu") is OPS["relu"].lower
  assert lowering("chunked-cross-entropy", None) is not OPS["chunked-cross-entropy"].lower


def test_every_registered_rule_lowers_an_op_of_the_table():
  assert {op for op, _ in registered()} <= set(OPS)
  with pytest.raises(ValueError, match="no op"):
    register_lowering("no-such-op", lambda ctx, x: x)
  with pytest.raises(ValueError, match="already"):
    register_lowering("matmul", lambda ctx, a, b: a, platform="cpu")

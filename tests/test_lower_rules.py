"""Lowering rules that differ by device: the registry, the CPU's matmul and broadcast gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np

import pytest

from conftest import RUN_CPU_OPTIONS

from sexpgpu.ir.ops import OPS, LowerCtx
from sexpgpu.lower import broadcast
from sexpgpu.lower.rules import lowering, register_lowering, registered
from sexpgpu.run.backend import CPU_XLA_FLAGS


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


@pytest.mark.parametrize("op", ["+", "-", "*", "/"])
@pytest.mark.parametrize("shapes,spread", [
    (((12, 64, 48), (48,)), True),         # a bias over every token: summed as a product
    (((64, 48), (12, 64, 48)), True),      # a position table over a batch (second operand)
    (((12, 64, 48), (12, 1, 48)), False),  # repeated along a middle axis: the plain rule
    (((4, 48), (48,)), False),             # fewer rows than broadcast.MIN_ROWS: the plain rule
])
def test_cpu_broadcast_gradients_equal_the_plain_ones(op, shapes, spread):
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, shapes[0], jnp.float32)
  b = jax.random.uniform(kb, shapes[1], jnp.float32, 0.5, 2.0)

  def loss(platform):
    ctx = LowerCtx("f32", platform=platform)
    return lambda a, b: jnp.sum(jnp.tanh(lowering(op, platform)(ctx, a, b)))
  want = jax.jit(jax.value_and_grad(loss(None), argnums=(0, 1)))(a, b)
  got = jax.jit(jax.value_and_grad(loss("cpu"), argnums=(0, 1)))(a, b)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-5)
  assert ("custom_vjp" in str(jax.make_jaxpr(loss("cpu"))(a, b))) == spread


def test_the_cpu_broadcast_op_spreads_new_leading_axes():
  ctx = LowerCtx("f32", platform="cpu")
  x = jnp.arange(48, dtype=jnp.float32)
  g = jax.grad(lambda x: jnp.sum(lowering("broadcast", "cpu")(ctx, x, shape=(3, 16, 48)) ** 2))(x)
  np.testing.assert_allclose(np.asarray(g), 2 * 48 * np.arange(48), rtol=1e-6)


def _bias_gradient_hlo(platform):
  """The compiled gradient of a bias over [12, 64, 512], under the run's XLA CPU options."""
  ctx = LowerCtx("f32", platform=platform)
  x = jax.ShapeDtypeStruct((12, 64, 512), jnp.float32)
  b = jax.ShapeDtypeStruct((512,), jnp.float32)
  f = lambda b, x: jnp.sum(jnp.tanh(lowering("+", platform)(ctx, x, b)))  # noqa: E731
  return jax.jit(jax.grad(f)).lower(b, x).compile(RUN_CPU_OPTIONS).as_text()


def test_cpu_bias_gradient_is_a_product_not_a_windowed_sum():
  # XLA's CPU backend sums the 768 rows of a plain bias gradient in windows of 32
  # (reduce-window), element by element; the CPU rule sums them as ones · G instead
  assert CPU_XLA_FLAGS == "--xla_cpu_experimental_ynn_fusion_type=dot"  # RUN_CPU_OPTIONS's
  assert "reduce-window" in _bias_gradient_hlo(None)
  hlo = _bias_gradient_hlo("cpu")
  assert "reduce-window" not in hlo
  assert re.search(r"= f32\[(1,)?512\]\{[0-9,]+\} dot\(", hlo)


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

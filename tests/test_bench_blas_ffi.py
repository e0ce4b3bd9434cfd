"""benchmarks/bench_blas_ffi.py's custom call computes what XLA's products do, gradients too
(its measurements in benchmarks/README.md compare the two)."""

import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_blas_ffi  # noqa: E402


@pytest.fixture(scope="module")
def blas(tmp_path_factory):
  if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
    pytest.skip("no C++ compiler for the benchmark's custom call")
  return bench_blas_ffi.register(bench_blas_ffi.build(str(tmp_path_factory.mktemp("ffi"))))


def test_the_custom_call_is_the_product_and_its_transposes(blas):
  blas_matmul, _ = blas
  rng = np.random.RandomState(0)
  a, w = rng.randn(96, 40).astype(np.float32), rng.randn(40, 24).astype(np.float32)
  g = rng.randn(96, 24).astype(np.float32)
  np.testing.assert_allclose(blas_matmul(a, w), a @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(blas_matmul(g, w, tb=True), g @ w.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(blas_matmul(a, g, ta=True), a.T @ g, rtol=1e-5, atol=1e-5)
  assert blas_matmul(a, w).shape == (96, 24)


def test_the_rule_takes_the_matmul_gradients_of_a_batched_input(blas):
  _, rule = blas
  rng = np.random.RandomState(1)
  x = jnp.asarray(rng.randn(3, 32, 40).astype(np.float32))
  w = jnp.asarray(rng.randn(40, 24).astype(np.float32))

  def loss(mm):
    return lambda x, w: jnp.sum(jnp.tanh(mm(x, w)) ** 2)

  got = jax.jit(jax.value_and_grad(loss(rule), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.value_and_grad(loss(jnp.matmul), argnums=(0, 1)))(x, w)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

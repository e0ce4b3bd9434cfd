"""Pallas kernels (interpreted on the CPU) and the ops that rewrites introduce, against plain jnp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sexpgpu.ir.ops import OPS, LowerCtx
from sexpgpu.lower.kernels import chunked_xent, flash_attention
from sexpgpu.lower.rules import lowering

TOL = dict(rtol=1e-5, atol=1e-5)


def normal(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(0.0, scale, shape), jnp.float32)


# --- flash attention ----------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq,tk,block", [(32, 32, 16), (16, 32, 16), (64, 64, 64), (32, 64, 32)])
def test_flash_forward_matches_reference(monkeypatch, causal, tq, tk, block):
  monkeypatch.setattr(flash_attention, "BLOCK_Q", block)
  monkeypatch.setattr(flash_attention, "BLOCK_K", block)
  q, k, v = normal((2, 3, tq, 16), 0), normal((2, 3, tk, 16), 1), normal((2, 3, tk, 32), 2)
  ref = flash_attention.reference(q, k, v, causal=causal, scale=0.3)
  fwd = lambda q, k, v: flash_attention.flash_forward(q, k, v, causal=causal, scale=0.3,
                                                      interpret=True)
  for wrap in (lambda f: f, jax.jit):
    np.testing.assert_allclose(np.asarray(wrap(fwd)(q, k, v)), np.asarray(ref), **TOL)


def test_flash_attention_gradients_are_xlas():
  q, k, v = normal((1, 2, 32, 16), 3), normal((1, 2, 32, 16), 4), normal((1, 2, 32, 16), 5)
  w = normal((1, 2, 32, 16), 6)

  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v, causal=True, scale=0.25) * w)

  flash = lambda *a, **kw: flash_attention.flash_attention(*a, **kw, interpret=True)
  g0 = jax.grad(loss(flash_attention.reference), argnums=(0, 1, 2))(q, k, v)
  for wrap in (lambda f: f, jax.jit):
    g1 = wrap(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g0):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_flash_refuses_shapes_it_does_not_take():
  assert flash_attention.refusal((1, 2, 64, 16), (1, 2, 64, 16), (1, 2, 64, 16), True) is None
  assert "power of two" in flash_attention.refusal((1, 2, 64, 12), (1, 2, 64, 12),
                                                   (1, 2, 64, 12), True)
  assert "multiples" in flash_attention.refusal((1, 2, 100, 16), (1, 2, 100, 16),
                                                (1, 2, 100, 16), False)


# --- chunked cross-entropy ------------------------------------------------------------
@pytest.mark.parametrize("vocab,block_v", [(300, 128), (256, 64), (50, 128)])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_xent_kernel_matches_reference(vocab, block_v, masked):
  h, w = normal((3, 7, 16), 0), normal((16, vocab), 1)
  y = jnp.asarray(np.random.default_rng(2).integers(0, vocab, (3, 7)), jnp.int32)
  mask = (y % 3 != 0) if masked else None
  ref = chunked_xent.reference(h, w, y, mask)
  f = lambda h, w, y: chunked_xent.chunked_cross_entropy(h, w, y, mask, block_n=8,
                                                         block_v=block_v, interpret=True)
  for wrap in (lambda f: f, jax.jit):
    np.testing.assert_allclose(np.asarray(wrap(f)(h, w, y)), np.asarray(ref), **TOL)


@pytest.mark.parametrize("chunks", [1, 3, 7])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_cross_entropy_op_matches_the_unchunked_ops(chunks, masked):
  ctx = LowerCtx()
  h, w = normal((2, 5, 16), 0), normal((16, 300), 1, 0.5)
  y = jnp.asarray(np.random.default_rng(2).integers(0, 300, (2, 5)), jnp.int32)
  extra = (y > 100,) if masked else ()

  def plain(h, w):
    return OPS["cross-entropy"].lower(ctx, OPS["matmul"].lower(ctx, h, w), y, *extra)

  def chunked(h, w):
    return lowering("chunked-cross-entropy", "cpu")(ctx, h, w, y, *extra, chunks=chunks)

  v0, g0 = jax.value_and_grad(plain, argnums=(0, 1))(h, w)
  for wrap in (lambda f: f, jax.jit):
    v1, g1 = wrap(jax.value_and_grad(chunked, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(np.asarray(v1), np.asarray(v0), **TOL)
    for a, b in zip(g1, g0):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_sdpa_on_cpu_is_xla_and_says_so():
  ctx = LowerCtx(platform="cpu")
  q, k, v = normal((1, 2, 8, 16), 0), normal((1, 2, 8, 16), 1), normal((1, 2, 8, 16), 2)
  out = lowering("sdpa", "cpu")(ctx, q, k, v, causal=True, scale=0.25)
  ref = flash_attention.reference(q, k, v, causal=True, scale=0.25)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
  assert [(n["kind"], n["impl"], n["causal"]) for n in ctx.notes] == [("attention", "xla", True)]

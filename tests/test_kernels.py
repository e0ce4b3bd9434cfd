"""Pallas kernels (interpreted on the CPU, lowered for CUDA) and the ops that rewrites introduce."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sexpgpu.ir.ops import OPS, LowerCtx
from sexpgpu.lower.kernels import flash_attention
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
                                                      interpret=True)[0]
  for wrap in (lambda f: f, jax.jit):
    np.testing.assert_allclose(np.asarray(wrap(fwd)(q, k, v)), np.asarray(ref), **TOL)


def _segments(b, t, seed):
  """Packed documents: ids that rise at random row positions (several per row)."""
  starts = np.random.default_rng(seed).random((b, t)) < 0.08
  starts[:, 0] = False
  return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


# The kernels' numerics against the reference: forward and every gradient, causal and
# not, with and without segment ids, f32 (within 2e-6) and bf16 (within 2e-2).
@pytest.mark.slow  # interpreted Pallas forward and backward at every shape and dtype: ~20 s
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_forward_and_gradients_match_reference(monkeypatch, dtype, tol, causal, packed):
  monkeypatch.setattr(flash_attention, "BLOCK_Q", 32)
  monkeypatch.setattr(flash_attention, "BLOCK_K", 32)
  q, k, v, g = (normal((2, 2, 96, 16), s).astype(dtype) for s in (3, 4, 5, 6))
  seg = _segments(2, 96, 7) if packed else None
  assert not packed or int(jnp.max(seg)) >= 2  # several documents in a row
  flash = lambda q, k, v: flash_attention.flash_attention(q, k, v, seg, causal=causal,
                                                          scale=0.25, interpret=True)
  ref = lambda q, k, v: flash_attention.reference(q, k, v, seg, causal=causal, scale=0.25)
  o0, vjp0 = jax.vjp(ref, q, k, v)
  o1, vjp1 = jax.vjp(flash, q, k, v)
  for a, b in zip((o1,) + vjp1(g), (o0,) + vjp0(g)):
    assert a.dtype == b.dtype == dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=0, atol=tol)


def test_flash_pads_head_dims_that_are_no_power_of_two():
  q, k, v, g = normal((1, 2, 32, 48), 1), normal((1, 2, 32, 48), 2), normal((1, 2, 32, 24), 3), \
      normal((1, 2, 32, 24), 4)
  flash = lambda q, k, v: flash_attention.flash_attention(q, k, v, causal=True, scale=0.2,
                                                          interpret=True)
  ref = lambda q, k, v: flash_attention.reference(q, k, v, causal=True, scale=0.2)
  o1, vjp1 = jax.vjp(flash, q, k, v)
  o0, vjp0 = jax.vjp(ref, q, k, v)
  assert o1.shape == (1, 2, 32, 24)
  for a, b in zip((o1,) + vjp1(g), (o0,) + vjp0(g)):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6)


def test_flash_gradients_under_jit_equal_eager():
  q, k, v = normal((1, 2, 64, 16), 3), normal((1, 2, 64, 16), 4), normal((1, 2, 64, 16), 5)
  w = normal((1, 2, 64, 16), 6)
  loss = lambda q, k, v: jnp.sum(flash_attention.flash_attention(
      q, k, v, causal=True, scale=0.25, interpret=True) * w)
  eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(jitted, eager):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_flash_refuses_shapes_it_does_not_take():
  ok = (1, 2, 64, 16)
  assert flash_attention.refusal(ok, ok, ok, True) is None
  # head dims are padded to a power of two around the kernels, the kernels refuse others
  assert flash_attention.refusal((1, 2, 64, 48), (1, 2, 64, 48), (1, 2, 64, 12), True) is None
  assert "power of two" in flash_attention._refusal((1, 2, 64, 48), (1, 2, 64, 48),
                                                    (1, 2, 64, 48), True, jnp.float32, False)
  assert "multiples" in flash_attention.refusal((1, 2, 100, 16), (1, 2, 100, 16),
                                                (1, 2, 100, 16), False)
  assert "more queries" in flash_attention.refusal((1, 2, 128, 16), ok, ok, True)
  assert "segment ids" in flash_attention.refusal((1, 2, 128, 16), ok, ok, False,
                                                  segments=True)
  assert "shared memory" in flash_attention.refusal((1, 2, 1024, 512), (1, 2, 1024, 512),
                                                    (1, 2, 1024, 512), True)


def test_flash_tiles_fit_shared_memory_at_gpt2_and_llama_head_dims():
  for d in (64, 128):
    for dtype in (jnp.float32, jnp.bfloat16):
      need = flash_attention.shared_bytes(d, d, jnp.dtype(dtype).itemsize, 1024, 1024)
      assert need <= flash_attention.SHARED_BYTES, (d, dtype, need)


# --- lowered for CUDA on this machine: the Triton calls, no Mosaic GPU, no fallback --------
def _custom_calls(text):
  from sexpgpu.lower.cuda_target import custom_calls
  return custom_calls(text)


@pytest.fixture(scope="module")
def flash_lowered_for_cuda():
  """StableHLO for CUDA of the kernel's forward and of value_and_grad, by shape and masks."""
  out = {}
  for b, h, t, d in ((2, 4, 64, 32), (2, 4, 128, 64), (1, 2, 256, 64), (8, 12, 1024, 64)):
    for dtype in (jnp.float32, jnp.bfloat16):
      for packed in (False, True):
        x = jax.ShapeDtypeStruct((b, h, t, d), dtype)
        seg = jax.ShapeDtypeStruct((b, t), jnp.int32) if packed else None
        fwd = lambda q, k, v, s: flash_attention.flash_attention(q, k, v, s, causal=True,
                                                                 scale=0.125)
        loss = lambda q, k, v, s: jnp.sum(fwd(q, k, v, s).astype(jnp.float32))
        both = jax.value_and_grad(loss, argnums=(0, 1, 2))
        out[(t, d, jnp.dtype(dtype).name, packed)] = tuple(
            jax.jit(f).trace(x, x, x, seg).lower(lowering_platforms=("cuda",)).as_text()
            for f in (fwd, both))
  return out


@pytest.mark.slow  # lowers the kernels for CUDA through Triton
def test_flash_lowers_for_cuda_to_triton_forward_and_backward(flash_lowered_for_cuda):
  assert len(flash_lowered_for_cuda) == 16
  for key, (fwd, both) in flash_lowered_for_cuda.items():
    assert _custom_calls(fwd) == {"__gpu$xla.gpu.triton": 1}, key
    # the forward, the dK/dV kernel and the dQ kernel; nothing else is a custom call
    assert _custom_calls(both) == {"__gpu$xla.gpu.triton": 3}, key
    assert "mosaic" not in both.lower(), key
    for name in ("sexpgpu_flash_forward", "sexpgpu_flash_backward_dkv",
                 "sexpgpu_flash_backward_dq"):
      assert name in both, (key, name)


def test_flash_backward_never_forms_the_score_matrix(flash_lowered_for_cuda):
  """No [seq, seq] array outside the kernels at gpt2's shape: the backward is Pallas's."""
  fwd, both = flash_lowered_for_cuda[(1024, 64, "bfloat16", True)]
  assert "1024x1024" not in both and "1024x1024" not in fwd


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

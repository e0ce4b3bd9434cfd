"""The lowering of chunked-cross-entropy: a custom gradient that never holds the full logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sexpgpu.lower.registry import register_lowering


def chunked_cross_entropy(ctx, h, w, targets, mask=None, *, chunks):
  """Mean NLL of (matmul H W) over vocabulary chunks, forward and gradient chunk by chunk."""
  weights = (jnp.ones(targets.shape, jnp.float32) if mask is None
             else mask.astype(jnp.float32))
  ct = jnp.dtype(ctx.compute_dtype(jax.ShapeDtypeStruct((), jnp.result_type(h, w))))
  return _chunked_xent(h, w, targets, weights, int(chunks), ct)


def _vocab_chunks(w, chunks: int):
  """W [d, V] as [chunks, d, C], zero-padded to chunks * C columns."""
  d, vocab = w.shape
  size = -(-vocab // chunks)
  w = jnp.pad(w, ((0, 0), (0, size * chunks - vocab)))
  return jnp.transpose(w.reshape(d, chunks, size), (1, 0, 2)), size


def _chunk_logits(h2, wc, j, size, vocab, ct, out_dtype):
  """One chunk's f32 logits (as matmul then cross-entropy compute them), padding at -inf."""
  z = jnp.matmul(h2.astype(ct), wc.astype(ct), preferred_element_type=jnp.float32)
  z = z.astype(out_dtype).astype(jnp.float32)
  col = j * size + jnp.arange(size)
  return jnp.where(col[None, :] < vocab, z, -jnp.inf), col


def _xent_fwd(h, w, targets, weights, chunks, ct):
  d, vocab = w.shape
  h2 = h.reshape(-1, d)
  y = targets.reshape(-1).astype(jnp.int32)
  wcs, size = _vocab_chunks(w, chunks)
  out_dtype = jnp.result_type(h, w)

  def step(carry, xs):
    m, s, picked = carry
    wc, j = xs
    z, col = _chunk_logits(h2, wc, j, size, vocab, ct, out_dtype)
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
    picked = picked + jnp.sum(jnp.where(col[None, :] == y[:, None], z, 0.0), axis=-1)
    return (m_new, s, picked), None

  n = h2.shape[0]
  init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
          jnp.zeros((n,), jnp.float32))
  (m, s, picked), _ = jax.lax.scan(step, init, (wcs, jnp.arange(chunks)))
  lse = m + jnp.log(s)
  wts = weights.reshape(-1)
  # as cross-entropy's reference: no true position in :mask is NaN, not a perfect 0.0
  loss = jnp.sum((lse - picked) * wts) / jnp.sum(wts)
  return loss, (h, w, targets, weights, lse)  # residuals: per-row lse, never the logits


def _xent_bwd(chunks, ct, res, g):
  h, w, targets, weights, lse = res
  d, vocab = w.shape
  h2 = h.reshape(-1, d)
  y = targets.reshape(-1).astype(jnp.int32)
  wcs, size = _vocab_chunks(w, chunks)
  out_dtype = jnp.result_type(h, w)
  wts = weights.reshape(-1)
  dnll = g * wts / jnp.maximum(jnp.sum(wts), 1.0)

  def step(dh, xs):
    wc, j = xs
    z, col = _chunk_logits(h2, wc, j, size, vocab, ct, out_dtype)
    dz = (jnp.exp(z - lse[:, None]) - (col[None, :] == y[:, None])) * dnll[:, None]
    dz = dz.astype(ct)
    dh = dh + jnp.matmul(dz, wc.astype(ct).T, preferred_element_type=jnp.float32)
    return dh, jnp.matmul(h2.astype(ct).T, dz, preferred_element_type=jnp.float32)

  dh, dws = jax.lax.scan(step, jnp.zeros(h2.shape, jnp.float32), (wcs, jnp.arange(chunks)))
  dw = jnp.transpose(dws, (1, 0, 2)).reshape(d, chunks * size)[:, :vocab]
  return dh.reshape(h.shape).astype(h.dtype), dw.astype(w.dtype), None, None


def _xent(h, w, targets, weights, chunks, ct):
  return _xent_fwd(h, w, targets, weights, chunks, ct)[0]


_chunked_xent = jax.custom_vjp(_xent, nondiff_argnums=(4, 5))
_chunked_xent.defvjp(_xent_fwd, _xent_bwd)


register_lowering("chunked-cross-entropy", chunked_cross_entropy)

"""Chunked cross-entropy forward in Pallas: logits = h W per vocabulary chunk, never all at once.

Rows are blocked by the grid; inside a block the kernel walks the vocabulary in
chunks, keeping a running max and sum (an online logsumexp) and the target's
logit, so it holds [rows, chunk] logits at a time, never [rows, vocab].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def _kernel(h_ref, w_ref, y_ref, lse_ref, picked_ref, *, block_v: int, vocab: int):
  h = h_ref[...]
  y = y_ref[...]
  rows = h.shape[0]

  def body(j, carry):
    m, s, picked = carry
    w = w_ref[:, pl.ds(j * block_v, block_v)]
    z = jnp.dot(h, w, preferred_element_type=jnp.float32)
    cols = j * block_v + lax.broadcasted_iota(jnp.int32, (rows, block_v), 1)
    z = jnp.where(cols < vocab, z, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(z, axis=1))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
    picked = picked + jnp.sum(jnp.where(cols == y[:, None], z, 0.0), axis=1)
    return m_new, s, picked

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  m, s, picked = lax.fori_loop(0, w_ref.shape[1] // block_v, body, init)
  lse_ref[...] = m + jnp.log(s)
  picked_ref[...] = picked


def row_stats(h, w, targets, *, block_n: int = 16, block_v: int = 128, interpret: bool = False):
  """Per row: (logsumexp of h W, the target's logit), both f32.

  Args:
    h: [rows, d]; w: [d, vocab]; targets: [rows] integers.
    block_n: rows per grid step; block_v: vocabulary columns per chunk.
    interpret: run in Pallas's interpreter (what the CPU needs).

  Returns:
    (lse [rows], picked [rows]).
  """
  n, d = h.shape
  vocab = w.shape[1]
  n_pad = -(-n // block_n) * block_n
  v_pad = -(-vocab // block_v) * block_v
  h = jnp.pad(h, ((0, n_pad - n), (0, 0)))
  w = jnp.pad(w, ((0, 0), (0, v_pad - vocab)))
  y = jnp.pad(targets.astype(jnp.int32), (0, n_pad - n))
  kernel = functools.partial(_kernel, block_v=block_v, vocab=vocab)
  lse, picked = pl.pallas_call(
      kernel,
      grid=(n_pad // block_n,),
      in_specs=[pl.BlockSpec((block_n, d), lambda i: (i, 0)),
                pl.BlockSpec((d, v_pad), lambda i: (0, 0)),
                pl.BlockSpec((block_n,), lambda i: (i,))],
      out_specs=[pl.BlockSpec((block_n,), lambda i: (i,)),
                 pl.BlockSpec((block_n,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((n_pad,), jnp.float32),
                 jax.ShapeDtypeStruct((n_pad,), jnp.float32)],
      interpret=interpret,
      name="sexpgpu_chunked_xent",
  )(h, w, y)
  return lse[:n], picked[:n]


def chunked_cross_entropy(h, w, targets, mask=None, *, block_n: int = 16, block_v: int = 128,
                          interpret: bool = False):
  """Mean negative log-likelihood of `targets` under logits h W (over `mask` when given).

  Args:
    h: [..., d]; w: [d, vocab]; targets: [...] integers; mask: [...] or None.

  Returns:
    the f32 scalar loss, as the IR's `cross-entropy` of `matmul h w`.
  """
  d = h.shape[-1]
  lse, picked = row_stats(h.reshape(-1, d), w, targets.reshape(-1), block_n=block_n,
                          block_v=block_v, interpret=interpret)
  nll = lse - picked
  if mask is None:
    return jnp.mean(nll)
  m = mask.reshape(-1).astype(jnp.float32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def reference(h, w, targets, mask=None):
  """The loss with the full logits, in plain jnp."""
  logits = jnp.matmul(h, w, preferred_element_type=jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  nll = lse - picked
  if mask is None:
    return jnp.mean(nll)
  m = mask.astype(jnp.float32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)

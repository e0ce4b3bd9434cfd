"""Flash attention forward in Pallas: queries blocked by the grid, keys by an online softmax.

Layout [batch, heads, seq, dim], as the IR's `sdpa`. `flash_attention` wraps
the kernel in a `custom_vjp` whose backward is XLA's (recomputing the
probabilities from q and k), so it can sit in a train step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_Q = 64
BLOCK_K = 64


def _blocks(tq: int, tk: int) -> tuple[int, int]:
  return min(BLOCK_Q, tq), min(BLOCK_K, tk)


def refusal(q_shape, k_shape, v_shape, causal: bool) -> str | None:
  """Why the kernel does not take these shapes (None: it does)."""
  if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
    return "it takes [batch, heads, seq, dim]"
  (b, h, tq, d), (_, _, tk, _), dv = q_shape, k_shape, v_shape[-1]
  bq, bk = _blocks(tq, tk)
  if tq % bq or tk % bk:
    return f"sequence lengths {tq}, {tk} are not multiples of its blocks {bq}, {bk}"
  for n, what in ((d, "head dim"), (dv, "value dim"), (bq, "query block"), (bk, "key block")):
    if n < 16 or n & (n - 1):
      return f"{what} {n} is not a power of two ≥ 16"
  return None


def _kernel(q_ref, k_ref, v_ref, o_ref, *, scale: float, causal: bool, block_q: int,
            block_k: int, offset: int):
  i = pl.program_id(2)
  q = q_ref[...]
  tk = k_ref.shape[0]
  m0 = jnp.full((block_q,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((block_q,), jnp.float32)
  acc0 = jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32)

  def body(j, carry):
    m, l, acc = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32) * scale
    if causal:
      rows = i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
      cols = j * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
      s = jnp.where(rows + offset >= cols, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = corr * l + jnp.sum(p, axis=1)
    acc = corr[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc

  if causal:  # key blocks wholly in the future of this query block are skipped
    last = jnp.minimum((i + 1) * block_q + offset, tk)
    n = lax.div(last + block_k - 1, block_k)
  else:
    n = tk // block_k
  _, l, acc = lax.fori_loop(0, n, body, (m0, l0, acc0))
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def flash_forward(q, k, v, *, causal: bool, scale: float, interpret: bool = False):
  """softmax(q kᵀ · scale, causal as `causal-mask`) v, one pallas_call.

  Args:
    q, k, v: [batch, heads, seq, dim] (k and v share their seq; v's dim may differ).
    causal: mask keys after each query (aligned at the end, as the IR's causal-mask).
    scale: multiplies the scores.
    interpret: run the kernel in Pallas's interpreter (what the CPU needs).

  Returns:
    [batch, heads, seq_q, dim_v] in q's dtype.

  Raises:
    ValueError: shapes the kernel does not take (see `refusal`).
  """
  why = refusal(q.shape, k.shape, v.shape, causal)
  if why is not None and not interpret:
    raise ValueError(f"flash attention: {why}")
  b, h, tq, d = q.shape
  tk, dv = k.shape[2], v.shape[3]
  bq, bk = _blocks(tq, tk)
  if tq % bq or tk % bk:
    raise ValueError(f"flash attention: sequence lengths {tq}, {tk} are not multiples of "
                     f"its blocks {bq}, {bk}")
  kernel = functools.partial(_kernel, scale=float(scale), causal=causal, block_q=bq,
                             block_k=bk, offset=tk - tq)
  return pl.pallas_call(
      kernel,
      grid=(b, h, tq // bq),
      in_specs=[pl.BlockSpec((None, None, bq, d), lambda bi, hi, qi: (bi, hi, qi, 0)),
                pl.BlockSpec((None, None, tk, d), lambda bi, hi, qi: (bi, hi, 0, 0)),
                pl.BlockSpec((None, None, tk, dv), lambda bi, hi, qi: (bi, hi, 0, 0))],
      out_specs=pl.BlockSpec((None, None, bq, dv), lambda bi, hi, qi: (bi, hi, qi, 0)),
      out_shape=jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype),
      interpret=interpret,
      name="sexpgpu_flash_attention",
  )(q, k, v)


def reference(q, k, v, *, causal: bool, scale: float):
  """The same attention in plain jnp (f32 scores), the kernel's specification."""
  s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
  if causal:
    tq, tk = s.shape[-2], s.shape[-1]
    s = jnp.where(jnp.tril(jnp.ones((tq, tk), bool), tk - tq), s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("...qk,...kd->...qd", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(q, k, v, causal, scale, interpret):
  return flash_forward(q, k, v, causal=causal, scale=scale, interpret=interpret)


def _flash_fwd(q, k, v, causal, scale, interpret):
  return _flash(q, k, v, causal, scale, interpret), (q, k, v)


def _flash_bwd(causal, scale, interpret, res, g):
  q, k, v = res
  _, vjp = jax.vjp(functools.partial(reference, causal=causal, scale=scale), q, k, v)
  return vjp(g)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, *, causal: bool, scale: float, interpret: bool = False):
  """Differentiable flash attention: the Pallas forward, XLA's backward (see `flash_forward`)."""
  return _flash(q, k, v, causal, float(scale), interpret)

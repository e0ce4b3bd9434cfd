"""Flash attention in Pallas on Triton, forward and backward (FlashAttention-2), with segment ids.

Layout [batch, heads, seq, dim], as the IR's `sdpa`. The forward blocks the
queries by the grid and walks the keys with an online softmax, writing the
output and each row's logsumexp. The backward never holds the score matrix
either: one kernel walks the queries for each key block (dK, dV), another the
keys for each query block (dQ), both recomputing the probabilities block by
block from the saved logsumexp. Packed documents pass segment ids ([batch,
seq] integers): a query sees only keys of its own segment.

Every `pallas_call` names Triton (`CompilerParams`): without it jax 0.10.2
sends a GPU kernel to Mosaic GPU, which cannot lower this one. On the CPU the
kernels run with `interpret=True` (what the tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK_Q = 64
BLOCK_K = 64
NUM_WARPS = 4
NUM_STAGES = 2
# A masked score: finite, so a row whose first key blocks are all masked keeps finite
# running maxima (exp(-inf - -inf) would be NaN), and exp(MASKED - real max) is 0.
MASKED = -0.7 * float(np.finfo(np.float32).max)
# Shared memory of the smallest card the runs target (an A100's 164 KiB per block, with
# the compiler's own share kept aside); a configuration above it is refused.
SHARED_BYTES = 160 * 1024
BACKEND = "triton"


def _tiles_bytes(bq: int, bk: int, d: int, dv: int, itemsize: int) -> int:
  """Triton's shared memory for the largest of the three kernels, estimated: each dot's
  operand tiles, buffered NUM_STAGES deep (the backward's kernels hold the most)."""
  fwd = (bq * d + bk * d + bk * dv) * itemsize
  bwd = (bk * d + bk * dv + bq * d + bq * dv) * itemsize + bq * bk * 4
  return max(fwd, bwd) * NUM_STAGES


def _blocks(tq: int, tk: int, d: int = 16, dv: int = 16, itemsize: int = 4) -> tuple[int, int]:
  """The query and key blocks: BLOCK_Q and BLOCK_K, halved (down to 16) until the tiles
  fit SHARED_BYTES, and never longer than the sequences."""
  bq, bk = min(BLOCK_Q, tq), min(BLOCK_K, tk)
  while _tiles_bytes(bq, bk, d, dv, itemsize) > SHARED_BYTES and max(bq, bk) > 16:
    bq, bk = max(bq // 2, min(16, bq)), max(bk // 2, min(16, bk))
  return bq, bk


def shared_bytes(d: int, dv: int, itemsize: int, tq: int, tk: int) -> int:
  """The estimated shared memory of the kernels at their blocks for these shapes."""
  return _tiles_bytes(*_blocks(tq, tk, d, dv, itemsize), d, dv, itemsize)


def padded(n: int) -> int:
  """A head dim as the kernels take it: the next power of two, at least 16."""
  return max(16, 1 << max(n - 1, 0).bit_length())


def refusal(q_shape, k_shape, v_shape, causal: bool, dtype=jnp.float32,
            segments: bool = False) -> str | None:
  """Why `flash_attention` does not take these shapes (None: it does); it pads head dims
  to a power of two (`padded`) for the kernels."""
  if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
    return "it takes [batch, heads, seq, dim]"
  return _refusal(q_shape[:3] + (padded(q_shape[3]),), k_shape[:3] + (padded(k_shape[3]),),
                  v_shape[:3] + (padded(v_shape[3]),), causal, dtype, segments)


def _refusal(q_shape, k_shape, v_shape, causal, dtype, segments) -> str | None:
  """Why the kernels themselves do not take these shapes (None: they do)."""
  (b, h, tq, d), (_, hk, tk, _), dv = q_shape, k_shape, v_shape[-1]
  if hk != h:
    return f"{h} query heads against {hk} key heads"
  if causal and tq > tk:
    return f"causal attention with more queries ({tq}) than keys ({tk})"
  if segments and tq != tk:
    return f"segment ids with {tq} queries and {tk} keys"
  bq, bk = _blocks(tq, tk, d, dv, jnp.dtype(dtype).itemsize)
  if tq % bq or tk % bk:
    return f"sequence lengths {tq}, {tk} are not multiples of its blocks {bq}, {bk}"
  for n, what in ((d, "head dim"), (dv, "value dim"), (bq, "query block"), (bk, "key block")):
    if n < 16 or n & (n - 1):
      return f"{what} {n} is not a power of two ≥ 16"
  need = shared_bytes(d, dv, jnp.dtype(dtype).itemsize, tq, tk)
  if need > SHARED_BYTES:
    return f"its tiles need {need} bytes of shared memory, above {SHARED_BYTES}"
  return None


def _params(interpret: bool):
  return None if interpret else pltriton.CompilerParams(num_warps=NUM_WARPS,
                                                        num_stages=NUM_STAGES)


def _mask(s, rows, cols, causal: bool, offset: int, seg_q, seg_k):
  """The scores with masked pairs at MASKED: the future (causal) and other segments."""
  keep = None
  if causal:
    keep = rows[:, None] + offset >= cols[None, :]
  if seg_q is not None:
    same = seg_q[:, None] == seg_k[None, :]
    keep = same if keep is None else keep & same
  return s if keep is None else jnp.where(keep, s, MASKED)


def _fwd_kernel(q_ref, k_ref, v_ref, *rest, scale, causal, block_q, block_k, offset,
                segments):
  seg_ref, (o_ref, lse_ref) = (rest[0], rest[1:]) if segments else (None, rest)
  i = pl.program_id(2)
  tk = k_ref.shape[0]
  q = q_ref[...]
  rows = i * block_q + jnp.arange(block_q)
  seg_q = seg_ref[pl.ds(i * block_q, block_q)] if segments else None

  def body(j, carry):
    m, l, acc = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale
    seg_k = seg_ref[pl.ds(j * block_k, block_k)] if segments else None
    s = _mask(s, rows, j * block_k + jnp.arange(block_k), causal, offset, seg_q, seg_k)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = corr * l + jnp.sum(p, axis=1)
    acc = corr[:, None] * acc + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
    return m_new, l, acc

  if causal:  # key blocks wholly in the future of this query block are skipped
    n = lax.div(jnp.minimum((i + 1) * block_q + offset, tk) + block_k - 1, block_k)
  else:
    n = tk // block_k
  m0 = jnp.full((block_q,), MASKED, jnp.float32)
  l0 = jnp.zeros((block_q,), jnp.float32)
  acc0 = jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32)
  m, l, acc = lax.fori_loop(0, n, body, (m0, l0, acc0))
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, scale, causal,
                block_q, block_k, offset, segments):
  seg_ref, (dk_ref, dv_ref) = (rest[0], rest[1:]) if segments else (None, rest)
  j = pl.program_id(2)
  tq = q_ref.shape[0]
  k = k_ref[...]
  v = v_ref[...]
  cols = j * block_k + jnp.arange(block_k)
  seg_k = seg_ref[pl.ds(j * block_k, block_k)] if segments else None

  def body(i, carry):
    dk, dv = carry
    q = q_ref[pl.ds(i * block_q, block_q), :]
    do = do_ref[pl.ds(i * block_q, block_q), :]
    lse = lse_ref[pl.ds(i * block_q, block_q)]
    delta = delta_ref[pl.ds(i * block_q, block_q)]
    s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale
    seg_q = seg_ref[pl.ds(i * block_q, block_q)] if segments else None
    s = _mask(s, i * block_q + jnp.arange(block_q), cols, causal, offset, seg_q, seg_k)
    p = jnp.exp(s - lse[:, None])
    dv = dv + pltriton.dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
    dp = pltriton.dot(do, v, trans_b=True).astype(jnp.float32)
    ds = p * (dp - delta[:, None]) * scale
    dk = dk + pltriton.dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32)
    return dk, dv

  # query blocks wholly before this key block (under the causal mask) see none of it
  lo = lax.div(jnp.maximum(j * block_k - offset, 0), block_q) if causal else 0
  dk0 = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
  dv0 = jnp.zeros((block_k, v_ref.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(lo, tq // block_q, body, (dk0, dv0))
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, scale, causal,
               block_q, block_k, offset, segments):
  seg_ref, (dq_ref,) = (rest[0], rest[1:]) if segments else (None, rest)
  i = pl.program_id(2)
  tk = k_ref.shape[0]
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  rows = i * block_q + jnp.arange(block_q)
  seg_q = seg_ref[pl.ds(i * block_q, block_q)] if segments else None

  def body(j, dq):
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale
    seg_k = seg_ref[pl.ds(j * block_k, block_k)] if segments else None
    s = _mask(s, rows, j * block_k + jnp.arange(block_k), causal, offset, seg_q, seg_k)
    p = jnp.exp(s - lse[:, None])
    dp = pltriton.dot(do, v, trans_b=True).astype(jnp.float32)
    ds = p * (dp - delta[:, None]) * scale
    return dq + pltriton.dot(ds.astype(k.dtype), k).astype(jnp.float32)

  if causal:
    n = lax.div(jnp.minimum((i + 1) * block_q + offset, tk) + block_k - 1, block_k)
  else:
    n = tk // block_k
  dq = lax.fori_loop(0, n, body, jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _spec_whole(seq: int, dim: int | None = None):
  """A (batch, head)'s whole sequence, whatever the grid's third index."""
  if dim is None:
    return pl.BlockSpec((None, None, seq), lambda b, h, _: (b, h, 0))
  return pl.BlockSpec((None, None, seq, dim), lambda b, h, _: (b, h, 0, 0))


def _spec_block(block: int, dim: int | None = None):
  """The grid's third index's block of the sequence."""
  if dim is None:
    return pl.BlockSpec((None, None, block), lambda b, h, x: (b, h, x))
  return pl.BlockSpec((None, None, block, dim), lambda b, h, x: (b, h, x, 0))


def _seg_spec(seq: int):
  return pl.BlockSpec((None, seq), lambda b, h, _: (b, 0))


def _check(q, k, v, causal, segments, interpret):
  why = _refusal(q.shape, k.shape, v.shape, causal, q.dtype, segments is not None)
  if why is not None and not interpret:
    raise ValueError(f"flash attention: {why}")
  b, h, tq, d = q.shape
  bq, bk = _blocks(tq, k.shape[2], d, v.shape[3], jnp.dtype(q.dtype).itemsize)
  if tq % bq or k.shape[2] % bk:
    raise ValueError(f"flash attention: sequence lengths {tq}, {k.shape[2]} are not "
                     f"multiples of its blocks {bq}, {bk}")
  return bq, bk


def flash_forward(q, k, v, segments=None, *, causal: bool, scale: float,
                  interpret: bool = False):
  """(softmax(q kᵀ · scale, masked) v, each row's logsumexp): one pallas_call.

  Args:
    q, k, v: [batch, heads, seq, dim] (k and v share their seq; v's dim may differ).
    segments: [batch, seq] integer segment ids, or None.
    causal: mask keys after each query (aligned at the end, as the IR's causal-mask).
    scale: multiplies the scores.
    interpret: run the kernel in Pallas's interpreter (what the CPU needs).

  Returns:
    ([batch, heads, seq_q, dim_v] in q's dtype, [batch, heads, seq_q] f32).

  Raises:
    ValueError: shapes the kernel does not take (see `refusal`).
  """
  bq, bk = _check(q, k, v, causal, segments, interpret)
  b, h, tq, d = q.shape
  tk, dv = k.shape[2], v.shape[3]
  seg = segments is not None
  kernel = functools.partial(_fwd_kernel, scale=float(scale), causal=causal, block_q=bq,
                             block_k=bk, offset=tk - tq, segments=seg)
  in_specs = [_spec_block(bq, d), _spec_whole(tk, d), _spec_whole(tk, dv)]
  args = [q, k, v]
  if seg:
    in_specs.append(_seg_spec(tk))
    args.append(segments.astype(jnp.int32))
  return pl.pallas_call(
      kernel, grid=(b, h, tq // bq), in_specs=in_specs,
      out_specs=[_spec_block(bq, dv), _spec_block(bq)],
      out_shape=[jax.ShapeDtypeStruct((b, h, tq, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, tq), jnp.float32)],
      compiler_params=_params(interpret), interpret=interpret,
      name="sexpgpu_flash_forward",
  )(*args)


def flash_backward(q, k, v, segments, o, lse, do, *, causal: bool, scale: float,
                   interpret: bool = False):
  """(dq, dk, dv) of `flash_forward`'s output for its cotangent `do`: two pallas_calls.

  Args:
    q, k, v, segments: as `flash_forward` took them.
    o, lse: `flash_forward`'s output and logsumexp.
    do: the output's cotangent.

  Returns:
    (dq, dk, dv), each in its input's dtype.
  """
  bq, bk = _check(q, k, v, causal, segments, interpret)
  b, h, tq, d = q.shape
  tk, dv = k.shape[2], v.shape[3]
  seg = segments is not None
  do = do.astype(q.dtype)
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  common = dict(scale=float(scale), causal=causal, block_q=bq, block_k=bk, offset=tk - tq,
                segments=seg)
  args = [q, k, v, do, lse, delta] + ([segments.astype(jnp.int32)] if seg else [])
  seg_specs = [_seg_spec(tk)] if seg else []
  dk, dv_ = pl.pallas_call(
      functools.partial(_dkv_kernel, **common), grid=(b, h, tk // bk),
      in_specs=[_spec_whole(tq, d), _spec_block(bk, d), _spec_block(bk, dv),
                _spec_whole(tq, dv), _spec_whole(tq), _spec_whole(tq)] + seg_specs,
      out_specs=[_spec_block(bk, d), _spec_block(bk, dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(interpret), interpret=interpret,
      name="sexpgpu_flash_backward_dkv",
  )(*args)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **common), grid=(b, h, tq // bq),
      in_specs=[_spec_block(bq, d), _spec_whole(tk, d), _spec_whole(tk, dv),
                _spec_block(bq, dv), _spec_block(bq), _spec_block(bq)] + seg_specs,
      out_specs=_spec_block(bq, d),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(interpret), interpret=interpret,
      name="sexpgpu_flash_backward_dq",
  )(*args)
  return dq, dk, dv_


def reference(q, k, v, segments=None, *, causal: bool, scale: float):
  """The same attention in plain jnp (f32 scores), the kernels' specification."""
  s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
  tq, tk = s.shape[-2], s.shape[-1]
  keep = jnp.ones((tq, tk), bool)
  if causal:
    keep = jnp.tril(keep, tk - tq)
  if segments is not None:
    keep = keep & (segments[:, :, None] == segments[:, None, :])[:, None]
  s = jnp.where(keep, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("...qk,...kd->...qd", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32).astype(q.dtype)


@functools.cache
def _split_kernels(causal: bool, scale: float, interpret: bool, seg: bool):
  """The forward and the backward as calls whose batch and heads stay split (`sharded`)."""
  from sexpgpu.lower.kernels.sharded import batch_split
  tail = [2] if seg else []

  def fwd(q, k, v, *s):
    return tuple(flash_forward(q, k, v, s[0] if s else None, causal=causal, scale=scale,
                               interpret=interpret))

  def bwd(q, k, v, o, lse, do, *s):
    return tuple(flash_backward(q, k, v, s[0] if s else None, o, lse, do, causal=causal,
                                scale=scale, interpret=interpret))

  return (batch_split(fwd, [4, 4, 4] + tail, [4, 3]),
          batch_split(bwd, [4, 4, 4, 4, 3, 4] + tail, [4, 4, 4]))


def _forward(q, k, v, segments, causal, scale, interpret, split):
  if split:
    seg = () if segments is None else (segments.astype(jnp.int32),)
    return _split_kernels(causal, scale, interpret, segments is not None)[0](q, k, v, *seg)
  return flash_forward(q, k, v, segments, causal=causal, scale=scale, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, segments, causal, scale, interpret, split):
  return _forward(q, k, v, segments, causal, scale, interpret, split)[0]


def _flash_fwd(q, k, v, segments, causal, scale, interpret, split):
  o, lse = _forward(q, k, v, segments, causal, scale, interpret, split)
  return o, (q, k, v, segments, o, lse)


def _flash_bwd(causal, scale, interpret, split, res, g):
  q, k, v, segments, o, lse = res
  g = g.astype(q.dtype)
  if split:
    seg = () if segments is None else (segments.astype(jnp.int32),)
    dq, dk, dv = _split_kernels(causal, scale, interpret, segments is not None)[1](
        q, k, v, o, lse, g, *seg)
  else:
    dq, dk, dv = flash_backward(q, k, v, segments, o, lse, g, causal=causal, scale=scale,
                                interpret=interpret)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, segments=None, *, causal: bool, scale: float,
                    interpret: bool = False, split: bool = False):
  """Differentiable flash attention: the Pallas forward and the Pallas backward.

  Head dims that are no power of two ≥ 16 are zero-padded to one (`padded`) around
  the kernels: padded query and key columns add nothing to the scores, padded value
  columns are cut from the output.

  Args: as `flash_forward`, and `split`: inside a sharded step, give the kernels a
    sharding rule so their batch and heads stay split over the devices (`sharded`).
  Returns: the attention's output in q's dtype.
  """
  d, dv = q.shape[-1], v.shape[-1]
  pad = lambda x, n: x if n == x.shape[-1] else jnp.pad(
      x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
  q, k, v = pad(q, padded(d)), pad(k, padded(d)), pad(v, padded(dv))
  out = _flash(q, k, v, segments, causal, float(scale), interpret, split)
  return out if out.shape[-1] == dv else out[..., :dv]

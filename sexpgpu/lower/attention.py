"""The lowering of sdpa: cuDNN's fused attention or the Pallas flash kernel on a GPU, else XLA.

Which one a shape gets is probed once by a tiny compile and cached; the choice
and the reason go to the lowering report through `ctx.notes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sexpgpu.ir.ops import OPS
from sexpgpu.lower.registry import register_lowering

_PROBES: dict[tuple, str | None] = {}


def _note(ctx, q, causal, segments=None) -> dict:
  return {"kind": "attention", "impl": "xla", "dtype": jnp.dtype(ctx.compute_dtype(q)).name,
          "causal": causal, "shape": tuple(q.shape), "why": "",
          "mask": "segments" if segments is not None else ""}


def _same_segment(segments):
  """[b, 1, t, t]: the boolean mask of query-key pairs in one segment (cuDNN's `mask`)."""
  return (segments[:, :, None] == segments[:, None, :])[:, None]


def sdpa_any(ctx, q, k, v, segments=None, *, causal, scale):
  """sdpa off the GPU: XLA's, the reference; the lowering report is told why."""
  if ctx.platform is not None:
    why = f"on {ctx.platform}" + ("; segment mask by XLA" if segments is not None else "")
    ctx.notes.append({**_note(ctx, q, causal, segments), "why": why})
  return OPS["sdpa"].lower(ctx, q, k, v, segments, causal=causal, scale=scale)


def sdpa_gpu(ctx, q, k, v, segments=None, *, causal, scale):
  """sdpa on a GPU: cuDNN, else a Pallas kernel, else XLA; the choice goes to ctx.notes.

  With segments, cuDNN takes them as a boolean mask and JAX's Pallas attention
  (`pallas.ops.gpu.attention.mha`) as segment ids; our flash kernel takes none.
  """
  ct = ctx.compute_dtype(q)
  note = _note(ctx, q, causal, segments)
  masked = segments is not None
  why = _cudnn_refusal(q.shape, k.shape, v.shape, ct, causal, scale, masked)
  if why is None:
    note["impl"] = "cudnn"
    note["why"] = "segment mask as cuDNN's mask" if masked else ""
    ctx.notes.append(note)
    t = lambda x: jnp.transpose(x.astype(ct), (0, 2, 1, 3))  # [b, h, t, d] <-> [b, t, h, d]
    out = jax.nn.dot_product_attention(t(q), t(k), t(v), scale=scale, is_causal=causal,
                                       mask=_same_segment(segments) if masked else None,
                                       implementation="cudnn")
    return t(out).astype(q.dtype)
  if masked:
    mha, pallas_why = _pallas_segments(q.shape, k.shape, v.shape, ct, causal, scale)
    note["why"] = f"cuDNN: {why}" + ("; segment ids to JAX's Pallas attention" if mha
                                     else f"; Pallas: {pallas_why}; segment mask by XLA")
    ctx.notes.append(note)
    if mha is not None:
      note["impl"] = "pallas"
      return mha(q.astype(ct), k.astype(ct), v.astype(ct), segments).astype(q.dtype)
    return OPS["sdpa"].lower(ctx, q, k, v, segments, causal=causal, scale=scale)
  flash, pallas_why = _pallas_flash(q.shape, k.shape, v.shape, ct, causal, scale)
  note["why"] = f"cuDNN: {why}" + ("" if flash else f"; Pallas: {pallas_why}")
  ctx.notes.append(note)
  if flash is not None:
    note["impl"] = "pallas"
    return flash(q.astype(ct), k.astype(ct), v.astype(ct)).astype(q.dtype)
  return OPS["sdpa"].lower(ctx, q, k, v, causal=causal, scale=scale)


def _first_line(e: Exception) -> str:
  return (f"{type(e).__name__}: " + (str(e).strip().split("\n") or [""])[0])[:200]


def _cudnn_refusal(qs, ks, vs, ct, causal, scale, masked=False) -> str | None:
  """Why cuDNN will not take this attention (None: it will), probed by a tiny compile, cached."""
  key = ("cudnn", tuple(qs), tuple(ks), tuple(vs), jnp.dtype(ct).name, causal, scale, masked)
  if key not in _PROBES:
    _PROBES[key] = _probe_cudnn(qs, ks, vs, ct, causal, scale, masked)
  return _PROBES[key]


def _probe_cudnn(qs, ks, vs, ct, causal, scale, masked=False) -> str | None:
  if jnp.dtype(ct) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"it takes bf16 or f16, not {jnp.dtype(ct).name}"
  if causal and qs[2] != ks[2]:
    return "causal attention with different query and key lengths"
  t = lambda s: jax.ShapeDtypeStruct((s[0], s[2], s[1], s[3]), ct)
  mask = jax.ShapeDtypeStruct((qs[0], 1, qs[2], ks[2]), jnp.bool_) if masked else None

  def loss(q, k, v, mask):
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, mask=mask,
                                       implementation="cudnn")
    return jnp.sum(out.astype(jnp.float32))

  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(t(qs), t(ks), t(vs), mask).compile()
  except Exception as e:  # RuntimeError (no cuDNN), ValueError/NotImplementedError, XLA errors
    return _first_line(e)
  return None


def _pallas_flash(qs, ks, vs, ct, causal, scale):
  """(the Pallas flash attention for this configuration, None) or (None, why not)."""
  key = ("pallas", tuple(qs), tuple(ks), tuple(vs), jnp.dtype(ct).name, causal, scale)
  try:
    from sexpgpu.lower.kernels import flash_attention as fa
  except ImportError as e:
    return None, _first_line(e)
  why = fa.refusal(qs, ks, vs, causal)
  if why is None:
    if key not in _PROBES:
      try:
        sds = [jax.ShapeDtypeStruct(s, ct) for s in (qs, ks, vs)]
        jax.jit(lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, scale=scale)
                ).lower(*sds).compile()
        _PROBES[key] = None
      except Exception as e:  # a Triton refusal shows only when it compiles
        _PROBES[key] = _first_line(e)
    why = _PROBES[key]
  if why is not None:
    return None, why
  return (lambda q, k, v: fa.flash_attention(q, k, v, causal=causal, scale=scale)), None


def _pallas_segments(qs, ks, vs, ct, causal, scale):
  """(JAX's Pallas attention with segment ids for this configuration, None) or (None, why not)."""
  key = ("pallas-segments", tuple(qs), tuple(ks), tuple(vs), jnp.dtype(ct).name, causal, scale)
  try:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  except ImportError as e:
    return None, _first_line(e)
  t = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # [b, h, t, d] <-> [b, t, h, d]

  def mha(q, k, v, segments):
    return t(pallas_attention.mha(t(q), t(k), t(v), segments.astype(jnp.int32),
                                  sm_scale=scale, causal=causal))

  if key not in _PROBES:
    try:
      sds = [jax.ShapeDtypeStruct(s, ct) for s in (qs, ks, vs)]
      seg = jax.ShapeDtypeStruct((qs[0], qs[2]), jnp.int32)
      loss = lambda q, k, v, s: jnp.sum(mha(q, k, v, s).astype(jnp.float32))
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*sds, seg).compile()
      _PROBES[key] = None
    except Exception as e:  # a Triton or shape refusal shows only when it compiles
      _PROBES[key] = _first_line(e)
  if _PROBES[key] is not None:
    return None, _PROBES[key]
  return mha, None


register_lowering("sdpa", sdpa_any)
register_lowering("sdpa", sdpa_gpu, platform="gpu")

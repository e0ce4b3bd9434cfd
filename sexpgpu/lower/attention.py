"""The lowering of sdpa: cuDNN's fused attention or the Pallas flash kernel on a GPU, else XLA.

Which one a shape gets is probed once and cached: by a tiny compile on a CUDA
machine, by lowering for CUDA elsewhere (`sexpgpu check --target cuda`). A probe
builds what the step will build, under the sharded step's `vmap` over ranks when
the step has one. The choice and the reason go to the lowering report through
`ctx.notes`: `impl` is cudnn, pallas or xla; `kernel` names it more closely
(cudnn, pallas-flash, pallas-segments, xla) and `backend` a Pallas kernel's.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from sexpgpu.ir.ops import OPS
from sexpgpu.lower import cuda_target
from sexpgpu.lower.registry import register_lowering

_PROBES: dict[tuple, str | None] = {}
# The ranks the sharded step's `jax.vmap` maps over while it traces (0: no such vmap).
_RANKS: contextvars.ContextVar[int] = contextvars.ContextVar("sexpgpu_attention_ranks",
                                                             default=0)


@contextlib.contextmanager
def under_rank_vmap(ranks: int):
  """Marks what is traced inside as mapped over `ranks` by `jax.vmap` (the fsdp/hsdp step)."""
  token = _RANKS.set(int(ranks))
  try:
    yield
  finally:
    _RANKS.reset(token)


def _note(ctx, q, causal, segments=None) -> dict:
  return {"kind": "attention", "impl": "xla", "kernel": "xla", "backend": "",
          "dtype": jnp.dtype(ctx.compute_dtype(q)).name, "causal": causal,
          "shape": tuple(q.shape), "why": "", "mask": "segments" if segments is not None else ""}


def sdpa_any(ctx, q, k, v, segments=None, *, causal, scale):
  """sdpa off the GPU: XLA's, the reference; the lowering report is told why."""
  if ctx.platform is not None:
    why = f"on {ctx.platform}" + ("; segment mask by XLA" if segments is not None else "")
    ctx.notes.append({**_note(ctx, q, causal, segments), "why": why})
  return OPS["sdpa"].lower(ctx, q, k, v, segments, causal=causal, scale=scale)


def sdpa_gpu(ctx, q, k, v, segments=None, *, causal, scale):
  """sdpa on a GPU: cuDNN, else the Pallas flash kernel, else XLA; the choice goes to ctx.notes.

  With segments (packed documents), cuDNN takes them as an additive bias and the
  flash kernel as segment ids.
  """
  ct = ctx.compute_dtype(q)
  note = _note(ctx, q, causal, segments)
  masked = segments is not None
  ranks = _RANKS.get()
  shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
  why = _cudnn_refusal(*shapes, ct, causal, scale, masked, ranks)
  if why is None:
    note.update(impl="cudnn", kernel="cudnn", why="segments as cuDNN's bias" if masked else "")
    ctx.notes.append(note)
    t = lambda x: jnp.transpose(x.astype(ct), (0, 2, 1, 3))  # [b, h, t, d] <-> [b, t, h, d]
    bias = _segment_bias(segments, q.shape[1], ct, ranks) if masked else None
    return t(_cudnn(t(q), t(k), t(v), bias, causal, float(scale))).astype(q.dtype)
  pallas_why = _pallas_refusal(*shapes, ct, causal, scale, masked, ranks)
  if pallas_why is None:
    from sexpgpu.lower.kernels import flash_attention as fa
    note.update(impl="pallas", kernel="pallas-segments" if masked else "pallas-flash",
                backend=fa.BACKEND, why=f"cuDNN: {why}")
    ctx.notes.append(note)
    # under the sharded step's vmap, the kernels get a sharding rule (batch and heads split)
    return fa.flash_attention(q.astype(ct), k.astype(ct), v.astype(ct), segments,
                              causal=causal, scale=scale, split=bool(ranks)).astype(q.dtype)
  note["why"] = (f"cuDNN: {why}; Pallas: {pallas_why}"
                 + ("; segment mask by XLA" if masked else ""))
  ctx.notes.append(note)
  return OPS["sdpa"].lower(ctx, q, k, v, segments, causal=causal, scale=scale)


def _segment_bias(segments, heads: int, ct, ranks: int):
  """[b, 1, t, t] (or [b, heads, t, t] under the ranks' vmap): 0 within a segment, the
  dtype's lowest value across segments. jax 0.10.2's batching of cuDNN attention reshapes
  a bias as [batch·ranks, heads, t, t], so under a vmap it must have every head."""
  same = (segments[:, :, None] == segments[:, None, :])[:, None]
  bias = jnp.where(same, jnp.asarray(0, ct), jnp.asarray(jnp.finfo(ct).min, ct))
  if ranks:
    bias = jnp.broadcast_to(bias, (bias.shape[0], heads) + bias.shape[2:])
  return bias


def _cudnn_call(q, k, v, bias, causal, scale):
  return jax.nn.dot_product_attention(q, k, v, bias, scale=scale, is_causal=causal,
                                      implementation="cudnn")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _cudnn(q, k, v, bias, causal, scale):
  """cuDNN attention ([b, t, h, d]) whose backward sees a cotangent mapped as its output.

  Under `jax.vmap`, a cotangent that is the same for every rank (the gradient of a
  plain sum) reaches jax 0.10.2's batching of cuDNN's backward unmapped, which that
  rule cannot reshape; adding zero times the (mapped) output maps it."""
  return _cudnn_call(q, k, v, bias, causal, scale)


def _cudnn_fwd(q, k, v, bias, causal, scale):
  out, back = jax.vjp(lambda q, k, v: _cudnn_call(q, k, v, bias, causal, scale), q, k, v)
  return out, (back, out, bias)


def _cudnn_bwd(causal, scale, res, g):
  back, out, bias = res
  dq, dk, dv = back(g + (out * 0).astype(g.dtype))
  return dq, dk, dv, None if bias is None else jnp.zeros_like(bias)


_cudnn.defvjp(_cudnn_fwd, _cudnn_bwd)


def _first_line(e: Exception) -> str:
  return (f"{type(e).__name__}: " + (str(e).strip().split("\n") or [""])[0])[:200]


def _probe_grads(attend, qs, ks, vs, ct, masked, ranks):
  """Builds value_and_grad of `attend(q, k, v, segments)` as the step will: each input
  and the cotangent mapped over `ranks` by `jax.vmap` when the step maps them."""
  lead = (ranks,) if ranks else ()
  sds = [jax.ShapeDtypeStruct(lead + tuple(s), ct) for s in (qs, ks, vs)]
  cot = jax.ShapeDtypeStruct(lead + tuple(qs[:3]) + (vs[3],), ct)
  seg = jax.ShapeDtypeStruct(lead + (qs[0], qs[2]), jnp.int32) if masked else None

  def loss(q, k, v, s, w):
    return jnp.sum(attend(q, k, v, s).astype(jnp.float32) * w.astype(jnp.float32))

  fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
  if ranks:
    fn = jax.vmap(fn, in_axes=(0, 0, 0, 0 if masked else None, 0))
  cuda_target.probe(fn, *sds, seg, cot)


def _cudnn_refusal(qs, ks, vs, ct, causal, scale, masked=False, ranks=0) -> str | None:
  """Why cuDNN will not take this attention (None: it will), probed once, cached."""
  key = ("cudnn", qs, ks, vs, jnp.dtype(ct).name, causal, scale, masked, ranks)
  if key not in _PROBES:
    _PROBES[key] = _probe_cudnn(qs, ks, vs, ct, causal, scale, masked, ranks)
  return _PROBES[key]


def _probe_cudnn(qs, ks, vs, ct, causal, scale, masked=False, ranks=0) -> str | None:
  if jnp.dtype(ct) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"it takes bf16 or f16, not {jnp.dtype(ct).name}"
  if causal and qs[2] != ks[2]:
    return "causal attention with different query and key lengths"
  t = lambda x: jnp.transpose(x, (0, 2, 1, 3))

  def attend(q, k, v, s):
    bias = _segment_bias(s, qs[1], ct, ranks) if s is not None else None
    return t(_cudnn(t(q), t(k), t(v), bias, causal, float(scale)))

  try:
    _probe_grads(attend, qs, ks, vs, ct, masked, ranks)
  except Exception as e:  # RuntimeError (no cuDNN), ValueError/NotImplementedError, XLA errors
    return _first_line(e)
  return None


def _pallas_refusal(qs, ks, vs, ct, causal, scale, masked=False, ranks=0) -> str | None:
  """Why the Pallas flash kernel will not take this attention (None: it will), cached."""
  key = ("pallas", qs, ks, vs, jnp.dtype(ct).name, causal, scale, masked, ranks)
  if key in _PROBES:
    return _PROBES[key]
  try:
    from sexpgpu.lower.kernels import flash_attention as fa
  except ImportError as e:
    return _first_line(e)
  why = fa.refusal(qs, ks, vs, causal, ct, masked)
  if why is None:
    attend = lambda q, k, v, s: fa.flash_attention(q, k, v, s, causal=causal, scale=scale,
                                                   split=bool(ranks))
    try:
      _probe_grads(attend, qs, ks, vs, ct, masked, ranks)
    except Exception as e:  # a lowering refusal (Triton's, a shape's)
      why = _first_line(e)
  _PROBES[key] = why
  return why


register_lowering("sdpa", sdpa_any)
register_lowering("sdpa", sdpa_gpu, platform="gpu")

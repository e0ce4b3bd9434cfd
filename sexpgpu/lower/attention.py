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


def _note(ctx, q, causal) -> dict:
  return {"kind": "attention", "impl": "xla", "dtype": jnp.dtype(ctx.compute_dtype(q)).name,
          "causal": causal, "shape": tuple(q.shape), "why": ""}


def sdpa_any(ctx, q, k, v, *, causal, scale):
  """sdpa off the GPU: XLA's, the reference; the lowering report is told why."""
  if ctx.platform is not None:
    ctx.notes.append({**_note(ctx, q, causal), "why": f"on {ctx.platform}"})
  return OPS["sdpa"].lower(ctx, q, k, v, causal=causal, scale=scale)


def sdpa_gpu(ctx, q, k, v, *, causal, scale):
  """sdpa on a GPU: cuDNN, else the Pallas flash kernel, else XLA; the choice goes to ctx.notes."""
  ct = ctx.compute_dtype(q)
  note = _note(ctx, q, causal)
  why = _cudnn_refusal(q.shape, k.shape, v.shape, ct, causal, scale)
  if why is None:
    note["impl"] = "cudnn"
    ctx.notes.append(note)
    t = lambda x: jnp.transpose(x.astype(ct), (0, 2, 1, 3))  # [b, h, t, d] <-> [b, t, h, d]
    out = jax.nn.dot_product_attention(t(q), t(k), t(v), scale=scale, is_causal=causal,
                                       implementation="cudnn")
    return t(out).astype(q.dtype)
  flash, pallas_why = _pallas_flash(q.shape, k.shape, v.shape, ct, causal, scale)
  note["why"] = f"cuDNN: {why}" + ("" if flash else f"; Pallas: {pallas_why}")
  ctx.notes.append(note)
  if flash is not None:
    note["impl"] = "pallas"
    return flash(q.astype(ct), k.astype(ct), v.astype(ct)).astype(q.dtype)
  return OPS["sdpa"].lower(ctx, q, k, v, causal=causal, scale=scale)


def _first_line(e: Exception) -> str:
  return (f"{type(e).__name__}: " + (str(e).strip().split("\n") or [""])[0])[:200]


def _cudnn_refusal(qs, ks, vs, ct, causal, scale) -> str | None:
  """Why cuDNN will not take this attention (None: it will), probed by a tiny compile, cached."""
  key = ("cudnn", tuple(qs), tuple(ks), tuple(vs), jnp.dtype(ct).name, causal, scale)
  if key not in _PROBES:
    _PROBES[key] = _probe_cudnn(qs, ks, vs, ct, causal, scale)
  return _PROBES[key]


def _probe_cudnn(qs, ks, vs, ct, causal, scale) -> str | None:
  if jnp.dtype(ct) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"it takes bf16 or f16, not {jnp.dtype(ct).name}"
  if causal and qs[2] != ks[2]:
    return "causal attention with different query and key lengths"
  t = lambda s: jax.ShapeDtypeStruct((s[0], s[2], s[1], s[3]), ct)

  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                       implementation="cudnn")
    return jnp.sum(out.astype(jnp.float32))

  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(t(qs), t(ks), t(vs)).compile()
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


register_lowering("sdpa", sdpa_any)
register_lowering("sdpa", sdpa_gpu, platform="gpu")

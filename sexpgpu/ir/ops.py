"""The IR's vocabulary: every primitive, registered once with its JAX lowering.

A primitive's shape rule is its lowering evaluated abstractly (see
`ir.shapes`), so this table is the single definition of what an op does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "i32": jnp.int32,
          "u32": jnp.uint32, "bool": jnp.bool_}
DTYPE_NAMES = {np.dtype(v).name: k for k, v in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
  """The IR's short name of a numpy/jax dtype ("f32", "i32", ...)."""
  return DTYPE_NAMES[np.dtype(dtype).name]


@dataclasses.dataclass
class LowerCtx:
  """What a lowering rule may consult besides its inputs and attributes.

  Attributes:
    precision: "f32", or "bf16" to compute products and attention in bf16.
    rng: the PRNG key of this microbatch (None in passes and shape rules).
    training: False in passes (dropout is off) and in shape rules.
    notes: what rules chose where a choice was made (for the lowering report).
    platform: the device the step runs on ("cpu", "gpu"), where a rule lowers
      differently for it; None when unknown (shape rules, passes).
  """

  precision: str = "f32"
  rng: Any = None
  training: bool = False
  notes: list = dataclasses.field(default_factory=list)
  platform: str | None = None

  def compute_dtype(self, x):
    return jnp.bfloat16 if self.precision == "bf16" and x.dtype == jnp.float32 else x.dtype


@dataclasses.dataclass(frozen=True)
class OpDef:
  """One primitive: its name, how many tensor inputs, and its lowering."""

  name: str
  lower: Callable[..., Any]
  min_inputs: int
  max_inputs: int | None  # None: any number
  doc: str


OPS: dict[str, OpDef] = {}


def register(name: str, min_inputs: int, max_inputs: int | None, doc: str):
  """Registers a lowering rule `rule(ctx, *inputs, **attrs)` for op `name`."""

  def deco(fn):
    if name in OPS:
      raise ValueError(f"op {name} registered twice")
    OPS[name] = OpDef(name, fn, min_inputs, max_inputs, doc)
    return fn

  return deco


def _binary(name, fn, doc):
  register(name, 2, 2, doc)(lambda ctx, a, b: fn(a, b))


def _unary(name, fn, doc):
  register(name, 1, 1, doc)(lambda ctx, a: fn(a))


# --- elementwise -------------------------------------------------------------
_binary("+", jnp.add, "sum, broadcasting")
_binary("-", jnp.subtract, "difference, broadcasting")
_binary("*", jnp.multiply, "product, broadcasting")
_binary("/", jnp.divide, "quotient, broadcasting")
_binary("pow", jnp.power, "power")
_binary("max", jnp.maximum, "elementwise maximum")
_binary("min", jnp.minimum, "elementwise minimum")
_unary("neg", jnp.negative, "negation")
_unary("abs", jnp.abs, "absolute value")
_unary("exp", jnp.exp, "e to the x")
_unary("log", jnp.log, "natural logarithm")
_unary("sqrt", jnp.sqrt, "square root")
_unary("rsqrt", jax.lax.rsqrt, "1 / sqrt(x)")
_unary("square", jnp.square, "x * x")
_unary("tanh", jnp.tanh, "hyperbolic tangent")
_unary("cos", jnp.cos, "cosine")
_unary("sin", jnp.sin, "sine")
_unary("sigmoid", jax.nn.sigmoid, "logistic sigmoid")
_unary("relu", jax.nn.relu, "max(x, 0)")
_unary("gelu", jax.nn.gelu, "GELU, tanh approximation")
_unary("silu", jax.nn.silu, "x * sigmoid(x)")
_binary("<", jnp.less, "less than")
_binary("<=", jnp.less_equal, "less or equal")
_binary(">", jnp.greater, "greater than")
_binary(">=", jnp.greater_equal, "greater or equal")
_binary("=", jnp.equal, "equal")
_binary("!=", jnp.not_equal, "not equal")


@register("where", 3, 3, "C ? A : B elementwise")
def _where(ctx, c, a, b):
  return jnp.where(c, a, b)


@register("cast", 1, 1, "convert to a dtype")
def _cast(ctx, x, *, dtype):
  return x.astype(DTYPES[dtype])


# --- reductions --------------------------------------------------------------
def _reduction(name, fn, doc):
  register(name, 1, 1, doc)(lambda ctx, x, *, axes, keep: fn(x, axis=axes, keepdims=keep))


_reduction("sum", jnp.sum, "sum over axes")
_reduction("mean", jnp.mean, "mean over axes")
_reduction("max-of", jnp.max, "maximum over axes")
_reduction("min-of", jnp.min, "minimum over axes")
_reduction("logsumexp", jax.nn.logsumexp, "log of the sum of exponentials")


@register("argmax", 1, 1, "index of the maximum along one axis (int32)")
def _argmax(ctx, x, *, axis, keep):
  return jnp.argmax(x, axis=axis, keepdims=keep).astype(jnp.int32)


# --- shape -------------------------------------------------------------------
@register("reshape", 1, 1, "same elements, new shape")
def _reshape(ctx, x, *, shape):
  return jnp.reshape(x, shape)


@register("transpose", 1, 1, "permute axes")
def _transpose(ctx, x, *, perm):
  return jnp.transpose(x, perm)


@register("concat", 1, None, "join along an axis")
def _concat(ctx, *xs, axis):
  return jnp.concatenate(xs, axis=axis)


@register("slice", 1, 1, "X[start:end] along one axis")
def _slice(ctx, x, *, axis, start, end):
  return jax.lax.slice_in_dim(x, start, end, axis=axis)


@register("take", 2, 2, "gather rows of X (axis 0) at integer indices")
def _take(ctx, x, idx):
  return jnp.take(x, idx, axis=0)


@register("one-hot", 1, 1, "one-hot encoding (f32)")
def _one_hot(ctx, x, *, n):
  return jax.nn.one_hot(x, n, dtype=jnp.float32)


@register("expand", 1, 1, "insert an axis of size 1")
def _expand(ctx, x, *, axis):
  return jnp.expand_dims(x, axis)


@register("squeeze", 1, 1, "remove an axis of size 1")
def _squeeze(ctx, x, *, axis):
  return jnp.squeeze(x, axis)


@register("broadcast", 1, 1, "broadcast to a shape")
def _broadcast(ctx, x, *, shape):
  return jnp.broadcast_to(x, shape)


# --- products ----------------------------------------------------------------
@register("matmul", 2, 2, "matrix product over the last axis of A and first of B")
def _matmul(ctx, a, b):
  ct = ctx.compute_dtype(a)
  if (ctx.platform == "cpu" and b.ndim == 2 and a.ndim >= 1 and ct == jnp.float32
      and a.dtype == b.dtype == jnp.float32):
    return _matmul_cpu(a, b)
  out = jnp.matmul(a.astype(ct), b.astype(ct), preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(a, b))


# On the CPU, the gradient of A @ W with respect to A is G @ Wᵀ, which XLA hands to
# YNNPACK as a product with a transposed operand: measured 1.5x slower per flop than
# the plain product (benchmarks/, the compute shape). Materializing Wᵀ first (behind an
# optimization barrier, so XLA does not fold the transpose back into the product) makes
# it a plain product: 6% off a whole train step at the compute shape, 9% at the tiny one,
# with bitwise the same losses there. GPUs take either layout at full speed: not used.
@jax.custom_vjp
def _matmul_cpu(a, w):
  return jnp.matmul(a, w)


def _matmul_cpu_fwd(a, w):
  return jnp.matmul(a, w), (a, w)


def _matmul_cpu_bwd(res, g):
  a, w = res
  da = jnp.matmul(g, jax.lax.optimization_barrier(w.T))
  k, n = w.shape
  dw = jnp.matmul(a.reshape(-1, k).T, g.reshape(-1, n))
  return da, dw


_matmul_cpu.defvjp(_matmul_cpu_fwd, _matmul_cpu_bwd)


@register("einsum", 1, None, "Einstein summation")
def _einsum(ctx, *xs, spec):
  ct = ctx.compute_dtype(xs[0])
  out = jnp.einsum(spec, *(x.astype(ct) for x in xs), preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(*xs))


# --- neural ------------------------------------------------------------------
@register("softmax", 1, 1, "softmax along an axis")
def _softmax(ctx, x, *, axis):
  return jax.nn.softmax(x, axis=axis)


@register("log-softmax", 1, 1, "log of softmax along an axis")
def _log_softmax(ctx, x, *, axis):
  return jax.nn.log_softmax(x, axis=axis)


@register("causal-mask", 1, 1, "fill future positions (last two axes) with -inf")
def _causal_mask(ctx, s):
  q, k = s.shape[-2], s.shape[-1]
  keep = jnp.tril(jnp.ones((q, k), dtype=bool), k - q)
  return jnp.where(keep, s, jnp.array(-jnp.inf, s.dtype))


@register("dropout", 1, 1, "zero elements with probability RATE in training")
def _dropout(ctx, x, *, rate, site):
  if not ctx.training or ctx.rng is None or rate == 0.0:
    return x
  key = jax.random.fold_in(ctx.rng, site)
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


@register("cross-entropy", 2, 3, "mean negative log-likelihood of integer targets (f32)")
def _cross_entropy(ctx, logits, targets, mask=None):
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  nll = lse - picked
  if mask is None:
    return jnp.mean(nll)
  m = mask.astype(jnp.float32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


@register("sdpa", 3, 3, "scaled dot-product attention, layout [batch, heads, seq, dim]")
def _sdpa(ctx, q, k, v, *, causal, scale):
  return _sdpa_choose(ctx, q, k, v, causal, scale)  # cuDNN, Pallas or XLA: see the end of the file


def _sdpa_xla(ctx, q, k, v, *, causal, scale):
  ct = ctx.compute_dtype(q)
  s = jnp.einsum("...qd,...kd->...qk", q.astype(ct), k.astype(ct),
                 preferred_element_type=jnp.float32) * scale
  if causal:
    s = _causal_mask(ctx, s)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("...qk,...kd->...qd", p.astype(ct), v.astype(ct),
                   preferred_element_type=jnp.float32)
  return out.astype(q.dtype)


# --- constants ---------------------------------------------------------------
@register("full", 0, 0, "a tensor filled with one value")
def _full(ctx, *, shape, value, dtype):
  return jnp.full(shape, value, DTYPES[dtype])


@register("iota", 0, 0, "0 .. N-1 (int32)")
def _iota(ctx, *, n):
  return jnp.arange(n, dtype=jnp.int32)


# --- identity ops kept for the graph's bookkeeping ----------------------------
@register("tap", 1, 1, "X itself, recorded for a diagnostic")
def _tap(ctx, x, *, name):
  return x


def fan_in_std(shape: tuple[int, ...], scale: float) -> float:
  """std of a (fan-in SCALE) initializer: SCALE / sqrt(product of all but the last axis)."""
  fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]
  return scale / math.sqrt(max(fan_in, 1))


# --- ops that rewrites introduce (sexpgpu.ir.rewrite) -----------------------------
@register("chunked-cross-entropy", 3, 4,
          "cross-entropy of (matmul H W) over vocabulary chunks, never holding the full logits")
def _chunked_cross_entropy(ctx, h, w, targets, mask=None, *, chunks):
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
  loss = jnp.sum((lse - picked) * wts) / jnp.maximum(jnp.sum(wts), 1.0)
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


# --- sdpa: which implementation ----------------------------------------------------
_PROBES: dict[tuple, str | None] = {}


def _platform() -> str:
  """The default backend, or "none" while no backend is started (building the IR)."""
  from jax._src import xla_bridge  # only to ask without starting a backend
  return jax.default_backend() if xla_bridge.backends_are_initialized() else "none"


def _sdpa_choose(ctx, q, k, v, causal, scale):
  """sdpa lowered by cuDNN, else the Pallas flash kernel, else XLA; the choice goes to ctx.notes."""
  ct = ctx.compute_dtype(q)
  note = {"kind": "attention", "impl": "xla", "dtype": jnp.dtype(ct).name, "causal": causal,
          "shape": tuple(q.shape), "why": ""}
  platform = _platform()
  if platform in ("gpu", "cuda"):
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
    if flash is not None:
      note["impl"] = "pallas"
      ctx.notes.append(note)
      return flash(q.astype(ct), k.astype(ct), v.astype(ct)).astype(q.dtype)
  elif platform != "none":
    note["why"] = f"on {platform}"
  if platform != "none":
    ctx.notes.append(note)
  return _sdpa_xla(ctx, q, k, v, causal=causal, scale=scale)


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
    from third_party.kernels import flash_attention as fa
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

"""The IR's vocabulary: every primitive, registered once with its reference rule.

A primitive's reference rule is plain JAX that says what the op computes; its
shape rule is that rule evaluated abstractly (see `ir.shapes`), so this table
is the single definition of what an op does. How an op is lowered on a given
platform (a custom gradient, cuDNN, a Pallas kernel) is backend policy and
lives in `sexpgpu.lower`, registered with `register_lowering`.
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
  lower: Callable[..., Any]  # the reference rule `rule(ctx, *inputs, **attrs)`
  min_inputs: int
  max_inputs: int | None  # None: any number
  doc: str


OPS: dict[str, OpDef] = {}


def register(name: str, min_inputs: int, max_inputs: int | None, doc: str):
  """Registers the reference rule `rule(ctx, *inputs, **attrs)` of op `name`."""

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
  out = jnp.matmul(a.astype(ct), b.astype(ct), preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(a, b))


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


@register("segment-mask", 2, 2,
          "fill scores [b, .., q, k] where the query's and key's segments [b, t] differ with -inf")
def _segment_mask(ctx, s, segments):
  return jnp.where(_same_segment(segments, s.ndim), s, jnp.array(-jnp.inf, s.dtype))


def _same_segment(segments, ndim: int):
  """[b, 1.., t, t]: whether query and key share a segment (padding, 0, is its own segment)."""
  same = segments[:, :, None] == segments[:, None, :]
  return same.reshape(same.shape[:1] + (1,) * (ndim - 3) + same.shape[1:])


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


@register("sdpa", 3, 4, "scaled dot-product attention, layout [batch, heads, seq, dim]; "
          "SEGMENTS [batch, seq] keeps each query to keys of its own segment")
def _sdpa(ctx, q, k, v, segments=None, *, causal, scale):
  # the reference; `lower.attention` picks cuDNN or Pallas on a GPU
  ct = ctx.compute_dtype(q)
  s = jnp.einsum("...qd,...kd->...qk", q.astype(ct), k.astype(ct),
                 preferred_element_type=jnp.float32) * scale
  if causal:
    s = _causal_mask(ctx, s)
  if segments is not None:
    s = _segment_mask(ctx, s, segments)
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
  # the reference holds the full logits; `lower.xent` is the chunked lowering
  return _cross_entropy(ctx, _matmul(ctx, h, w), targets, mask)

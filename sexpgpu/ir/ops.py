"""The IR's vocabulary: every primitive, declared once with its signature and reference rule.

A primitive's reference rule is plain JAX that says what the op computes; its
shape rule is that rule evaluated abstractly (see `ir.shapes`), so this table
is the single definition of what an op does. How an op is lowered on a given
platform (a custom gradient, cuDNN, a Pallas kernel) is backend policy and
lives in `sexpgpu.lower`, registered with `register_lowering`; its FLOPs, its
backward's cost and saved inputs, its decode and split rules are tables of their
own modules (`ir.opdef.OpTable`), each a default rule for the op's kind and the
ops that are its exceptions, so a new op of a kind those tables know (a
pointwise op) is this one declaration; tests/test_op_table.py checks that every
op has an entry in each.

The ops that routing, recurrences, convolutions, random draws and scans of a
function need are declared in `ir.ops_select`, `ir.ops_conv`, `ir.ops_random`
and `ir.ops_scan`, imported at the end of this module.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu.ir.opdef import (DTYPE_NAMES, DTYPES, OPS, REQUIRED, Attr, LowerCtx, OpDef,  # noqa: F401
                              dtype_name, register)


def _binary(name, fn, doc, written=None):
  register(name, ("a", "b"), doc, written=written, kind="pointwise")(lambda ctx, a, b: fn(a, b))


def _unary(name, fn, doc):
  register(name, ("x",), doc, kind="pointwise")(lambda ctx, a: fn(a))


def _logical(fn):
  def rule(ctx, *xs):
    if any(getattr(x, "dtype", None) != jnp.bool_ for x in xs):
      raise TypeError("takes boolean tensors; compare first, as (< a b), or (cast x bool)")
    return fn(*xs)
  return rule


# --- elementwise -------------------------------------------------------------
_binary("+", jnp.add, "sum, broadcasting", "(+ A B ...)")
_binary("-", jnp.subtract, "difference, broadcasting; (- A) negates", "(- A B)")
_binary("*", jnp.multiply, "product, broadcasting", "(* A B ...)")
_binary("/", jnp.divide, "quotient, broadcasting; of static ints an int if exact")
_binary("pow", jnp.power, "power")
_binary("max", jnp.maximum, "elementwise maximum")
_binary("min", jnp.minimum, "elementwise minimum")
_binary("mod", jnp.remainder, "remainder of A / B with B's sign (Python's %)")
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
_unary("erf", jax.lax.erf, "the error function")
_unary("softplus", jax.nn.softplus, "log(1 + e^x), computed stably")
_unary("log1p", jnp.log1p, "log(1 + x), accurate near 0")
_unary("expm1", jnp.expm1, "e^x - 1, accurate near 0")
_unary("floor", jnp.floor, "the largest integer not above x (zero gradient)")
_unary("ceil", jnp.ceil, "the smallest integer not below x (zero gradient)")
_unary("round", jnp.round, "the nearest integer, halves to even (zero gradient)")
_unary("sign", jnp.sign, "-1, 0 or 1")
_unary("isfinite", jnp.isfinite, "whether x is neither infinite nor NaN (bool)")
_unary("stop-gradient", jax.lax.stop_gradient, "x itself, with no gradient through it")
register("logical-not", ("x",), "elementwise not of a boolean tensor", kind="pointwise")(
    lambda ctx, x: _logical(jnp.logical_not)(ctx, x))
register("logical-and", ("a", "b"), "elementwise and of boolean tensors, broadcasting",
         kind="pointwise")(
    lambda ctx, a, b: _logical(jnp.logical_and)(ctx, a, b))
register("logical-or", ("a", "b"), "elementwise or of boolean tensors, broadcasting",
         kind="pointwise")(
    lambda ctx, a, b: _logical(jnp.logical_or)(ctx, a, b))
_binary("<", jnp.less, "less than")
_binary("<=", jnp.less_equal, "less or equal")
_binary(">", jnp.greater, "greater than")
_binary(">=", jnp.greater_equal, "greater or equal")
_binary("=", jnp.equal, "equal")
_binary("!=", jnp.not_equal, "not equal")


@register("where", ("c", "a", "b"), "C ? A : B elementwise", kind="pointwise")
def _where(ctx, c, a, b):
  return jnp.where(c, a, b)


@register("cast", ("x",), "convert to a dtype",
          (Attr("dtype", "dtype", doc="the dtype", positional=True),), kind="pointwise")
def _cast(ctx, x, *, dtype):
  return x.astype(DTYPES[dtype])


@register("clip", ("x",), "x limited to [min, max] (either may be left out)",
          (Attr("min", "float", None, "the lower limit"),
           Attr("max", "float", None, "the upper limit")), kind="pointwise")
def _clip(ctx, x, *, min=None, max=None):  # noqa: A002 (the language's keywords)
  return jnp.clip(x, min, max)


# --- reductions --------------------------------------------------------------
_AXES = Attr("axes", "axes", None, "the axes reduced (nil: all)", positional=True)
_KEEP = Attr("keep", "bool", False, "keep the reduced axes with size 1")


def _reduction(name, fn, doc):
  register(name, ("x",), doc, (_AXES, _KEEP), written=f"({name} X [AXES] :keep false)",
           kind="reduction")(
      lambda ctx, x, *, axes, keep: fn(x, axis=axes, keepdims=keep))


_reduction("sum", jnp.sum, "sum over axes")
_reduction("mean", jnp.mean, "mean over axes")
_reduction("max-of", jnp.max, "maximum over axes")
_reduction("min-of", jnp.min, "minimum over axes")
_reduction("logsumexp", jax.nn.logsumexp, "log of the sum of exponentials")


@register("argmax", ("x",), "index of the maximum along one axis (int32)",
          (Attr("axis", "axis", None, "the axis (nil: the flattened tensor)", positional=True),
           _KEEP), written="(argmax X AXIS)", kind="reduction")
def _argmax(ctx, x, *, axis, keep):
  return jnp.argmax(x, axis=axis, keepdims=keep).astype(jnp.int32)


# --- shape -------------------------------------------------------------------
@register("reshape", ("x",), "same elements, new shape",
          (Attr("shape", "shape", doc="the new shape", positional=True),), kind="movement")
def _reshape(ctx, x, *, shape):
  return jnp.reshape(x, shape)


@register("transpose", ("x",), "permute axes (all reversed when PERM is left out)",
          (Attr("perm", "ints", doc="the permutation", positional=True),),
          written="(transpose X [PERM])", kind="movement")
def _transpose(ctx, x, *, perm):
  return jnp.transpose(x, perm)


@register("concat", ("xs*",), "join along an axis",
          (Attr("axis", "axis", 0, "the axis", positional=True),),
          written="(concat [X Y ...] AXIS)", kind="movement")
def _concat(ctx, *xs, axis):
  return jnp.concatenate(xs, axis=axis)


@register("slice", ("x",), "X[start:end] along one axis; END nil to the end",
          (Attr("axis", "axis", doc="the axis", positional=True),
           Attr("start", "int", doc="the first index", positional=True),
           Attr("end", "int", doc="one past the last", positional=True)),
          written="(slice X AXIS START END)", kind="movement")
def _slice(ctx, x, *, axis, start, end):
  return jax.lax.slice_in_dim(x, start, end, axis=axis)


@register("take", ("table", "indices"), "gather rows of TABLE (axis 0) at integer indices",
          kind="movement")
def _take(ctx, x, idx):
  return jnp.take(x, idx, axis=0)


@register("one-hot", ("x",), "one-hot encoding (f32)",
          (Attr("n", "int", doc="the number of classes", positional=True),), kind="movement")
def _one_hot(ctx, x, *, n):
  return jax.nn.one_hot(x, n, dtype=jnp.float32)


@register("expand", ("x",), "insert an axis of size 1",
          (Attr("axis", "int", doc="where the new axis goes", positional=True),), kind="movement")
def _expand(ctx, x, *, axis):
  return jnp.expand_dims(x, axis)


@register("squeeze", ("x",), "remove an axis of size 1",
          (Attr("axis", "axis", doc="the axis removed", positional=True),), kind="movement")
def _squeeze(ctx, x, *, axis):
  return jnp.squeeze(x, axis)


@register("broadcast", ("x",), "broadcast to a shape (new axes in front)",
          (Attr("shape", "shape", doc="the shape", positional=True),), kind="movement")
def _broadcast(ctx, x, *, shape):
  return jnp.broadcast_to(x, shape)


@register("tril", ("x",), "the lower triangle of the last two axes, the rest zero",
          (Attr("k", "int", 0, "the diagonal kept last (0 the main one, 1 above it)"),),
          kind="movement")
def _tril(ctx, x, *, k):
  if x.ndim < 2:
    raise ValueError("needs at least 2 axes")
  return jnp.tril(x, k)


@register("triu", ("x",), "the upper triangle of the last two axes, the rest zero",
          (Attr("k", "int", 0, "the diagonal kept first (0 the main one, -1 below it)"),),
          kind="movement")
def _triu(ctx, x, *, k):
  if x.ndim < 2:
    raise ValueError("needs at least 2 axes")
  return jnp.triu(x, k)


@register("flip", ("x",), "reverse the order along an axis",
          (Attr("axis", "axis", -1, "the axis"),), kind="movement")
def _flip(ctx, x, *, axis):
  return jnp.flip(x, axis)


@register("tile", ("x",), "repeat the whole tensor REPS times along each axis",
          (Attr("reps", "shape", REQUIRED, "copies along each axis (as many as X has)"),),
          kind="movement")
def _tile(ctx, x, *, reps):
  if len(reps) != x.ndim:
    raise ValueError(f"reps has {len(reps)} entries for {x.ndim} axes")
  return jnp.tile(x, reps)


@register("pad", ("x",), "pad with a constant, [lo hi] positions an axis",
          (Attr("widths", "pairs", REQUIRED, "[[lo hi] ...], one pair an axis"),
           Attr("value", "float", 0.0, "the value padded with")), kind="movement")
def _pad(ctx, x, *, widths, value):
  if len(widths) != x.ndim:
    raise ValueError(f"widths has {len(widths)} pairs for {x.ndim} axes")
  if any(lo < 0 or hi < 0 for lo, hi in widths):
    raise ValueError("widths must not be negative")
  return jnp.pad(x, widths, constant_values=jnp.array(value, x.dtype))


# --- products ----------------------------------------------------------------
@register("matmul", ("a", "b"), "matrix product over the last axis of A and first of B",
          kind="product")
def _matmul(ctx, a, b):
  ct = ctx.compute_dtype(a)
  out = jnp.matmul(a.astype(ct), b.astype(ct), preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(a, b))


@register("einsum", ("xs*",), "Einstein summation",
          (Attr("spec", "spec", doc="the subscripts", positional=True),),
          written='(einsum "spec" A B ...)', kind="product")
def _einsum(ctx, *xs, spec):
  ct = ctx.compute_dtype(xs[0])
  out = jnp.einsum(spec, *(x.astype(ct) for x in xs), preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(*xs))


# --- neural ------------------------------------------------------------------
_ALONG = (Attr("axis", "axis", -1, "the axis", positional=True),)


@register("softmax", ("x",), "softmax along an axis", _ALONG, written="(softmax X AXIS)",
          kind="along")
def _softmax(ctx, x, *, axis):
  _floating(x)
  return jax.nn.softmax(x, axis=axis)


def _floating(x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"takes a float tensor, not {x.dtype}: (cast x f32) first")


@register("log-softmax", ("x",), "log of softmax along an axis", _ALONG,
          written="(log-softmax X AXIS)", kind="along")
def _log_softmax(ctx, x, *, axis):
  _floating(x)
  return jax.nn.log_softmax(x, axis=axis)


@register("causal-mask", ("scores",), "fill future positions (last two axes) with -inf",
          kind="mask")
def _causal_mask(ctx, s):
  q, k = s.shape[-2], s.shape[-1]
  keep = jnp.tril(jnp.ones((q, k), dtype=bool), k - q)
  return jnp.where(keep, s, jnp.array(-jnp.inf, s.dtype))


@register("segment-mask", ("scores", "segments"),
          "fill scores [b, .., q, k] where the query's and key's segments [b, t] differ with -inf",
          kind="mask")
def _segment_mask(ctx, s, segments):
  return jnp.where(_same_segment(segments, s.ndim), s, jnp.array(-jnp.inf, s.dtype))


def _same_segment(segments, ndim: int):
  """[b, 1.., t, t]: whether query and key share a segment (padding, 0, is its own segment)."""
  same = segments[:, :, None] == segments[:, None, :]
  return same.reshape(same.shape[:1] + (1,) * (ndim - 3) + same.shape[1:])


@register("dropout", ("x",), "zero elements with probability RATE in training (the run's key);"
          " identity in passes",
          (Attr("rate", "float", doc="the probability of a zero", positional=True),
           Attr("site", "int", internal=True)), kind="pointwise")
def _dropout(ctx, x, *, rate, site):
  if not ctx.training or ctx.rng is None or rate == 0.0:
    return x
  key = jax.random.fold_in(ctx.rng, site)
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


@register("cross-entropy", ("logits", "targets", ":mask"),
          "mean negative log-likelihood of integer targets (f32); with :mask, over the true"
          " positions (NaN when none is)", kind="loss")
def _cross_entropy(ctx, logits, targets, mask=None):
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  nll = lse - picked
  if mask is None:
    return jnp.mean(nll)
  m = mask.astype(jnp.float32)
  # No position to average over is no loss at all, not a loss of 0: NaN makes an
  # evaluation over fully masked rows visible (E-NUM-001 in training) instead of perfect.
  return jnp.sum(nll * m) / jnp.sum(m)


@register("sdpa", ("q", "k", "v", "segments?"),
          "scaled dot-product attention, layout [batch, heads, seq, dim]; "
          "SEGMENTS [batch, seq] keeps each query to keys of its own segment",
          (Attr("causal", "bool", False, "each query sees only keys at or before it"),
           Attr("scale", "float", None, "the scores' scale (default 1/sqrt(dim))")),
          written="(sdpa Q K V :causal B :scale S)", kind="product")
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
@register("full", (), "a tensor filled with one value",
          (Attr("shape", "shape", doc="the shape", positional=True),
           Attr("value", "float", doc="the value", positional=True),
           Attr("dtype", "dtype", "f32", "the dtype")), written="(full SHAPE V :dtype f32)",
           kind="constant")
def _full(ctx, *, shape, value, dtype):
  return jnp.full(shape, value, DTYPES[dtype])


@register("iota", (), "0 .. N-1 (int32)",
          (Attr("n", "int", doc="how many", positional=True),), kind="constant")
def _iota(ctx, *, n):
  return jnp.arange(n, dtype=jnp.int32)


# --- identity ops kept for the graph's bookkeeping ----------------------------
@register("tap", ("x",), "X itself, recorded for a diagnostic",
          (Attr("name", "str", internal=True),), written="(tap NAME X)", kind="pointwise")
def _tap(ctx, x, *, name):
  return x


def fan_in_std(shape: tuple[int, ...], scale: float) -> float:
  """std of a (fan-in SCALE) initializer: SCALE / sqrt(product of all but the last axis)."""
  fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]
  return scale / math.sqrt(max(fan_in, 1))


# --- ops that rewrites introduce (sexpgpu.ir.rewrite) -----------------------------
@register("chunked-cross-entropy", ("h", "w", "targets", "mask?"),
          "cross-entropy of (matmul H W) over vocabulary chunks, never holding the full logits",
          (Attr("chunks", "int", internal=True),), kind="product")
def _chunked_cross_entropy(ctx, h, w, targets, mask=None, *, chunks):
  # the reference holds the full logits; `lower.xent` is the chunked lowering
  return _cross_entropy(ctx, _matmul(ctx, h, w), targets, mask)


from sexpgpu.ir import ops_conv, ops_random, ops_scan, ops_select  # noqa: E402,F401  (they register)

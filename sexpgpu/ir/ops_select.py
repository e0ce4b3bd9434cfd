"""Selection, routing and running totals: what mixture-of-experts routing with capacity needs.

`top-k`, gathers and scatters along an axis, sorting, and cumulative sums and
products (GShard's, Switch's and Mixtral's routers are written with these).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sexpgpu.ir.opdef import REQUIRED, Attr, register

_K = Attr("k", "int", REQUIRED, "how many of the largest, along the last axis")


def _top_k(x, k):
  if x.ndim < 1 or not 1 <= k <= x.shape[-1]:
    raise ValueError(f"k {k} is outside 1..{x.shape[-1] if x.ndim else 0}, the last axis")
  return jax.lax.top_k(x, k)


@register("top-k", ("x",), "the K largest values along the last axis, descending; the language"
          " returns [values indices]", (_K,), written="(top-k X :k K) → [values indices]",
          kind="along")
def _top_k_values(ctx, x, *, k):
  return _top_k(x, k)[0]


@register("top-k-indices", ("x",), "the int32 indices of the K largest along the last axis"
          " (the second value of `top-k`)", (_K,), kind="along")
def _top_k_indices(ctx, x, *, k):
  return _top_k(x, k)[1].astype(jnp.int32)


_AXIS = Attr("axis", "axis", -1, "the axis")


def _integer(idx, what="indices"):
  if not jnp.issubdtype(idx.dtype, jnp.integer):
    raise TypeError(f"the {what} must be an integer tensor, not {idx.dtype}")


@register("take-along", ("x", "indices"), "X gathered along an axis at integer INDICES shaped as"
          " X except along it (numpy's take_along_axis)", (_AXIS,), kind="movement")
def _take_along(ctx, x, idx, *, axis):
  _integer(idx)
  if idx.ndim != x.ndim:
    raise ValueError(f"indices have {idx.ndim} axes, X has {x.ndim}")
  return jnp.take_along_axis(x, idx, axis=axis, mode="clip")


@register("scatter-add", ("x", "indices", "updates"), "X with the rows of UPDATES added at"
          " integer INDICES along axis 0 (repeated indices add up; out-of-range ones are dropped)",
          kind="movement")
def _scatter_add(ctx, x, idx, upd):
  _integer(idx)
  if upd.shape != idx.shape + x.shape[1:]:
    raise ValueError(f"updates {list(upd.shape)} must be indices' shape {list(idx.shape)} "
                     f"followed by X's rows {list(x.shape[1:])}")
  return x.at[idx].add(upd.astype(x.dtype), mode="drop")


_DESC = Attr("descending", "bool", False, "largest first")


@register("sort", ("x",), "X sorted along an axis", (_AXIS, _DESC), kind="along")
def _sort(ctx, x, *, axis, descending):
  return jnp.sort(x, axis=axis, descending=descending, stable=True)


@register("argsort", ("x",), "the int32 indices that sort X along an axis (stable)",
          (_AXIS, _DESC), kind="along")
def _argsort(ctx, x, *, axis, descending):
  return jnp.argsort(x, axis=axis, descending=descending, stable=True).astype(jnp.int32)


_RUNNING = (_AXIS, Attr("reverse", "bool", False, "run from the end of the axis"),
            Attr("exclusive", "bool", False, "each position leaves itself out"))


def _running(fn, identity):
  def rule(ctx, x, *, axis, reverse, exclusive):
    axis = axis % x.ndim if x.ndim else 0
    out = fn(x, axis=axis, reverse=reverse)
    if exclusive:  # shift by one along the axis, the identity in front
      n = x.shape[axis]
      fill = jnp.full_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis), identity)
      if reverse:
        out = jnp.concatenate([jax.lax.slice_in_dim(out, 1, n, axis=axis), fill], axis=axis)
      else:
        out = jnp.concatenate([fill, jax.lax.slice_in_dim(out, 0, n - 1, axis=axis)], axis=axis)
    return out
  return rule


register("cumsum", ("x",), "running sum along an axis", _RUNNING, kind="along")(
    _running(jax.lax.cumsum, 0))
register("cumprod", ("x",), "running product along an axis", _RUNNING, kind="along")(
    _running(jax.lax.cumprod, 1))


def _combine(axis):
  def fn(left, right):
    (a1, x1), (a2, x2) = left, right
    return a1 * a2, a2 * x1 + x2
  return fn


@register("linear-recurrence", ("a", "x"), "H with H_t = A_t * H_(t-1) + X_t along an axis"
          " (H before the first is 0), as an associative scan: parallel in time (the gated"
          " linear recurrences of Mamba's selective scan, RG-LRU, S5)",
          (_AXIS, Attr("reverse", "bool", False, "run from the end of the axis")), kind="along")
def _linear_recurrence(ctx, a, x, *, axis, reverse):
  if a.shape != x.shape:
    raise ValueError(f"A {list(a.shape)} and X {list(x.shape)} must have one shape")
  dt = jnp.result_type(a, x)
  return jax.lax.associative_scan(_combine(axis), (a.astype(dt), x.astype(dt)),
                                  reverse=reverse, axis=axis % x.ndim)[1]

"""Scans of a user's function over an axis: `scan` (a carry through time, `lax.scan`) and
`associative-scan` (a running combination, parallel in time, `lax.associative_scan`).

A scan's function is a body of the graph (`ir.graph.Fn`), built once by the front end on
one trip's types; its parameters are shared by every trip. Its node holds several values
(dtype "tuple"), each read by a "part" node. The reference rules below take the function
as `fn`, a Python callable the interpreter makes of the body:

- scan: `fn(carry, x, t) → (carry, y)`, tuples of arrays, `t` the trip's position;
- associative-scan: `fn(a, b) → c`, tuples of arrays of one element each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sexpgpu.ir.opdef import Attr, register

# Trips of a scan's loop unrolled into one iteration (lax.scan's `unroll`); tests that
# compare FLOPs with XLA's cost analysis, which counts a loop's body once, unroll all.
UNROLL = 1

_AXIS = Attr("axis", "axis", 0, "the axis of XS that the function runs along")
_REVERSE = Attr("reverse", "bool", False, "run from the end of the axis")
_INTERNAL = (Attr("carries", "int", internal=True), Attr("operands", "int", internal=True))


@register("scan", ("init", "xs"), "F applied along an axis of XS: F maps [carry x] to"
          " [carry y], the carry starting at INIT (a tensor or a vector of them) and keeping"
          " its type; returns [the last carry, the y's stacked at the axis]; F's parameters"
          " are shared by every position (an RNN cell)", (_AXIS, _REVERSE) + _INTERNAL,
          written="(scan F INIT XS :axis 0 :reverse false) → [carry ys]", kind="function")
def _scan(ctx, *leaves, fn, carries, operands, axis, reverse):
  init, xs = leaves[:carries], leaves[carries:operands]
  moved = tuple(jnp.moveaxis(x, axis, 0) for x in xs)
  n = moved[0].shape[0]

  def step(carry, xt):
    x, t = xt
    return fn(carry, x, t)

  carry, ys = jax.lax.scan(step, tuple(init), (moved, jnp.arange(n, dtype=jnp.int32)),
                           reverse=reverse, unroll=UNROLL)
  return tuple(carry) + tuple(jnp.moveaxis(y, 0, axis) for y in ys)


@register("associative-scan", ("xs",), "the running combination of XS (a tensor or a vector"
          " of them) along an axis by an associative F, which maps [a b] to one element of"
          " XS's type; parallel in time (gated linear recurrences, Blelloch's scan)",
          (_AXIS, _REVERSE) + _INTERNAL,
          written="(associative-scan F XS :axis 0 :reverse false)", kind="function")
def _associative_scan(ctx, *leaves, fn, carries, operands, axis, reverse):
  xs = tuple(leaves[:operands])
  combine = jax.vmap(fn, in_axes=(axis, axis), out_axes=axis)
  return tuple(jax.lax.associative_scan(combine, xs, reverse=reverse, axis=axis))


def combines(n: int) -> int:
  """How many element combinations `lax.associative_scan` computes over n elements (its
  odd/even recursion: the pairs, the scan of the pairs, then the even elements)."""
  if n < 2:
    return 0
  return n // 2 + combines(n // 2) + (n + 1) // 2 - 1


def interleaved(n: int) -> int:
  """How many elements `lax.associative_scan` interleaves over n elements: each level of
  its recursion joins its even and odd results by one addition an element."""
  return 0 if n < 2 else n + interleaved(n // 2)

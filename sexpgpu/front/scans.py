"""Calls of `scan` and `associative-scan`: a user's function built once as a body of the graph.

`(scan F INIT XS :axis A :reverse B)` builds F on one position's types, `[carry x]`, where
the carry has INIT's type and x is one slice of XS along A; F returns `[carry y]`. The call
returns `[the last carry, the y's stacked along A]`. `(associative-scan F XS :axis A)`
builds F on two elements `[a b]` of XS's type and returns the running combination. INIT,
XS, the carry and y are each a tensor or a vector of tensors. F's parameters are created
once and shared by every position (unlike a repeat's, stacked per layer).
"""

from __future__ import annotations

from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder, Call, Frame, describe, is_tensor
from sexpgpu.front.values import Builtin, Closure
from sexpgpu.ir.graph import TUPLE, Fn, Node, type_str
from sexpgpu.ir.opdef import OPS

Types = tuple[tuple[str, tuple[int, ...]], ...]


def _leaves(call: Call, i: int, what: str, usage: str) -> tuple[tuple[Node, ...], bool]:
  """A tensor or a vector of tensors: (its tensors, whether it was one tensor)."""
  v = call.args[i]
  if is_tensor(v):
    return (v,), True
  if isinstance(v, tuple) and v and all(is_tensor(x) for x in v):
    return v, False
  raise SxError("E-TYPE-001", f"{call.name}: {what} is a tensor or a vector of tensors; found "
                f"{describe(v)}", location=call.arg_forms[i].loc, fix=f"write {usage}")


def _function(call: Call, arity: int, usage: str) -> Any:
  fn = call.args[0]
  if isinstance(fn, Closure):
    if len(fn.params) != arity:
      raise SxError("E-FORM-001", f"{call.name}: F takes {arity} arguments "
                    f"{'[carry x]' if arity == 2 and call.name == 'scan' else '[a b]'}; "
                    f"`{fn.name or 'fn'}` takes {len(fn.params)}",
                    location=call.arg_forms[0].loc,
                    fix="write F as (fn [carry x] [NEW-CARRY Y])" if call.name == "scan"
                    else "write F as (fn [a b] COMBINED)")
    return fn
  if isinstance(fn, Builtin):
    return fn
  raise SxError("E-TYPE-001", f"{call.name}: F must be a function; found {describe(fn)}",
                location=call.arg_forms[0].loc, fix=f"write {usage}")


def _read(b: Builder, call: Call, usage: str, positional: int) -> tuple[int, bool]:
  """The call's arity and keywords: (axis as written, reverse)."""
  op = OPS[call.name]
  if len(call.args) != positional:
    raise SxError("E-FORM-001", f"{call.name} takes {positional} arguments, given "
                  f"{len(call.args)}", location=call.loc, fix=f"write {usage}")
  for k in call.kw:
    if k not in op.keywords:
      raise SxError("E-FORM-002", f"{call.name} has no keyword :{k}",
                    location=call.kw_locs.get(k) or call.kw_forms[k].loc,
                    fix="known keywords: " + " ".join(":" + a for a in op.keywords)
                    + f"; write {usage}")
  reverse = call.kw.get("reverse", False)
  if not isinstance(reverse, bool):
    raise SxError("E-TYPE-001", f"{call.name}: :reverse is true or false; found "
                  f"{describe(reverse)}", location=call.kw_forms["reverse"].loc,
                  fix=f"write {usage}")
  return call.kw.get("axis", op.attr("axis").default), reverse


def _axis(call: Call, v: Any, xs: tuple[Node, ...], usage: str) -> int:
  """The axis resolved against XS's first tensor; every tensor of XS has it, of one length."""
  rank = len(xs[0].shape)
  where = call.kw_forms["axis"].loc if "axis" in call.kw_forms else call.loc
  is_int = isinstance(v, int) and not isinstance(v, bool)
  if not is_int or not -rank <= v < rank:
    if is_int:
      raise SxError("E-SHAPE-001", f"{call.name}: axis {v} is out of range for XS of rank "
                    f"{rank}", location=where,
                    fix=f"use an axis in {-rank}..{rank - 1}" if rank else
                    "scan a tensor with at least one axis")
    raise SxError("E-TYPE-001", f"{call.name}: :axis is a static integer; found {describe(v)}",
                  location=where, fix=f"write {usage}")
  a = v % rank
  n = xs[0].shape[a]
  for x in xs[1:]:
    if len(x.shape) <= a or x.shape[a] != n:
      raise SxError("E-SHAPE-001", f"{call.name}: every tensor of XS needs axis {a} of "
                    f"length {n} (the first's); found {x.type_str}",
                    location=call.arg_forms[-1].loc,
                    fix="give every tensor of XS the same length along the axis")
  return a


def _body(b: Builder, call: Call, fn: Any, groups: list[tuple[Types, bool]]
          ) -> tuple[tuple[Node, ...], Any, Frame]:
  """Builds `fn` on argument leaves of the given types in a frame of its own.

  Returns:
    (the argument leaves, fn's value, the frame its nodes were built in).
  """
  outer = b.frames[-1]
  frame = Frame({}, outer.stack, [])  # shared over positions: stacked only by repeats above
  b.frames.append(frame)
  leaves: list[Node] = []
  values = []
  try:
    for types, single in groups:
      mine = []
      for dt, sh in types:
        mine.append(b._intern("carry", (), (("frame", id(frame)), ("index", len(leaves))), dt,
                              sh, call.loc))
        leaves.append(mine[-1])
      values.append(mine[0] if single else tuple(mine))
    out = b.apply(fn, values, {}, Call(call.name, call.form, values, {},
                                       [call.arg_forms[0]] * len(values), {}))
  finally:
    b.frames.pop()
  return tuple(leaves), out, frame


def _outside(frame: Frame, results: tuple[Node, ...]) -> list[Node]:
  """The nodes built outside `frame` that the body reads, in the order they were made."""
  inside = {n.uid for n in frame.interned.values()}
  found, seen, todo = {}, set(), list(results)
  while todo:
    n = todo.pop()
    if n.uid in seen:
      continue
    seen.add(n.uid)
    if n.uid not in inside:
      found[n.uid] = n
      continue
    todo.extend(i for i in n.inputs if isinstance(i, Node))
  return [found[u] for u in sorted(found)]


def _drop_taps(b: Builder, frame: Frame) -> None:
  """Taps inside a scan's function record nothing: their values live only inside its loop."""
  inside = {n.uid for n in frame.interned.values()}
  for name in list(b.taps):
    b.taps[name] = [n for n in b.taps[name] if n.uid not in inside]
    if not b.taps[name]:
      del b.taps[name]


def _result(call: Call, out: Any, what: str, fix: str) -> tuple[tuple[Node, ...], bool]:
  if is_tensor(out):
    return (out,), True
  if isinstance(out, tuple) and out and all(is_tensor(x) for x in out):
    return out, False
  raise SxError("E-TYPE-001", f"{call.name}: F's {what} must be a tensor or a vector of tensors;"
                f" it is {describe(out)}", location=call.arg_forms[0].loc, fix=fix)


def _node(b: Builder, call: Call, operands: tuple[Node, ...], carries: int, leaves, results,
          frame: Frame, axis: int, reverse: bool, types: Types) -> Node:
  outside = _outside(frame, results)
  _drop_taps(b, frame)
  params = tuple(dict.fromkeys(p for p in frame.params))
  body = Fn(leaves, tuple(results), params)
  attrs = (("axis", axis), ("body", body), ("carries", carries), ("operands", len(operands)),
           ("reverse", reverse), ("types", types))
  return b._intern(call.name, tuple(operands) + tuple(outside), attrs, TUPLE, (), call.loc)


def _parts(b: Builder, node: Node, lo: int, hi: int, single: bool, loc) -> Any:
  types = node.attr("types")
  parts = tuple(b._intern("part", (node,), (("index", j),), types[j][0], types[j][1], loc)
                for j in range(lo, hi))
  return parts[0] if single else parts


def _slice(x: Node, axis: int) -> tuple[str, tuple[int, ...]]:
  return x.dtype, x.shape[:axis] + x.shape[axis + 1:]


def scan(b: Builder, call: Call) -> tuple:
  """`(scan F INIT XS :axis A :reverse B)` → [carry ys]."""
  usage = OPS["scan"].usage().split(" → ")[0]
  axis_v, reverse = _read(b, call, usage, 3)
  fn = _function(call, 2, usage)
  init, init_one = _leaves(call, 1, "INIT", usage)
  xs, xs_one = _leaves(call, 2, "XS", usage)
  axis = _axis(call, axis_v, xs, usage)
  carry_types = tuple((n.dtype, n.shape) for n in init)
  leaves, out, frame = _body(b, call, fn, [(carry_types, init_one),
                                           (tuple(_slice(x, axis) for x in xs), xs_one)])
  fix = "make F return [NEW-CARRY Y], NEW-CARRY of INIT's type and Y a tensor or a vector"
  if not (isinstance(out, tuple) and len(out) == 2):
    raise SxError("E-TYPE-001", f"scan: F must return [carry y]; it returned {describe(out)}",
                  location=call.arg_forms[0].loc, fix=fix)
  carry, carry_one = _result(call, out[0], "carry", fix)
  ys, ys_one = _result(call, out[1], "y", fix)
  if tuple((n.dtype, n.shape) for n in carry) != carry_types or carry_one != init_one:
    show = lambda ns: " ".join(n.type_str for n in ns)  # noqa: E731
    raise SxError("E-SHAPE-001", f"scan: F must return its carry with INIT's type "
                  f"{show(init)}; it returned {show(carry)}", location=call.arg_forms[0].loc,
                  fix="keep the carry's shape and dtype (cast or reshape inside F)")
  n = xs[0].shape[axis]
  for y in ys:
    if len(y.shape) < axis:
      raise SxError("E-SHAPE-001", f"scan: F's y {y.type_str} has no axis {axis} to stack "
                    "the positions at", location=call.arg_forms[0].loc,
                    fix="return a y of at least as many axes as the scan's axis")
  types = carry_types + tuple((y.dtype, y.shape[:axis] + (n,) + y.shape[axis:]) for y in ys)
  node = _node(b, call, tuple(init) + tuple(xs), len(init), leaves, tuple(carry) + tuple(ys),
               frame, axis, reverse, types)
  return (_parts(b, node, 0, len(init), init_one, call.loc),
          _parts(b, node, len(init), len(types), ys_one, call.loc))


def associative_scan(b: Builder, call: Call) -> Any:
  """`(associative-scan F XS :axis A :reverse B)` → the running combination, XS's type."""
  usage = OPS["associative-scan"].usage()
  axis_v, reverse = _read(b, call, usage, 2)
  fn = _function(call, 2, usage)
  xs, xs_one = _leaves(call, 1, "XS", usage)
  axis = _axis(call, axis_v, xs, usage)
  element = tuple(_slice(x, axis) for x in xs)
  leaves, out, frame = _body(b, call, fn, [(element, xs_one), (element, xs_one)])
  fix = "make F combine two elements of XS into one of the same type"
  got, one = _result(call, out, "result", fix)
  if tuple((n.dtype, n.shape) for n in got) != element or one != xs_one:
    show = lambda ts: " ".join(type_str(d, s) for d, s in ts)  # noqa: E731
    raise SxError("E-SHAPE-001", f"associative-scan: F must return one element of type "
                  f"{show(element)}; it returned {' '.join(n.type_str for n in got)}",
                  location=call.arg_forms[0].loc, fix=fix)
  drawn = [n for n in frame.interned.values() if n.op in OPS and (OPS[n.op].random
                                                                  or n.op == "dropout")]
  if drawn:
    raise SxError("E-FORM-001", f"associative-scan: F draws random values ({drawn[0].op}), "
                  "so it is not associative", location=drawn[0].loc or call.loc,
                  fix="draw outside F and combine the drawn values")
  types = tuple((x.dtype, x.shape) for x in xs)
  node = _node(b, call, xs, 0, leaves, got, frame, axis, reverse, types)
  return _parts(b, node, 0, len(xs), xs_one, call.loc)


FRONT = {"scan": scan, "associative-scan": associative_scan}

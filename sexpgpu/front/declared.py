"""Calls of ops read from their declarations (`ir.opdef`): nothing here lists an op's keywords.

A declared op is written `(op TENSORS... POSITIONAL-ATTRS... :attr value ...)`;
each attribute's value is checked against its declared type here, at the
call's `.sx` place, before the op's reference rule sees it.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder, Call, describe, is_number, is_tensor
from sexpgpu.front.scans import FRONT
from sexpgpu.front.values import Builtin
from sexpgpu.ir.opdef import ATTR_TYPES, DTYPES, OPS, REQUIRED, Attr, OpDef
from sexpgpu.reader import Symbol

# The largest size or count a static attribute may hold: past it nothing can be built.
MAX_STATIC = 2 ** 31 - 1


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: Any) -> bool:
  return isinstance(v, tuple) and all(_is_int(d) for d in v)


def _pairs(v: Any) -> bool:
  return isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 and _ints(p)
                                      for p in v)


# Ops whose tensors may be static numbers, broadcast as `+` broadcasts them: (mod x 2).
SCALARS = ("mod", "logical-and", "logical-or")


def _attr_value(op: OpDef, a: Attr, v: Any, rank: int | None) -> Any:
  """The attribute's value as the IR keeps it, or None when `v` is not of its type."""
  t = a.type
  if v is None:
    return None if a.default is None or t == "axes" else _BAD
  if t == "int":
    return v if _is_int(v) else _BAD
  if t == "float":
    return float(v) if is_number(v) and math.isfinite(v) else _BAD
  if t == "bool":
    return v if isinstance(v, bool) else _BAD
  if t in ("str", "spec"):
    return v if isinstance(v, str) else _BAD
  if t == "dtype":
    return str(v) if isinstance(v, Symbol) and str(v) in DTYPES else _BAD
  if t == "axis":
    return _axis(v, rank) if _is_int(v) else _BAD
  if t == "axes":
    vs = (v,) if _is_int(v) else v
    if not _ints(vs):
      return _BAD
    out = tuple(sorted({_axis(x, rank) for x in vs}))
    return _BAD if _BAD in out else out
  if t == "shape":
    return v if _ints(v) and all(0 <= d <= MAX_STATIC for d in v) else _BAD
  if t == "ints":
    return v if (_is_int(v) or _ints(v)) else _BAD
  if t == "padding":
    return v if isinstance(v, str) or _pairs(v) else _BAD
  if t == "pairs":
    return v if _pairs(v) else _BAD
  raise AssertionError(f"no reader for attribute type {t}")


_BAD = object()


def _axis(v: int, rank: int | None):
  if rank is None:
    return v
  if not -rank <= v < max(rank, 1):
    return _BAD
  return v % rank if rank else 0


def read_call(b: Builder, call: Call, op: OpDef) -> tuple[list, dict]:
  """The tensors and attributes of a call of `op`, checked against its declaration.

  Raises:
    SxError: E-FORM-001 for a wrong count of arguments or a missing attribute,
      E-FORM-002 for an unknown keyword, E-TYPE-001 for a value of the wrong type,
      E-SHAPE-001 for an axis out of range; each at the `.sx` place it came from.
  """
  usage = op.usage()
  tensors_in = [i for i in op.inputs if not i.startswith(":")]
  if any(i.endswith(("*", "?")) for i in tensors_in):
    raise AssertionError(f"{op.name}: variadic or optional tensors need a front end of their own")
  positional = [a for a in op.attrs if a.positional and not a.internal]
  lo = len(tensors_in) + sum(1 for a in positional if a.default is REQUIRED)
  hi = len(tensors_in) + len(positional)
  n = len(call.args)
  if not lo <= n <= hi:
    raise SxError("E-FORM-001", f"{op.name} takes {lo if lo == hi else f'{lo} to {hi}'} "
                  f"argument{'s' if hi != 1 else ''}, given {n}", location=call.loc,
                  fix=f"write {usage}")
  for k in call.kw:
    if k not in op.keywords:
      raise SxError("E-FORM-002", f"{op.name} has no keyword :{k}",
                    location=call.kw_locs.get(k) or call.kw_forms[k].loc,
                    fix="known keywords: " + (" ".join(":" + a for a in op.keywords) or "none")
                    + f"; write {usage}")
  tensors = list(call.args[:len(tensors_in)])
  if tensors_in and not any(is_tensor(t) for t in tensors):
    i = 0
    raise SxError("E-TYPE-001", f"{op.name} needs a tensor; found {describe(tensors[i])}",
                  location=call.arg_forms[i].loc, fix=f"pass a tensor: {usage}")
  for i, t in enumerate(tensors):
    if not is_tensor(t) and (op.name not in SCALARS or not (is_number(t) or isinstance(t, bool))):
      raise SxError("E-TYPE-001", f"{op.name}: `{tensors_in[i]}` is a tensor; found "
                    f"{describe(t)}", location=call.arg_forms[i].loc, fix=f"write {usage}")
  rank = len(tensors[0].shape) if tensors and is_tensor(tensors[0]) else None
  given = {a.name: (call.args[len(tensors_in) + j], call.arg_forms[len(tensors_in) + j])
           for j, a in enumerate(positional) if len(tensors_in) + j < n}
  for k, v in call.kw.items():
    if not any(i == ":" + k for i in op.inputs):
      given[k] = (v, call.kw_forms[k])
  attrs = {}
  for a in op.attrs:
    if a.internal:
      continue
    if a.name not in given:
      if a.default is REQUIRED:
        raise SxError("E-FORM-001", f"{op.name} needs :{a.name} ({a.doc})", location=call.loc,
                      fix=f"write {usage}")
      attrs[a.name] = a.default if a.type != "axis" else _axis(a.default, rank)
      continue
    v, form = given[a.name]
    value = _attr_value(op, a, v, rank)
    if value is _BAD:
      if a.type in ("axis", "axes") and (_is_int(v) or _ints(v)):
        raise SxError("E-SHAPE-001", f"{op.name}: axis {v} is out of range for rank {rank}",
                      location=form.loc, fix=f"use an axis in {-rank}..{rank - 1}")
      raise SxError("E-TYPE-001", f"{op.name}: :{a.name} is {ATTR_TYPES[a.type]}; found "
                    f"{describe(v)}" + (f" {v}" if isinstance(v, (tuple, int, float)) else ""),
                    location=form.loc, fix=f"write {usage}")
    attrs[a.name] = value
  for i in op.inputs:
    if i.startswith(":") and i[1:] in call.kw:
      v = call.kw[i[1:]]
      if not is_tensor(v):
        raise SxError("E-TYPE-001", f"{op.name}: :{i[1:]} is a tensor; found {describe(v)}",
                      location=call.kw_forms[i[1:]].loc, fix=f"write {usage}")
      tensors.append(v)
  if op.random:
    b.sites += 1
    attrs["site"] = b.sites
  return tensors, attrs


def _softplus(x: float) -> float:
  return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


# Ops that fold when every operand is a static number, as `+` and `exp` do: (ceil (/ n 3)).
STATIC = {"floor": math.floor, "ceil": math.ceil, "round": round, "mod": operator.mod,
          "sign": lambda x: (x > 0) - (x < 0), "erf": math.erf, "log1p": math.log1p,
          "expm1": math.expm1, "softplus": _softplus,
          "clip": None}  # clip folds with its keywords, below


def _fold(op: OpDef, call: Call):
  """The static value of a call whose operands are all static numbers, else None."""
  args = call.args
  if op.name not in STATIC or not args or call.kw and op.name != "clip" or not all(
      is_number(v) for v in args):
    return None
  try:
    if op.name == "clip":
      lo, hi = call.kw.get("min"), call.kw.get("max")
      if len(args) != 1 or not all(v is None or is_number(v) for v in (lo, hi)):
        return None
      x = args[0]
      return min(max(x, lo) if lo is not None else x, hi) if hi is not None else (
          max(x, lo) if lo is not None else x)
    if len(args) != len([i for i in op.inputs if not i.startswith(":")]):
      return None
    return STATIC[op.name](*args)
  except (ValueError, OverflowError, ZeroDivisionError) as e:
    raise SxError("E-TYPE-001", f"{op.name} of {' '.join(map(str, args))}: {e}",
                  location=call.loc, fix=f"give {op.name} values it is defined for (check the knobs they come from)") from None


def _declared(op: OpDef):
  def fn(b: Builder, call: Call):
    folded = _fold(op, call)
    if folded is not None:
      return folded
    tensors, attrs = read_call(b, call, op)
    return b.op(op.name, tensors, attrs, call, operand_names=[str(f) for f in call.arg_forms],
                fix=f"write {op.usage()}")
  return fn


def _top_k(b: Builder, call: Call):
  tensors, attrs = read_call(b, call, OPS["top-k"])
  names = [str(f) for f in call.arg_forms]
  fix = f"write {OPS['top-k'].usage()}"
  return (b.op("top-k", tensors, attrs, call, operand_names=names, fix=fix),
          b.op("top-k-indices", tensors, attrs, call, operand_names=names, fix=fix))


# Ops the language writes through another name or form, and how.
MADE_BY = {
    "top-k-indices": "the second value of (top-k X :k K)",
    "tap": "the (tap NAME X) special form",
    "chunked-cross-entropy": "the rewrite of (cross-entropy (matmul H W) T) in the step",
}


def builtins_for(names: list[str]) -> dict[str, Builtin]:
  """Builtins for the named ops, each read from its declaration (ops written in Python)."""
  return {n: Builtin(n, _declared(OPS[n])) for n in names}


def builtins(existing: dict[str, Builtin]) -> dict[str, Builtin]:
  """Builtins for every declared op that has no front end of its own in `existing`."""
  out = {"top-k": Builtin("top-k", _top_k)}
  out.update({name: Builtin(name, fn) for name, fn in FRONT.items()})
  for name, op in OPS.items():
    if name not in existing and name not in out and name not in MADE_BY and op.source is None:
      out[name] = Builtin(name, _declared(op))
  return out

"""The language's builtin functions: primitives that fold statically or build nodes."""

from __future__ import annotations

import math
import operator
import warnings
from typing import Any, Callable

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder, Call, describe, is_number, is_tensor, static_shape
from sexpgpu.front import optimizers
from sexpgpu.front.options import check_keywords, check_options
from sexpgpu.ir.graph import Init
from sexpgpu.front import declared
from sexpgpu.ir.ops import DTYPES, OPS
from sexpgpu.front.values import Builtin, Spec
from sexpgpu.reader import Symbol

BUILTINS: dict[str, Builtin] = {}


def builtin(name: str, usage: str = "", doc: str = ""):
  """Registers the decorated `(builder, call) → value` as builtin `name`; one that is no op
  of the IR declares how it is written and its doc line, for the reference."""
  def deco(fn: Callable[[Builder, Call], Any]):
    BUILTINS[name] = Builtin(name, fn, usage, doc)
    return fn
  return deco


def _arity(call: Call, lo: int, hi: int, usage: str) -> None:
  n = len(call.args)
  if not lo <= n <= hi:
    raise SxError("E-FORM-001", f"{call.name} takes {lo if lo == hi else f'{lo} to {hi}'} "
                  f"argument{'s' if hi != 1 else ''}, given {n}", location=call.loc, fix=usage)


def _kw(call: Call, allowed: tuple[str, ...]) -> dict:
  for k in call.kw:
    if k not in allowed:
      raise SxError("E-FORM-002", f"{call.name} has no keyword :{k}",
                    location=call.kw_locs.get(k) or call.kw_forms[k].loc,
                    fix="known keywords: " + (" ".join(":" + a for a in allowed) or "none"))
  return call.kw


def _tensor(b: Builder, call: Call, i: int, what: str = "a tensor"):
  v = call.args[i]
  if not is_tensor(v):
    raise SxError("E-TYPE-001", f"{call.name} needs {what} here; found {describe(v)}",
                  location=call.arg_forms[i].loc, fix="pass a tensor")
  return v


def _static_int(call: Call, i: int, what: str) -> int:
  v = call.args[i]
  if not isinstance(v, int) or isinstance(v, bool):
    raise SxError("E-TYPE-001", f"{call.name}: {what} must be a static integer; found "
                  f"{describe(v)}", location=call.arg_forms[i].loc, fix="use an integer")
  return v


def _axis(v: int, rank: int, call: Call, i: int) -> int:
  if not -rank <= v < max(rank, 1):
    raise SxError("E-SHAPE-001", f"{call.name}: axis {v} is out of range for rank {rank}",
                  location=call.arg_forms[i].loc, fix=f"use an axis in {-rank}..{rank - 1}")
  return v % rank if rank else 0


def _static_number(v: Any) -> bool:
  return is_number(v) or isinstance(v, bool)


# --- arithmetic: static folding, else nodes ----------------------------------
def _static_div(a, b):
  if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
    return a // b
  return a / b


_FOLD2 = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": _static_div,
          "pow": operator.pow, "max": max, "min": min, "<": operator.lt, "<=": operator.le,
          ">": operator.gt, ">=": operator.ge, "=": operator.eq, "!=": operator.ne}


def _binary_node(b: Builder, call: Call, op: str, x, y, names) -> Any:
  if _static_number(x) and _static_number(y):
    try:
      return _FOLD2[op](x, y)
    except ZeroDivisionError:
      raise SxError("E-TYPE-001", f"{op}: division by zero", location=call.loc,
                    fix=f"give {op} a divisor other than 0 (check the knobs it is computed from)") from None
  for v, nm in ((x, names[0]), (y, names[1])):
    if not is_tensor(v) and not _static_number(v):
      raise SxError("E-TYPE-001", f"{op} works on numbers and tensors; `{nm}` is {describe(v)}",
                    location=call.loc, fix="pass numbers or tensors")
  return b.op(op, [x, y], {}, call, operand_names=names)


def _nary(op: str):
  def fn(b: Builder, call: Call):
    _kw(call, ())
    if not call.args:
      raise SxError("E-FORM-001", f"{op} needs arguments", location=call.loc, fix=f"({op} A B)")
    if op == "-" and len(call.args) == 1:
      x = call.args[0]
      return -x if _static_number(x) else b.op("neg", [x], {}, call)
    names = [str(f) for f in call.arg_forms]
    acc = call.args[0]
    if op in ("/", "pow") or op in ("<", "<=", ">", ">=", "=", "!=", "max", "min"):
      if len(call.args) != 2 and op not in ("max", "min"):
        raise SxError("E-FORM-001", f"{op} takes 2 arguments, given {len(call.args)}",
                      location=call.loc, fix=f"({op} A B)")
    for i, y in enumerate(call.args[1:], start=1):
      acc = _binary_node(b, call, op, acc, y, [names[0] if i == 1 else "…", names[i]])
    return acc
  return fn


for _op in ("+", "-", "*", "/", "pow", "max", "min", "<", "<=", ">", ">=", "=", "!="):
  BUILTINS[_op] = Builtin(_op, _nary(_op))

# The static folds of the older unary ops, in the one table every declared op folds through
# (front/declared.py's STATIC): (exp 1.0) is a number. Every unary op is read from its
# declaration there; nothing here lists the pointwise ops.
declared.STATIC.update({
    "neg": operator.neg, "abs": abs, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x), "square": lambda x: x * x, "tanh": math.tanh,
    "cos": math.cos, "sin": math.sin, "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
    "relu": lambda x: max(x, 0)})


def _rsqrt(b: Builder, call: Call):
  """`(rsqrt X)` the op; `(rsqrt :peak P :warmup W)`, the old spelling of the schedule
  warmup-rsqrt, is still read as it, with a FutureWarning that names the new spelling."""
  if not call.args and "peak" in call.kw:
    spec = _schedule("rsqrt", SCHEDULES["rsqrt"])(b, call)  # its errors name `rsqrt` as written
    warnings.warn(f"{call.loc}: the schedule (rsqrt :peak ...) is now written (warmup-rsqrt "
                  ":peak ...); rsqrt alone is the op 1/√x", FutureWarning, stacklevel=2)
    return Spec(spec.kind, "warmup-rsqrt", spec.args, spec.loc)
  return declared.builtins_for(["rsqrt"])["rsqrt"].fn(b, call)


BUILTINS["rsqrt"] = Builtin("rsqrt", _rsqrt)


@builtin("where")
def _where(b, call):
  _arity(call, 3, 3, "(where C A B)")
  _tensor(b, call, 0, "a boolean tensor")
  return b.op("where", list(call.args), {}, call)


@builtin("cast")
def _cast(b, call):
  _arity(call, 2, 2, "(cast X f32)")
  x = _tensor(b, call, 0)
  dt = str(call.args[1])
  if dt not in DTYPES:
    raise SxError("E-TYPE-001", f"cast: `{dt}` is not a dtype", location=call.arg_forms[1].loc,
                  fix="dtypes: " + " ".join(DTYPES))
  return b.op("cast", [x], {"dtype": dt}, call)


# --- reductions --------------------------------------------------------------
def _axes(call: Call, x, i: int):
  if len(call.args) <= i or call.args[i] is None:
    return None
  v = call.args[i]
  vs = v if isinstance(v, tuple) else (v,)
  out = []
  for a in vs:
    if not isinstance(a, int) or isinstance(a, bool):
      raise SxError("E-TYPE-001", f"{call.name}: axes are static integers; found {describe(a)}",
                    location=call.arg_forms[i].loc, fix="(sum x -1) or (sum x [0 1])")
    out.append(_axis(a, len(x.shape), call, i))
  return tuple(sorted(set(out)))


def _reduction(op: str):
  def fn(b, call):
    kw = _kw(call, OPS[op].keywords)
    _arity(call, 1, 2, OPS[op].usage())
    x = _tensor(b, call, 0)
    axes = _axes(call, x, 1)
    if op == "argmax":
      if axes is not None and len(axes) != 1:
        raise SxError("E-SHAPE-001", "argmax takes one axis", location=call.loc,
                      fix="(argmax x -1)")
      return b.op("argmax", [x], {"axis": axes[0] if axes else None,
                                  "keep": bool(kw.get("keep", False))}, call)
    return b.op(op, [x], {"axes": axes, "keep": bool(kw.get("keep", False))}, call)
  return fn


for _op in ("sum", "mean", "max-of", "min-of", "logsumexp", "argmax"):
  BUILTINS[_op] = Builtin(_op, _reduction(_op))


# --- shapes ------------------------------------------------------------------
@builtin("dim", "(dim X AXIS)", "a static size")
def _dim(b, call):
  _arity(call, 2, 2, "(dim X AXIS)")
  x = _tensor(b, call, 0)
  return x.shape[_axis(_static_int(call, 1, "the axis"), len(x.shape), call, 1)]


@builtin("shape", "(shape X)", "a static vector")
def _shape(b, call):
  _arity(call, 1, 1, "(shape X)")
  return tuple(_tensor(b, call, 0).shape)


@builtin("rank", "(rank X)", "the static number of axes")
def _rank(b, call):
  _arity(call, 1, 1, "(rank X)")
  return len(_tensor(b, call, 0).shape)


@builtin("reshape")
def _reshape(b, call):
  _arity(call, 2, 2, "(reshape X [d0 d1 ...])")
  x = _tensor(b, call, 0)
  shape = static_shape(call.args[1], call.arg_forms[1])
  return b.op("reshape", [x], {"shape": shape}, call)


@builtin("transpose")
def _transpose(b, call):
  _arity(call, 1, 2, "(transpose X [1 0])")
  x = _tensor(b, call, 0)
  perm = (static_shape(call.args[1], call.arg_forms[1]) if len(call.args) == 2
          else tuple(reversed(range(len(x.shape)))))
  if sorted(perm) != list(range(len(x.shape))):
    raise b.shape_error("transpose", "shape", f"{list(perm)} is not a permutation of the "
                        f"{len(x.shape)} axes", [x], [str(call.arg_forms[0])], call.loc,
                        fix=f"list each axis 0..{len(x.shape) - 1} once")
  return b.op("transpose", [x], {"perm": perm}, call)


@builtin("concat")
def _concat(b, call):
  _arity(call, 1, 2, "(concat [A B] AXIS)")
  xs = call.args[0]
  if not isinstance(xs, tuple) or not xs or not all(is_tensor(v) for v in xs):
    raise SxError("E-TYPE-001", "concat takes a vector of tensors", location=call.loc,
                  fix="(concat [a b] -1)")
  axis = _static_int(call, 1, "the axis") if len(call.args) == 2 else 0
  axis = _axis(axis, len(xs[0].shape), call, min(1, len(call.args) - 1))
  return b.op("concat", list(xs), {"axis": axis}, call,
              operand_names=[f"#{i}" for i in range(len(xs))])


def _slice_node(b, call, x, axis, start, end):
  return b.op("slice", [x], {"axis": axis, "start": start, "end": end}, call)


@builtin("slice")
def _slice(b, call):
  _arity(call, 3, 4, "(slice X AXIS START END)")
  x = _tensor(b, call, 0)
  axis = _axis(_static_int(call, 1, "the axis"), len(x.shape), call, 1)
  n = x.shape[axis]
  start = _static_int(call, 2, "the start")
  end = call.args[3] if len(call.args) == 4 else None
  end = n if end is None else end
  if not isinstance(end, int) or isinstance(end, bool):
    raise SxError("E-TYPE-001", "slice: the end must be a static integer or nil",
                  location=call.arg_forms[3].loc, fix="(slice x 1 0 nil)")
  start, end = (start + n if start < 0 else start), (end + n if end < 0 else end)
  if not 0 <= start <= end <= n:
    raise b.shape_error("slice", "shape", f"[{start}:{end}] is outside axis {axis} of size {n}",
                        [x], [str(call.arg_forms[0])], call.loc, fix=f"slice within 0..{n}")
  return _slice_node(b, call, x, axis, start, end)


@builtin("split", "(split X N AXIS)", "N equal parts along an axis, as a vector")
def _split(b, call):
  _arity(call, 2, 3, "(split X N AXIS)")
  x = _tensor(b, call, 0)
  parts = _static_int(call, 1, "the number of parts")
  axis = _axis(_static_int(call, 2, "the axis") if len(call.args) == 3 else -1,
               len(x.shape), call, 2 if len(call.args) == 3 else 0)
  n = x.shape[axis]
  if parts < 1 or n % parts:
    raise b.shape_error("split", "shape", f"axis {axis} of size {n} does not split into "
                        f"{parts} equal parts", [x], [str(call.arg_forms[0])], call.loc,
                        fix="choose a count that divides the axis")
  step = n // parts
  return tuple(_slice_node(b, call, x, axis, i * step, (i + 1) * step) for i in range(parts))


@builtin("take")
def _take(b, call):
  _arity(call, 2, 2, "(take TABLE INDICES)")
  return b.op("take", [_tensor(b, call, 0), _tensor(b, call, 1, "integer indices")], {}, call)


@builtin("one-hot")
def _one_hot(b, call):
  _arity(call, 2, 2, "(one-hot X N)")
  return b.op("one-hot", [_tensor(b, call, 0)], {"n": _static_int(call, 1, "N")}, call)


@builtin("expand")
def _expand(b, call):
  _arity(call, 2, 2, "(expand X AXIS)")
  x = _tensor(b, call, 0)
  a = _static_int(call, 1, "the axis")
  return b.op("expand", [x], {"axis": a % (len(x.shape) + 1)}, call)


@builtin("squeeze")
def _squeeze(b, call):
  _arity(call, 2, 2, "(squeeze X AXIS)")
  x = _tensor(b, call, 0)
  return b.op("squeeze", [x], {"axis": _axis(_static_int(call, 1, "the axis"),
                                             len(x.shape), call, 1)}, call)


@builtin("broadcast")
def _broadcast(b, call):
  _arity(call, 2, 2, "(broadcast X SHAPE)")
  x = _tensor(b, call, 0)
  return b.op("broadcast", [x], {"shape": static_shape(call.args[1], call.arg_forms[1])}, call)


# --- products ----------------------------------------------------------------
@builtin("matmul")
def _matmul(b, call):
  _arity(call, 2, 2, "(matmul A B)")
  x, w = _tensor(b, call, 0), _tensor(b, call, 1)
  if x.shape and w.shape and len(w.shape) >= 1:
    k_a = x.shape[-1]
    k_b = w.shape[0] if len(w.shape) <= 2 else w.shape[-2]
    if k_a != k_b:
      names = [str(f) for f in call.arg_forms]
      raise b.shape_error("matmul", "shape", f"inner dimensions differ ({k_a} vs {k_b})",
                          [x, w], names, call.loc,
                          fix=f"the last axis of {names[0]} must equal the first of {names[1]}")
  return b.op("matmul", [x, w], {}, call)


@builtin("einsum")
def _einsum(b, call):
  if len(call.args) < 2 or not isinstance(call.args[0], str):
    raise SxError("E-FORM-001", "einsum takes a spec string and tensors", location=call.loc,
                  fix='(einsum "bqd,bkd->bqk" q k)')
  xs = [_tensor(b, call, i) for i in range(1, len(call.args))]
  return b.op("einsum", xs, {"spec": call.args[0]}, call,
              operand_names=[str(f) for f in call.arg_forms[1:]])


# --- neural ------------------------------------------------------------------
def _along_axis(op: str):
  def fn(b, call):
    _arity(call, 1, 2, f"({op} X AXIS)")
    x = _tensor(b, call, 0)
    axis = _static_int(call, 1, "the axis") if len(call.args) == 2 else -1
    return b.op(op, [x], {"axis": _axis(axis, len(x.shape), call, len(call.args) - 1)}, call)
  return fn


BUILTINS["softmax"] = Builtin("softmax", _along_axis("softmax"))
BUILTINS["log-softmax"] = Builtin("log-softmax", _along_axis("log-softmax"))


@builtin("causal-mask")
def _causal_mask(b, call):
  _arity(call, 1, 1, "(causal-mask SCORES)")
  x = _tensor(b, call, 0)
  if len(x.shape) < 2:
    raise b.shape_error("causal-mask", "shape", "needs at least 2 axes (queries, keys)", [x],
                        [str(call.arg_forms[0])], call.loc, fix="mask a [.., q, k] score tensor")
  return b.op("causal-mask", [x], {}, call)


@builtin("nil?", "(nil? V)", "static: whether V is nil")
def _is_nil(b, call):
  _arity(call, 1, 1, "(nil? X)")
  return call.args[0] is None


@builtin("segment-mask")
def _segment_mask(b, call):
  _arity(call, 2, 2, "(segment-mask SCORES SEGMENTS)")
  x, seg = _tensor(b, call, 0), _tensor(b, call, 1, "integer segments")
  if (seg.dtype not in ("i32", "u32") or len(seg.shape) != 2 or len(x.shape) < 3
      or x.shape[0] != seg.shape[0] or x.shape[-2:] != (seg.shape[1], seg.shape[1])):
    raise b.shape_error("segment-mask", "shape" if seg.dtype in ("i32", "u32") else "type",
                        "scores [b, .., t, t] and integer segments [b, t]", [x, seg],
                        [str(f) for f in call.arg_forms], call.loc,
                        fix="pass the batch's :segments for self-attention scores")
  return b.op("segment-mask", [x, seg], {}, call)


@builtin("dropout")
def _dropout(b, call):
  _arity(call, 2, 2, "(dropout X RATE)")
  x = _tensor(b, call, 0)
  rate = call.args[1]
  if not _static_number(rate) or not 0 <= rate < 1:
    raise SxError("E-TYPE-001", "dropout's rate is a static number in [0, 1)",
                  location=call.arg_forms[1].loc, fix="(dropout x 0.1)")
  b.sites += 1
  return b.op("dropout", [x], {"rate": float(rate), "site": b.sites}, call)


@builtin("cross-entropy")
def _cross_entropy(b, call):
  kw = _kw(call, OPS["cross-entropy"].keywords)
  _arity(call, 2, 2, "(cross-entropy LOGITS TARGETS :mask M)")
  logits, targets = _tensor(b, call, 0), _tensor(b, call, 1, "integer targets")
  names = [str(f) for f in call.arg_forms]
  if targets.dtype not in ("i32", "u32") or logits.shape[:-1] != targets.shape:
    raise b.shape_error("cross-entropy", "shape" if targets.dtype in ("i32", "u32") else "type",
                        "targets must be integers shaped as the logits without their last axis",
                        [logits, targets], names, call.loc,
                        fix="logits [.., vocab] and integer targets [..]")
  ins = [logits, targets]
  if "mask" in kw:
    m = kw["mask"]
    if not is_tensor(m) or m.shape != targets.shape:
      raise b.shape_error("cross-entropy", "shape", ":mask must be shaped as the targets",
                          [logits, targets] + ([m] if is_tensor(m) else []), names + ["mask"],
                          call.loc, fix="a boolean mask with the targets' shape")
    ins.append(m)
  return b.op("cross-entropy", ins, {}, call, operand_names=names + ["mask"])


@builtin("sdpa")
def _sdpa(b, call):
  kw = _kw(call, OPS["sdpa"].keywords)
  _arity(call, 3, 3, "(sdpa Q K V :causal true :scale S)")
  q, k, v = (_tensor(b, call, i) for i in range(3))
  scale = kw.get("scale", 1.0 / math.sqrt(q.shape[-1]))
  return b.op("sdpa", [q, k, v], {"causal": bool(kw.get("causal", False)),
                                  "scale": float(scale)}, call)


# --- constants ---------------------------------------------------------------
def _filled(value):
  def fn(b, call):
    kw = _kw(call, OPS["full"].keywords)
    _arity(call, 1, 1, f"({call.name} SHAPE :dtype f32)")
    shape = static_shape(call.args[0], call.arg_forms[0])
    return b.op("full", [], {"shape": shape, "value": value, "dtype": str(kw.get("dtype", "f32"))},
                call)
  return fn


BUILTINS["zeros"] = Builtin("zeros", _filled(0.0), "(zeros SHAPE :dtype D)",
                            "a tensor of zeros; as :init, zeros")
BUILTINS["ones"] = Builtin("ones", _filled(1.0), "(ones SHAPE :dtype D)",
                           "a tensor of ones; as :init, ones")


@builtin("full")
def _full(b, call):
  kw = _kw(call, OPS["full"].keywords)
  _arity(call, 2, 2, "(full SHAPE V)")
  shape = static_shape(call.args[0], call.arg_forms[0])
  v = call.args[1]
  if not _static_number(v):
    raise SxError("E-TYPE-001", "full's value is a static number", location=call.arg_forms[1].loc,
                  fix="(full [2 3] 0.5)")
  return b.op("full", [], {"shape": shape, "value": float(v), "dtype": str(kw.get("dtype", "f32"))},
              call)


@builtin("iota")
def _iota(b, call):
  _arity(call, 1, 1, "(iota N)")
  return b.op("iota", [], {"n": _static_int(call, 0, "N")}, call)


# --- initializers, optimizers, schedules --------------------------------------
def _init(kind: str):
  def fn(b, call):
    _arity(call, 1, 1, f"({kind} VALUE)")
    v = call.args[0]
    if not _static_number(v):
      raise SxError("E-TYPE-001", f"{kind} takes a static number", location=call.loc,
                    fix=f"({kind} 0.02)")
    if kind == "constant" and call.kw:
      _kw(call, ())
    return Init(kind, float(v))
  return fn


for _k, _usage, _doc in (
    ("normal", "(normal STD)", "initializer"),
    ("truncated-normal", "(truncated-normal STD)", "initializer"),
    ("uniform", "(uniform LIMIT)", "initializer"),
    ("fan-in", "(fan-in SCALE)", "initializer: normal, std SCALE/sqrt(fan-in)"),
    ("constant", "(constant V)", "initializer or learning rate")):
  BUILTINS[_k] = Builtin(_k, _init(_k), _usage, _doc)

# each optimizer's and schedule's keywords, read from their one declaration
OPTIMIZERS = {name: o.keywords for name, o in optimizers.OPTIMIZERS.items()}
SCHEDULES = {name: tuple(k for k, _ in s.keywords)
             for name, s in optimizers.SCHEDULES.items()}


def _optimizer(name: str, allowed: tuple[str, ...]):
  def fn(b, call):
    check_keywords(call, allowed)
    kw = _kw(call, allowed)
    if call.args:
      raise SxError("E-FORM-001", f"{name} takes keyword arguments only", location=call.loc,
                    fix=f"({name} :lr 1e-3)")
    if "lr" not in kw:
      raise SxError("E-FORM-001", f"{name} needs :lr", location=call.loc, fix=f"({name} :lr 1e-3)")
    kw = dict(kw)
    check_options(call, kw)
    return Spec("optimizer", name, tuple(sorted(kw.items())), call.loc)
  return fn


def _schedule(name: str, allowed: tuple[str, ...]):
  def fn(b, call):
    check_keywords(call, allowed)
    kw = _kw(call, allowed)
    if call.args or "peak" not in kw:
      raise SxError("E-FORM-001", f"schedule {name} takes keyword arguments, :peak at least",
                    location=call.loc, fix=f"({name} :peak 1e-3 :warmup 100)")
    kw = dict(kw)
    check_options(call, kw)
    return Spec("schedule", name, tuple(sorted(kw.items())), call.loc)
  return fn


for _name, _allowed in OPTIMIZERS.items():
  BUILTINS[_name] = Builtin(_name, _optimizer(_name, _allowed), f"({_name} :lr LR ...)",
                            "optimizer: " + optimizers.OPTIMIZERS[_name].doc)
for _name, _allowed in SCHEDULES.items():
  if optimizers.SCHEDULES[_name].written:
    BUILTINS[_name] = Builtin(_name, _schedule(_name, _allowed), f"({_name} :peak P ...)",
                              "learning-rate schedule: " + optimizers.SCHEDULES[_name].doc)

# dtype names evaluate to themselves, for (cast x bf16) and :dtype
DTYPE_VALUES = {name: Symbol(name) for name in DTYPES}


# every declared op without a front end above is read from its declaration
BUILTINS.update(declared.builtins(BUILTINS))

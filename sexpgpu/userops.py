"""Ops a user writes in Python: `@sexpgpu.op("name", doc=...)` on a JAX function.

The function's positional parameters are its tensors; its keyword-only
parameters, annotated `int`, `float`, `bool` or `str`, are static attributes
the `.sx` call passes by keyword. The op joins every table an op of the
table's own has, through the same declaration: its shape comes from
`jax.eval_shape` of the function, its gradient from JAX, its lowering on every
platform is the function itself, its FLOPs come from XLA's cost analysis of it,
and every other table (the backward's cost and saved inputs, decoding, splits)
gives it its kind's rule (`kind="pointwise"`: decoding and tensor parallel pass
through it; the default, "opaque", passes neither). A kind some table has no
rule for is refused at the declaration, E-OP-003.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from typing import Any, Callable

from sexpgpu.errors import SxError
from sexpgpu.front import pyops
from sexpgpu.front.build import SPECIAL_FORMS
from sexpgpu.ir.opdef import KINDS, OPS, REQUIRED, TABLES, Attr, OpDef
from sexpgpu.ir.shapes import infer
# the tables a user op joins (split; FLOPs, the backward's cost and saved inputs; decode)
from sexpgpu.lower import layouts  # noqa: F401
from sexpgpu.lower.flops import FLOPS
from sexpgpu.models import decode_rules  # noqa: F401
from sexpgpu.reader import Atom, Symbol, read_text

_TYPES = {int: "int", float: "float", bool: "bool", str: "str",
          "int": "int", "float": "float", "bool": "bool", "str": "str"}


class OpDeclarationError(ValueError):
  """An `@sexpgpu.op` the table cannot take (the message says why)."""


def op(name: str, doc: str = "", pointwise: bool = False, kind: str | None = None) -> Callable:
  """Declares the decorated JAX function as op `name` of the `.sx` language.

  Args:
    name: the op's name in `.sx` (`my-mixer`).
    doc: one line for `check` and the reference.
    pointwise: the same as kind="pointwise".
    kind: what the op is (ir/opdef.py's KINDS); every table gives it that kind's rule.
      "pointwise" (each output element depends only on the same element of the inputs)
      lets decoding and tensor parallel pass through it; the default, "opaque", neither.

  Returns:
    A decorator that registers the function and returns it unchanged.

  Raises:
    OpDeclarationError: the name is not one `.sx` symbol (empty, a number, spaces, a
      special form), is an op of the table's own, the kind is unknown, or the signature
      has a parameter that is neither a tensor nor an annotated keyword.
    SxError: E-OP-003 when a table has no rule for the op's kind.
  """
  _check_name(name)
  kind = _kind(name, pointwise, kind)

  def deco(fn: Callable) -> Callable:
    source = inspect.getsourcefile(fn) or "<python>"
    old = OPS.get(name)
    if old is not None and old.source is None:
      raise OpDeclarationError(f"`{name}` is an op of sexpgpu's own table")
    # An op of the same name from another file (another experiment in this process, a
    # copy of the file) is replaced: the latest experiment compiled is the one lowered.
    inputs, attrs = _signature(name, fn)
    _check_rules(name, kind, fn)

    def rule(ctx, *xs, **kw):
      try:
        return fn(*xs, **{k.replace("-", "_"): v for k, v in kw.items()})
      except BaseException as e:  # noqa: BLE001 (sys.exit in an op is the user's error)
        if isinstance(e, Exception) or pyops.is_stop(e):
          raise
        raise pyops.as_error(e) from None

    for table in TABLES:  # a declaration replaces the last one's entries
      table.forget(name)
    OPS[name] = OpDef(name, rule, inputs, attrs, doc or (fn.__doc__ or name).strip().split("\n")[0],
                      source=source, kind=kind)
    infer.cache_clear()  # a redefinition (the same file read again) may change shapes
    FLOPS.register(functools.partial(cost_flops, name), name)  # every other table: its kind's
    return fn

  return deco


def _kind(name: str, pointwise: bool, kind: str | None) -> str:
  if kind is None:
    return "pointwise" if pointwise else "opaque"
  if kind not in KINDS:
    raise OpDeclarationError(f"{name}: no kind {kind!r}; the kinds: {', '.join(KINDS)}")
  if pointwise and kind != "pointwise":
    raise OpDeclarationError(f"{name}: pointwise=True and kind={kind!r} disagree; give one")
  return kind


def _check_rules(name: str, kind: str, fn: Callable) -> None:
  """Refuses a kind that some table (other than FLOPs, which XLA counts) has no rule for."""
  missing = [t for t in TABLES if t.complete and t is not FLOPS and t.default(kind) is None]
  if not missing:
    return
  fits = [k for k in KINDS if k not in ("constant", "random")  # a user op takes tensors
          and all(t.default(k) is not None for t in TABLES if t.complete and t is not FLOPS)]
  code = getattr(fn, "__code__", None)
  where = (f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code is not None
           else name)
  raise SxError("E-OP-003", f"op `{name}` is declared kind={kind!r}, which has no rule in "
                + ", ".join(f"the {t.what} table ({t.where})" for t in missing)
                + "; an op written in Python takes its kind's rules", where=where,
                fix=f"declare @sexpgpu.op({name!r}, kind=K) with K one of {', '.join(fits)} "
                "(opaque when it mixes positions), or add the op to sexpgpu's own table with "
                "a rule in each")


def _check_name(name: Any) -> None:
  """Refuses a name the `.sx` reader would not read back as that one symbol."""
  if not isinstance(name, str) or not name.strip():
    raise OpDeclarationError(f"the op's name is {name!r}; it must be a symbol of the .sx "
                             'language, such as "my-mixer"')
  try:
    forms = read_text(name, "<op name>")
  except Exception:  # noqa: BLE001 (any reader error: it is not a symbol)
    forms = []
  if not (len(forms) == 1 and isinstance(forms[0], Atom) and isinstance(forms[0].value, Symbol)
          and str(forms[0].value) == name):
    raise OpDeclarationError(f"the op's name {name!r} is not one .sx symbol (letters, digits "
                             "and -_+*/<>=!?.%, not a number or keyword)")
  if name in SPECIAL_FORMS:
    raise OpDeclarationError(f"`{name}` is a special form of the .sx language")


def _signature(name: str, fn: Callable) -> tuple[tuple[str, ...], tuple[Attr, ...]]:
  inputs, attrs = [], []
  for p in inspect.signature(fn).parameters.values():
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      if p.default is not p.empty:
        raise OpDeclarationError(f"{name}: tensor `{p.name}` has a default; tensors are "
                                 "positional and required, statics keyword-only (after *)")
      inputs.append(p.name)
    elif p.kind == p.KEYWORD_ONLY:
      t = _TYPES.get(p.annotation)
      if t is None:
        raise OpDeclarationError(f"{name}: keyword `{p.name}` needs an annotation int, float, "
                                 "bool or str")
      # `:dt-rank` in the language is `dt_rank` in Python
      attrs.append(Attr(p.name.replace("_", "-"), t,
                        REQUIRED if p.default is p.empty else p.default))
    else:
      raise OpDeclarationError(f"{name}: *{p.name} or **{p.name} cannot be declared; name "
                               "each tensor and each keyword")
  if not inputs:
    raise OpDeclarationError(f"{name}: takes no tensor")
  return tuple(inputs), tuple(attrs)


@functools.lru_cache(maxsize=1024)
def _flops_of(name: str, attrs: tuple, shapes: tuple) -> int:
  import jax
  from sexpgpu.ir.opdef import DTYPES
  fn = OPS[name].lower
  args = [jax.ShapeDtypeStruct(s, DTYPES[d]) for d, s in shapes]
  cost = jax.jit(lambda *xs: fn(None, *xs, **dict(attrs))).lower(*args).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = (cost or {}).get("flops", 0.0)
  return int(flops) if math.isfinite(flops) and flops > 0 else 0


def cost_flops(name: str, node: Any) -> int:
  """The FLOPs of a node of op `name` (written in Python), as XLA's cost analysis counts
  its function traced at the node's shapes (an op's FLOPs entry).

  Raises:
    SxError: E-OP-001 at the node's call when the function fails to trace.
  """
  shapes = tuple((i.dtype, tuple(i.shape)) if hasattr(i, "shape") else ("f32", ())
                 for i in node.inputs)
  try:
    return _flops_of(name, tuple(node.attrs), shapes)
  except Exception as e:  # noqa: BLE001 (the user's function, traced once more)
    if isinstance(e, SxError):
      raise
    raise pyops.op_error(name, OPS[name].source, e, getattr(node, "loc", None)) from None

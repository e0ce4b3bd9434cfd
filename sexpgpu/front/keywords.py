"""A top-level form's keywords read as its declaration (lang/forms.py) says: the keywords
it takes, an integer's or number's range and default, static values and loader names."""

from __future__ import annotations

import math
from typing import Any

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.front.build import Builder, describe, is_tensor
from sexpgpu.front.values import Env
from sexpgpu.lang.forms import FORMS
from sexpgpu.lang.program import split_keywords
from sexpgpu.reader import Atom, Form, List, Symbol
from sexpgpu.reader.forms import head_symbol


def keys(form: List, start: int = 2) -> dict[str, Form]:
  """The `:key value` forms of a top-level form from item `start` on.

  Raises:
    SxError: E-FORM-002 at a keyword its declaration does not take, E-FORM-001 at one
      without a value or given twice.
  """
  fdef = FORMS[head_symbol(form)]
  return split_keywords(form, start, fdef.keys, fdef.name)[1]


def need(form: List, kws: dict[str, Form]) -> None:
  """Raises E-FORM-001 at a top-level form `(FORM NAME ...)` without a keyword its
  declaration requires, the declaration's example written right as the fix."""
  fdef, name = FORMS[head_symbol(form)], str(form.items[1].value)
  for req in fdef.required:
    if req not in kws:
      raise SxError("E-FORM-001", f"{fdef.name} {name} needs :{req}", location=form.loc,
                    fix=fdef.example.format(name=name))


def value(b: Builder, form: List, kws: dict[str, Form], key: str, env: Env) -> Any:
  """Keyword `key`'s value: an integer or number evaluated and range-checked as its
  declaration says, or its declared default when it is not written.

  Raises:
    SxError: E-TYPE-001 for a value of another type or out of its range.
  """
  k = FORMS[head_symbol(form)].key(key)
  if key not in kws:
    return k.default
  if k.kind == "int":
    return static_int(b, kws[key], env, ":" + key, k.lo)
  return static_number(b, kws[key], env, ":" + key, k.default, k.lo, k.hi)


def static(b: Builder, form: Form, env: Env, what: str) -> Any:
  """`form`'s value, which must be static (E-TYPE-001 names `what` otherwise)."""
  v = b.eval(form, env)
  if is_tensor(v):
    raise SxError("E-TYPE-001", f"{what} must be static; found {describe(v)}", location=form.loc,
                  fix="use a number, string or knob")
  return v


def static_int(b: Builder, form: Form, env: Env, what: str, lo: int) -> int:
  """`form`'s value, a static integer ≥ lo (E-TYPE-001 otherwise)."""
  v = static(b, form, env, what)
  if isinstance(v, bool) or not isinstance(v, int) or v < lo:
    raise SxError("E-TYPE-001", f"{what} must be an integer ≥ {lo}; found {describe(v)}",
                  location=form.loc, fix=f"{what} 10")
  return v


def static_number(b: Builder, form: Form | None, env: Env, what: str, default: float,
                  lo: float, hi: float | None) -> float:
  """`form`'s value, a finite static number in lo..hi (hi None: unbounded), or `default`
  when `form` is None (E-TYPE-001 otherwise)."""
  if form is None:
    return default
  v = static(b, form, env, what)
  if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
      or not lo <= v <= (hi if hi is not None else v)):
    bound = f"in {lo}..{hi}" if hi is not None else f"≥ {lo}"
    raise SxError("E-TYPE-001", f"{what} must be a number {bound}; found {describe(v)}",
                  location=form.loc, fix=f"{what} {default}")
  return float(v)


def loader_name(form: Form, loaders: dict) -> str:
  """The name of a defloader written as `form` (E-FORM-001 for no name, E-NAME-001 for
  one that is not among `loaders`)."""
  if not (isinstance(form, Atom) and isinstance(form.value, Symbol)):
    raise SxError("E-FORM-001", f"`{form}` is not a loader name", location=form.loc,
                  fix="name a defloader")
  name = str(form.value)
  if name not in loaders:
    raise SxError("E-NAME-001", f"no loader `{name}`", location=form.loc,
                  fix=did_you_mean(name, loaders) or "define it with defloader before using it")
  return name

"""`assert`: a function refuses a value, and the error is told at the call that passed it.

`(assert COND "message" :fix "...")` inside a `defn` is nothing when COND holds; when it
does not, the error (E-ARG-001) is placed at the call of that function written in the
user's files: a check inside the standard library points at the user's `(gpt2 ... :qk-norm 1)`,
at the keyword's value when the condition names it, never at `std/gpt2.sx`. The predicates
`bool?`, `number?`, `int?`, `string?` and `fn?` are what such conditions test.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from sexpgpu.errors import Loc, SxError
from sexpgpu.front.build import Builder, Call, is_tensor, truthy
from sexpgpu.front.prims import BUILTINS, builtin
from sexpgpu.front.values import Builtin, Closure
from sexpgpu.lang.blame import is_std, walk_forms
from sexpgpu.reader import Atom, Form, Symbol


@builtin("assert", '(assert COND "message" :fix "how")',
         "nothing when the static COND holds; else E-ARG-001 with the message and fix, told at "
         "the call of the function around it written in the user's files (at the keyword's "
         "value when COND names that keyword), never inside std")
def _assert(b: Builder, call: Call) -> None:
  if len(call.args) != 2 or not isinstance(call.args[1], str) or isinstance(call.args[1], Symbol):
    raise SxError("E-FORM-001", f"assert takes a condition and a message, given "
                  f"{len(call.args)} argument{'s' if len(call.args) != 1 else ''}",
                  location=call.loc,
                  fix='(assert (>= rate 0) ":rate is a number ≥ 0" :fix ":rate 0.1")')
  for k in call.kw:
    if k != "fix":
      raise SxError("E-FORM-002", f"assert has no keyword :{k}", location=call.kw_locs[k],
                    fix="assert's one keyword is :fix \"how to fix it\"")
  cond, message = call.args
  if is_tensor(cond):
    raise SxError("E-TYPE-001", f"assert's condition is a tensor {cond.type_str}; it must be "
                  "static", location=call.arg_forms[0].loc,
                  fix="assert on static values (knobs, keywords, shapes): (assert (> n 0) ...)")
  if truthy(cond):  # as `if` reads a condition
    return None
  fix = call.kw.get("fix")
  location, notes = _site(call)
  raise SxError("E-ARG-001", message, location=location, notes=notes,
                fix=str(fix) if fix else "pass a value the function's check accepts")


def _site(call: Call) -> tuple[Loc, list[tuple[str, str]]]:
  """Where an assert's failure is told: the value passed for a keyword its condition names,
  in the innermost call written outside the standard library that led to it; the call itself
  when it names none; the assert when no such call is found (a loss called by the loop)."""
  # the names the condition tests, first written first: `(<= k experts)` is about :k
  names = list(dict.fromkeys(str(f.value) for f in walk_forms(call.arg_forms[0])
                             if isinstance(f, Atom) and isinstance(f.value, Symbol)))
  checked = [("checked at", f"{call.loc} ({_short(call.form)})")]
  frame = sys._getframe(1)
  first = True
  while frame is not None:
    if frame.f_code is Builder.apply.__code__:
      outer = frame.f_locals.get("call")
      if first:  # the assert's own application
        first = False
      elif isinstance(outer, Call) and not is_std(outer.loc.file):
        for k in names:
          if k in outer.kw_forms:
            return outer.kw_forms[k].loc, [("in", _short(outer.form))] + checked
        return outer.loc, checked
    frame = frame.f_back
  return call.loc, []


def _short(form: Form, width: int = 60) -> str:
  text = str(form)
  return text if len(text) <= width else text[:width - 4] + " ...)"


def _predicate(name: str, doc: str, test):
  def fn(b: Builder, call: Call) -> bool:
    if len(call.args) != 1 or call.kw:
      raise SxError("E-FORM-001", f"{name} takes one value", location=call.loc,
                    fix=f"({name} X)")
    return bool(test(call.args[0]))
  BUILTINS[name] = Builtin(name, fn, f"({name} V)", "static: whether V is " + doc)


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_predicate("bool?", "true or false", lambda v: isinstance(v, bool))
_predicate("number?", "a finite int or float (not a boolean)", _is_number)
_predicate("int?", "an integer (not a boolean)",
           lambda v: isinstance(v, int) and not isinstance(v, bool))
_predicate("string?", "a string", lambda v: isinstance(v, str) and not isinstance(v, Symbol))
_predicate("fn?", "a function (a defn, fn or primitive)",
           lambda v: isinstance(v, (Closure, Builtin)))

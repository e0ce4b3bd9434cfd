"""Puts an error found inside the standard library at the user's knob that carried the value."""

from __future__ import annotations

import os
import re
import traceback
from typing import Any, Callable, Iterator

from sexpgpu.errors import Loc, SxError
from sexpgpu.lang.program import STD_DIR, Program
from sexpgpu.lang.select import Selection, format_value
from sexpgpu.reader import Atom, Form, Keyword, List, Symbol, Vector
from sexpgpu.reader.forms import head_symbol

# Which source of a knob's value to suspect first: the one the user just typed.
_SUSPECT = {"set": 0, "override": 1, "variant": 2, "stage": 3, "file": 4}


def guarded(path: str, variant, sets, overrides, diagnostics,
            build: Callable[[], Any]) -> Any:
  """Runs `build()` (a compile of `path`), turning what the build raises into SxErrors.

  A Python error in the evaluator (a recursion too deep, a static division by zero)
  becomes an SxError at the form being evaluated (`build_failure`); an error inside the
  standard library is placed at the user's knob that carried the value (`blame`). The
  CLI's run and check use it; so should every other caller of compile_file.

  Args:
    path: the experiment file `build` compiles.
    variant, sets, overrides: its selection, as given to compile_file.
    diagnostics: unused here (the selection does not depend on it).
    build: the compile, called once.

  Returns:
    What `build()` returns.

  Raises:
    SxError: every error of the build.
  """
  from sexpgpu.lang.program import load_program
  from sexpgpu.lang.select import run_slug_stem, select
  from sexpgpu.reader.read import deep_recursion
  try:
    with deep_recursion():
      return build()
  except (RecursionError, ArithmeticError) as e:
    err = build_failure(e)
  except SxError as e:
    err = e
  try:
    program = load_program(path)
    selection = select(program, variant, list(sets), overrides,
                       run_slug_stem())
    blamed = blame(err, program, selection)
  except SxError:
    blamed = err  # the file itself does not load: the original error says why
  if blamed is err:
    raise err
  raise blamed from None


def build_failure(exc: BaseException) -> SxError:
  """An SxError for a Python error raised while evaluating forms.

  The place is the innermost form the evaluator was evaluating when it failed (read from
  the traceback), so a static division by zero or a nesting too deep for Python still
  points at the `.sx` text.

  Args:
    exc: a RecursionError, ArithmeticError or ValueError raised by the evaluator.

  Returns:
    E-FORM-001 for a recursion too deep, else E-TYPE-001.
  """
  loc, chain = None, None
  for frame, _ in traceback.walk_tb(exc.__traceback__):
    form = frame.f_locals.get("form")
    if isinstance(form, Form):
      loc = form.loc
      owner = frame.f_locals.get("self")
      chain = getattr(owner, "chain", chain)
  notes = [("in", " › ".join(chain))] if chain else []
  if isinstance(exc, RecursionError):
    return SxError("E-FORM-001", "the expression calls or nests too deeply to build",
                   location=loc, notes=notes,
                   fix="build deep stacks with (repeat N F X), not by nesting or recursion")
  return SxError("E-TYPE-001", f"static arithmetic failed: {exc}", location=loc, notes=notes,
                 fix="check the knobs and values this expression computes with")


def is_std(file: str) -> bool:
  """Whether a location's file is one of the standard library's (`std/nn.sx`)."""
  return file.startswith("std/") or os.path.dirname(os.path.abspath(file)) == STD_DIR


def blame(err: SxError, program: Program, selection: Selection) -> SxError:
  """Re-places an error found inside the standard library at the user's knob.

  A knob passed to a standard-library function (`:width width`) may hold a value the
  function cannot take: a size below 1, or a size that must divide by another. Such an
  error surfaces deep in `std/nn.sx`; this finds the knob and says so at the place the
  value came from (the `--set` flag, the variant, or the `defknob`).

  Args:
    err: the error the build raised.
    program: the experiment's program.
    selection: the knob values of this build.

  Returns:
    A new E-KNOB-003 error at the knob, or `err` itself (perhaps with a note naming the
    user's call) when no knob explains it.
  """
  if err.location is None or not is_std(err.location.file):
    return err
  std_fns = _std_functions(program)
  calls = [(c, knobs) for c in _user_calls(program, std_fns)
           for knobs in [_knob_args(c, selection)] if knobs]
  if not calls:
    return err
  suspects = sorted({(kw, k) for c, ks in calls for kw, k in ks},
                    key=lambda p: (_SUSPECT.get(selection.knobs[p[1]].source, 9), p[1]))
  for kw, k in suspects:
    v = selection.knobs[k].value
    if _is_int(v) and v < 1:
      call = next(c for c, ks in calls if (kw, k) in ks)
      return _at_knob(err, program, selection, k, f"knob {k} = {v} is a size here and must be "
                      "at least 1", call, f"give {k} a value ≥ 1")
  divisors = _divisors(program, err.location)
  pairs = []
  for kw, k in suspects:
    for div_kw, div_k in suspects:
      if div_kw not in divisors or k == div_k:
        continue
      v, d = selection.knobs[k].value, selection.knobs[div_k].value
      if _is_int(v) and _is_int(d) and d > 0 and v % d:
        pairs.append((kw, k, div_k, v, d))
  # The pair whose quotient the error shows (10.75 for 43 / 4) first, else the likeliest.
  text = err.render()
  pairs.sort(key=lambda p: not re.search(rf"(?<![\d.]){re.escape(repr(p[3] / p[4]))}(?!\d)",
                                          text))
  if pairs:
    kw, k, div_k, v, d = pairs[0]
    call = next(c for c, ks in calls if (kw, k) in ks)
    lo, hi = v - v % d, v - v % d + d
    return _at_knob(err, program, selection, k, f"knob {k} = {v} must divide by {div_k} = {d}",
                    call, f"make {k} a multiple of {div_k}: "
                    + (f"{lo} or {hi}" if lo else f"{hi}"))
  call = calls[0][0]
  return err.with_note("called at", f"{call.loc} ({_short(call)})")


def _at_knob(err: SxError, program: Program, selection: Selection, knob: str, message: str,
             call: List, fix: str) -> SxError:
  source = selection.knobs[knob].source
  where, location = None, None
  if source == "set":
    where = f"--set {knob}={format_value(selection.knobs[knob].value)}"
  elif source == "variant" and selection.variant in program.variants:
    location = next((loc for k, _, loc in program.variants[selection.variant] if k == knob), None)
  elif knob in program.knobs:
    location = program.knobs[knob].loc
  where = where or (None if location else f"knob {knob}")
  return SxError("E-KNOB-003", message, location=location, where=where, notes=[
      ("passed at", f"{call.loc} ({_short(call)})"),
      ("needed at", f"{err.location}: {err.message}")], fix=fix)


def _std_functions(program: Program) -> dict[str, List]:
  out = {}
  for form in program.forms:
    if head_symbol(form) == "defn" and is_std(form.loc.file) and len(form.items) > 1:
      name = form.items[1]
      if isinstance(name, Atom) and isinstance(name.value, Symbol):
        out[str(name.value)] = form
  return out


def walk_forms(form: Form) -> Iterator[Form]:
  """Every form within `form`, itself first, in reading order."""
  stack = [form]
  while stack:
    f = stack.pop()
    yield f
    if isinstance(f, (List, Vector)):
      stack.extend(reversed(f.items))


def _user_calls(program: Program, std_fns: dict[str, List]) -> list[List]:
  return [f for top in program.forms if not is_std(top.loc.file) for f in walk_forms(top)
          if isinstance(f, List) and head_symbol(f) in std_fns]


def _knob_args(call: List, selection: Selection) -> list[tuple[str, str]]:
  """(keyword or "", knob) for each argument of `call` that is a knob's name."""
  out, items = [], call.items[1:]
  for i, it in enumerate(items):
    if isinstance(it, Atom) and isinstance(it.value, Symbol) and str(it.value) in selection.knobs:
      prev = items[i - 1] if i else None
      kw = str(prev.value) if isinstance(prev, Atom) and isinstance(prev.value, Keyword) else ""
      out.append((kw, str(it.value)))
  return out


def _divisors(program: Program, loc: Loc) -> set[str]:
  """Names that the standard-library function around `loc` divides by: `(/ d heads)`."""
  for form in program.forms:
    if (form.loc.file == loc.file and head_symbol(form) == "defn"
        and form.loc.line <= loc.line <= form.loc.end_line):
      return {str(f.items[2].value) for f in walk_forms(form)
              if head_symbol(f) == "/" and len(f.items) == 3 and isinstance(f.items[2], Atom)
              and isinstance(f.items[2].value, Symbol)}
  return set()


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _short(form: Form, width: int = 60) -> str:
  text = str(form)
  return text if len(text) <= width else text[:width - 4] + " ...)"

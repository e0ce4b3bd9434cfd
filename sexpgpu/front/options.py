"""The ranges of optimizer and schedule keywords, checked where they are read.

A value out of range is E-RUN-002 at its `.sx` place, never an optax error or a silent run.
"""

from __future__ import annotations

import math
from typing import Any

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.front.build import Call, describe, is_number
from sexpgpu.front.optimizers import KEYWORDS, range_text
from sexpgpu.front.values import Spec
from sexpgpu.ir.graph import Init

# What each optimizer or schedule keyword accepts is declared with the optimizers
# (front/optimizers.py: KEYWORDS), checked where it is read so that no value out of range
# reaches optax.


def _shown(v: Any) -> str:
  """A value for a message: a number of hundreds of digits is not printed whole."""
  if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
    return f"an integer of {len(str(abs(v))) if abs(v) < 10**4000 else 'over 4000'} digits"
  return describe(v)


def check_keywords(call: Call, allowed: tuple[str, ...]) -> None:
  """Raises E-FORM-002 at an optimizer's or schedule's keyword that it does not take, the
  nearest of those it takes first."""
  for k in call.kw:
    if k not in allowed:
      near = did_you_mean(":" + k, [":" + a for a in allowed])
      raise SxError("E-FORM-002", f"{call.name} has no keyword :{k}",
                    location=call.kw_locs.get(k) or call.kw_forms[k].loc,
                    fix=(near + " " if near else "") + f"{call.name} takes "
                    + " ".join(":" + a for a in allowed))


def check_options(call: Call, kw: dict) -> None:
  """Raises E-RUN-002 at the value of an optimizer or schedule keyword out of its range, and
  at a schedule given both :floor and :min-lr (one end said two ways)."""
  if "floor" in kw and "min-lr" in kw:
    _both_ends(call, kw)
  for key, v in kw.items():
    loc = call.kw_forms[key].loc
    spec = KEYWORDS[key]
    if spec.kind == "bool":
      if not isinstance(v, bool):
        raise SxError("E-RUN-002", f"{call.name} :{key} is {describe(v)}; it is true or "
                      "false", location=loc, fix=f":{key} {spec.example}")
      continue
    if spec.kind == "rate" and isinstance(v, Spec) and v.kind == "schedule":
      continue
    if spec.kind == "choice":
      if not (isinstance(v, str) and v in spec.choices):
        near = did_you_mean(f'"{v}"', [f'"{c}"' for c in spec.choices]) if isinstance(
            v, str) else ""
        raise SxError("E-RUN-002", f"{call.name} :{key} is {_shown(v)}; it is one of "
                      + " ".join(f'"{c}"' for c in spec.choices), location=loc,
                      fix=(near + " " if near else "") + f":{key} {spec.example}")
      continue
    if spec.kind == "patterns":
      if not (isinstance(v, tuple) and all(isinstance(p, str) and p for p in v)):
        raise SxError("E-RUN-002", f"{call.name} :{key} is {_shown(v)}; it is a vector of "
                      "glob patterns over parameter paths", location=loc,
                      fix=f":{key} {spec.example}")
      continue
    value = v.value if spec.kind == "rate" and isinstance(v, Init) and v.kind == "constant" \
        else v
    integer = spec.kind == "integer"
    lo, hi, lo_open, hi_open = spec.lo, spec.hi, spec.lo_open, spec.hi_open
    ok = (is_number(value) and math.isfinite(value)
          and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
          and (not integer or float(value).is_integer()))
    if not ok:
      raise SxError("E-RUN-002", f"{call.name} :{key} is {_shown(value)}; it must be "
                    + range_text(integer, lo, hi, lo_open, hi_open), location=loc,
                    fix=f":{key} {spec.example}")
    if integer:
      kw[key] = int(value)


def _both_ends(call: Call, kw: dict) -> None:
  floor, min_lr, peak = kw["floor"], kw["min-lr"], kw.get("peak")
  if not all(is_number(x) and math.isfinite(x) for x in (floor, min_lr)):
    return  # the value out of range is told below, at its own keyword
  peak = float(peak) if is_number(peak) and math.isfinite(peak) else 0.0
  raise SxError("E-RUN-002", f"{call.name} has both :floor ({floor:g}, a fraction of :peak) "
                f"and :min-lr ({min_lr:g}, absolute); they say the same thing two ways",
                location=call.loc,
                fix=f"keep one: :min-lr {min_lr:g}, or :floor "
                f"{min_lr / peak if peak else 0:g} (a fraction of :peak {peak:g})")

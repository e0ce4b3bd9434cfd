"""The ranges of optimizer and schedule keywords, checked where they are read.

A value out of range is E-RUN-002 at its `.sx` place, never an optax error or a silent run.
"""

from __future__ import annotations

import math
from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.front.build import Call, describe, is_number
from sexpgpu.front.values import Spec
from sexpgpu.ir.graph import Init

_INT32_MAX = 2**31 - 1
_F32_MAX = 3.4028234663852886e38
# What each optimizer or schedule keyword accepts: (integer?, lowest, highest, whether the
# lowest and the highest are excluded, an example), checked where it is read so that no
# value out of range reaches optax.
_OPTION_RANGES: dict[str, tuple[bool, float, float, bool, bool, str]] = {
    "lr": (False, 0, _F32_MAX, False, False, "1e-3"),
    "peak": (False, 0, _F32_MAX, False, False, "1e-3"),
    "floor": (False, 0, _F32_MAX, False, False, "0.1"),
    "weight-decay": (False, 0, _F32_MAX, False, False, "0.1"),
    "eps": (False, 0, _F32_MAX, False, False, "1e-8"),
    "clip": (False, 0, _F32_MAX, True, False, "1.0"),
    "b1": (False, 0, 1, False, True, "0.9"),  # 1 would divide by zero in the bias correction
    "b2": (False, 0, 1, False, True, "0.95"),
    "momentum": (False, 0, 1, False, False, "0.9"),
    "decay-rate": (False, 0, 1, False, False, "0.8"),
    "warmup": (True, 0, _INT32_MAX, False, False, "100"),
    "steps": (True, 1, _INT32_MAX, False, False, "2000"),
    "min-dim-size-to-factor": (True, 1, _INT32_MAX, False, False, "128"),
}


def _range_text(integer: bool, lo, hi, lo_open: bool, hi_open: bool) -> str:
  kind = "an integer" if integer else "a number"
  top = "3.4e38 (float32's largest)" if hi == _F32_MAX else str(hi)
  if lo_open or hi_open:
    return (f"{kind} {'above' if lo_open else 'at least'} {lo} and "
            f"{'below' if hi_open else 'at most'} {top}")
  return f"{kind} from {lo} to {top}"


def _shown(v: Any) -> str:
  """A value for a message: a number of hundreds of digits is not printed whole."""
  if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
    return f"an integer of {len(str(abs(v))) if abs(v) < 10**4000 else 'over 4000'} digits"
  return describe(v)


def check_options(call: Call, kw: dict) -> None:
  """Raises E-RUN-002 at the value of an optimizer or schedule keyword out of its range."""
  for key, v in kw.items():
    loc = call.kw_forms[key].loc
    if key == "nesterov":
      if not isinstance(v, bool):
        raise SxError("E-RUN-002", f"{call.name} :nesterov is {describe(v)}; it is true or "
                      "false", location=loc, fix=":nesterov true")
      continue
    if key == "lr" and isinstance(v, Spec) and v.kind == "schedule":
      continue
    value = v.value if key == "lr" and isinstance(v, Init) and v.kind == "constant" else v
    integer, lo, hi, lo_open, hi_open, example = _OPTION_RANGES[key]
    ok = (is_number(value) and math.isfinite(value)
          and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
          and (not integer or float(value).is_integer()))
    if not ok:
      raise SxError("E-RUN-002", f"{call.name} :{key} is {_shown(value)}; it must be "
                    + _range_text(integer, lo, hi, lo_open, hi_open), location=loc,
                    fix=f":{key} {example}")
    if integer:
      kw[key] = int(value)

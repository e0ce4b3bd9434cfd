"""Shape and dtype rules: each op's lowering evaluated abstractly, cached.

Evaluation runs under strict dtype promotion, so an int32 tensor times an f32
one is refused here, at build time, as it would be in the step. Nothing here
starts a JAX backend.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from sexpgpu.ir.ops import DTYPES, OPS, LowerCtx, dtype_name


class ShapeRuleError(Exception):
  """An op refused its operands; `kind` is "shape" or "type"."""

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind
    self.message = message


# An input's type for the cache: ("T", dtype, shape) for a tensor,
# ("L", "int"|"float"|"bool") for a weakly typed literal.
InType = tuple


@functools.lru_cache(maxsize=16384)
def infer(op: str, attrs: tuple, in_types: tuple[InType, ...]) -> tuple[str, tuple[int, ...]]:
  """The (dtype, shape) of `op` applied to inputs of `in_types`.

  Raises:
    ShapeRuleError: when the lowering refuses the operands.
  """
  opdef = OPS[op]
  kwargs = dict(attrs)
  structs = []
  literals = {}
  for i, t in enumerate(in_types):
    if t[0] == "T":
      structs.append((i, jax.ShapeDtypeStruct(t[2], DTYPES[t[1]])))
    else:
      literals[i] = {"int": 1, "float": 1.0, "bool": True}[t[1]]
  n = len(in_types)

  def fn(*tensors):
    it = iter(tensors)
    args = [literals[i] if i in literals else next(it) for i in range(n)]
    return opdef.lower(LowerCtx(), *args, **kwargs)

  try:
    with jax.numpy_dtype_promotion("strict"):
      out = jax.eval_shape(fn, *(s for _, s in structs))
  except (TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, OverflowError) as e:
    if opdef.source is not None:
      raise _user_error(e, opdef.source) from None
    message = _first_line(e)
    kind = "type" if _is_type_error(message) else "shape"
    raise ShapeRuleError(kind, message) from None
  except Exception as e:  # noqa: BLE001 (an op written in Python may raise anything)
    if opdef.source is None:
      raise
    raise _user_error(e, opdef.source) from None
  if not hasattr(out, "shape"):
    raise ShapeRuleError("shape", f"{op} did not produce one tensor")
  return dtype_name(out.dtype), tuple(int(d) for d in out.shape)


def _user_error(e: Exception, source: str) -> ShapeRuleError:
  """An exception inside an op written in Python, with its file and line."""
  import os
  import sys
  import traceback

  from sexpgpu.env import debug
  from sexpgpu.errors import traceback_text
  if debug():
    sys.stderr.write(traceback_text(e))
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(source)]
  where = f"{os.path.basename(source)}:{frames[-1].lineno}" if frames else source
  return ShapeRuleError("op", f"{type(e).__name__} in {where}: {_first_line(e)}")


def _first_line(e: Exception) -> str:
  text = str(e).strip().split("\n")[0]
  return text[:300]


def _is_type_error(message: str) -> bool:
  m = message.lower()
  return any(w in m for w in ("promotion", "dtype", "type ", "integer", "boolean", "float"))\
      and "shape" not in m


def literal_type(v: Any) -> InType:
  if isinstance(v, bool):
    return ("L", "bool")
  if isinstance(v, int):
    return ("L", "int")
  return ("L", "float")


def np_dtype(name: str) -> np.dtype:
  return np.dtype(DTYPES[name])

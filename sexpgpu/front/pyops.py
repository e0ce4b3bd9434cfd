"""Runs the `.py` files an experiment requires, so the ops they declare join its language.

The file runs from the text the program read (the bytes that are fingerprinted
and bundled), as a module of its own; every `@sexpgpu.op` in it registers an op
whose `source` is the file, and those ops become builtins of the experiment.
"""

from __future__ import annotations

import hashlib
import os
import traceback
import types

from sexpgpu import env
from sexpgpu.errors import Loc, SxError
from sexpgpu.front.declared import builtins_for
from sexpgpu.front.values import Builtin
from sexpgpu.ir.opdef import OPS

_FIX = "fix the file (SEXPGPU_DEBUG=1 prints the whole traceback)"


def python_line(e: BaseException, path: str) -> str:
  """`file:line` of the deepest frame of `e` in the file `path` ("" when none is)."""
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)]
  return f"{os.path.basename(path)}:{frames[-1].lineno}" if frames else ""


def load(display: str, path: str, text: str, loc: Loc) -> dict[str, Builtin]:
  """Runs one file of ops; returns a builtin for each op it declares.

  Raises:
    SxError: E-OP-001 at the require when the file raises, declares an op the table
      cannot take, or declares none.
  """
  name = "sexpgpu_ops_" + hashlib.sha256(path.encode()).hexdigest()[:16]
  module = types.ModuleType(name)
  module.__file__ = path
  try:
    code = compile(text, path, "exec")
    exec(code, module.__dict__)  # noqa: S102 (the user's own file, as `import` would run it)
  except SxError:
    raise
  except Exception as e:  # noqa: BLE001 (whatever the user's file raises is placed here)
    if env.debug():
      traceback.print_exc()
    where = python_line(e, path) or (f"{os.path.basename(path)}:{e.lineno}"
                                     if isinstance(e, SyntaxError) else display)
    raise SxError("E-OP-001", f"{display} failed while loading: {type(e).__name__}: {e}",
                  location=loc, fix=_FIX, notes=[("at", where)]) from None
  mine = [n for n, op in OPS.items() if op.source == path]
  if not mine:
    raise SxError("E-OP-001", f"{display} declares no op", location=loc,
                  fix='decorate a JAX function with @sexpgpu.op("name", doc="...")')
  return builtins_for(mine)

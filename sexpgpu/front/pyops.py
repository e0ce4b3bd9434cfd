"""Runs the `.py` files an experiment requires, so the ops they declare join its language.

The file runs from the text the program read (the bytes that are fingerprinted
and bundled), as a module of its own; every `@sexpgpu.op` in it registers an op
whose `source` is the file, and those ops become builtins of the experiment.

Running a file is running its author's code, so it runs only when the user asked
(`trusting`): `sexpgpu run FILE.sx` runs the files inside FILE's own folder, as
`python train.py` runs its imports; `--trust-python` (SEXPGPU_TRUST_PYTHON=1) runs any;
`check`, `bundle` and a bundle's run run none without it. `load_all` is the one gate:
it refuses, listing every file, before the first one runs.

What the user's Python raises or exits with (SystemExit, KeyboardInterrupt, any
BaseException) is the user's error, E-OP-001; sexpgpu's own stop (`run.signals.Stopped`,
raised by a real SIGINT/SIGTERM/SIGHUP under the CLI) passes through untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import sys
import traceback
import types
from typing import Iterator

from sexpgpu import env
from sexpgpu.errors import Loc, SxError, traceback_text
from sexpgpu.front.declared import builtins_for
from sexpgpu.front.values import Builtin
from sexpgpu.ir.opdef import OPS

_FIX = "fix the file (SEXPGPU_DEBUG=1 prints the whole traceback)"

# What Python an experiment may run (the CLI chooses; see docs/guide.md, "Python in an experiment").
ALL = "all"  # --trust-python or SEXPGPU_TRUST_PYTHON=1: every file it requires
OWN = "own-folder"  # `run FILE.sx`: the files inside FILE's own folder
NONE = "none"  # `check`, `bundle`, a bundle's run: none


@dataclasses.dataclass(frozen=True)
class Trust:
  """The policy for the Python an experiment requires.

  Attributes:
    mode: ALL, OWN or NONE.
    who: the command that compiles, as the refusal names it (`sexpgpu check`).
  """

  mode: str
  who: str


_POLICY: list[Trust] = []  # process-wide, innermost last: the CLI sets it per command


@contextlib.contextmanager
def trusting(mode: str, who: str) -> Iterator[Trust]:
  """Compiles inside the block run the Python `mode` allows (ALL, OWN or NONE).

  Process-wide rather than passed down, so that every compile a command makes (a
  bundle's, a curriculum stage's) is under the same rule without a parameter.
  """
  if mode not in (ALL, OWN, NONE):
    raise ValueError(f"trust mode {mode!r}")
  trust = Trust(mode, who)
  _POLICY.append(trust)
  try:
    yield trust
  finally:
    _POLICY.remove(trust)


def policy() -> Trust:
  """The policy in force: the innermost `trusting`, else (the Python API) SEXPGPU_TRUST_PYTHON
  or the experiment's own folder, as `run` has."""
  if _POLICY:
    return _POLICY[-1]
  return Trust(ALL if env.trust_python() else OWN, "sexpgpu.compile")


def inside(path: str, folder: str) -> bool:
  """Whether `path` lies in `folder` or below it, symbolic links followed."""
  real, base = os.path.realpath(path), os.path.realpath(folder)
  return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def sha256_text(text: str) -> str:
  """The sha256 of the text that runs (the file's bytes, a leading byte-order mark dropped)."""
  return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def refused(program, trust: Trust) -> list[str]:
  """The `.py` files of `program` that `trust` does not let run (display names)."""
  if trust.mode == ALL:
    return []
  return [d for d, (path, _) in program.python.items()
          if trust.mode == NONE or not inside(path, program.base_dir)]


def load_all(program) -> dict[str, Builtin]:
  """Runs every `.py` file a program requires, when the policy allows all of them.

  Returns:
    A builtin for each op the files declare.

  Raises:
    SxError: E-OP-002 at the first refused require, naming every file that would run,
      before any runs; E-OP-001 from `load`.
  """
  if not program.python:
    return {}
  trust = policy()
  bad = refused(program, trust)
  if bad:
    raise _refusal(program, trust, bad)
  out: dict[str, Builtin] = {}
  for display, (path, loc) in program.python.items():
    out.update(load(display, path, program.sources[display], loc))
  return out


def _refusal(program, trust: Trust, bad: list[str]) -> SxError:
  notes = []
  for display, (path, loc) in program.python.items():
    where = "" if inside(path, program.base_dir) else ", outside the experiment's folder"
    notes.append(("would run", f"{display} sha256 {sha256_text(program.sources[display])[:16]} "
                  f"(required at {loc}{where})"))
  loc = program.python[bad[0]][1]
  n = len(program.python)
  files = f"{n} Python file{'s' if n != 1 else ''}"
  if trust.mode == NONE:
    return SxError(
        "E-OP-002", f"{trust.who} runs no Python without --trust-python, and this experiment "
        f"requires {files}", location=loc, notes=notes,
        fix="read the files listed; to run them, add --trust-python (or set "
        "SEXPGPU_TRUST_PYTHON=1); `sexpgpu check FILE --print requires` lists them without "
        "running anything")
  return SxError(
      "E-OP-002", f"{bad[0]} lies outside the experiment's folder "
      f"({os.path.realpath(program.base_dir)}): {trust.who} runs Python from there only with "
      "--trust-python", location=loc, notes=notes,
      fix="read the files listed, then add --trust-python (or set SEXPGPU_TRUST_PYTHON=1), "
      "or copy the file into the experiment's folder")


def python_line(e: BaseException, path: str) -> str:
  """`file:line` of the deepest frame of `e` in the file `path` ("" when none is)."""
  frames = [f for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)]
  return f"{os.path.basename(path)}:{frames[-1].lineno}" if frames else ""


def is_stop(e: BaseException) -> bool:
  """Whether `e` is a real stop that must pass through a user's code untouched.

  sexpgpu's own `Stopped` (raised by the CLI's handlers for a real signal; looked up, not
  imported: run/ sits below front/), or a KeyboardInterrupt while Python's default SIGINT
  handler is in place (the Python API, a notebook), where a real Ctrl-C and a user's
  `raise KeyboardInterrupt` cannot be told apart. Under the CLI a real Ctrl-C is Stopped,
  so a KeyboardInterrupt is the user's own.
  """
  signals = sys.modules.get("sexpgpu.run.signals")
  if signals is not None and isinstance(e, signals.Stopped):
    return True
  return (isinstance(e, KeyboardInterrupt)
          and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def detail(e: BaseException) -> str:
  """The first line of what `e` says, or what it means when it says nothing."""
  if isinstance(e, SystemExit):
    return f"sys.exit({e.code!r}): the user's Python may not end the process"
  text = str(e).strip().split("\n")[0][:300]
  if text:
    return text
  if isinstance(e, KeyboardInterrupt):
    return "raised by the Python itself (a real Ctrl-C stops sexpgpu as a signal does)"
  return "raised with no message"


def described(e: BaseException) -> str:
  """What a user's exception was, in one line (`SystemExit: sys.exit(3): ...`)."""
  return f"{type(e).__name__}: {detail(e)}"


class UserExit(Exception):
  """A BaseException a user's op raised (SystemExit, KeyboardInterrupt, ...), as an error.

  Each is of a subclass named as the original (`as_error`), with its traceback, so the
  handlers of an op's exceptions place it by its file and line like any other.
  """


_AS_ERRORS: dict[type, type] = {}


def as_error(e: BaseException) -> Exception:
  """`e` when it is an Exception, else a UserExit of the same name, message and traceback."""
  if isinstance(e, Exception):
    return e
  cls = _AS_ERRORS.get(type(e))
  if cls is None:
    cls = _AS_ERRORS[type(e)] = type(type(e).__name__, (UserExit,), {"__module__": __name__})
  return cls(detail(e)).with_traceback(e.__traceback__)


def op_error(op: str, source: str, e: BaseException, loc: Loc | None) -> SxError:
  """E-OP-001 at an op's `.sx` call for what its Python raised while being lowered."""
  if env.debug():
    sys.stderr.write(traceback_text(e))
  where = python_line(e, source) or source
  return SxError("E-OP-001", f"{op}: {type(e).__name__} in {where}: {detail(e)}",
                 location=loc, where=None if loc else where,
                 fix="fix the op's function so that it traces for every call (SEXPGPU_DEBUG=1 "
                 "prints the whole traceback)")


def load(display: str, path: str, text: str, loc: Loc) -> dict[str, Builtin]:
  """Runs one file of ops; returns a builtin for each op it declares (callers: `load_all`).

  Raises:
    SxError: E-OP-001 at the require when the file raises or exits, declares an op the
      table cannot take, or declares none.
  """
  name = "sexpgpu_ops_" + hashlib.sha256(path.encode()).hexdigest()[:16]
  module = types.ModuleType(name)
  module.__file__ = path
  try:
    code = compile(text, path, "exec")
    exec(code, module.__dict__)  # noqa: S102 (the user's own file, as `import` would run it)
  except SxError as e:
    if e.location is None:  # a declaration refused (E-OP-003): placed at the require too
      e.location = loc
      raise e.with_note("declared at", e.where or display) from None
    raise
  except BaseException as e:  # noqa: BLE001 (whatever the user's file raises or exits with)
    if is_stop(e):
      raise
    if env.debug():
      sys.stderr.write(traceback_text(e))
    where = python_line(e, path) or (f"{os.path.basename(path)}:{e.lineno}"
                                     if isinstance(e, SyntaxError) else display)
    raise SxError("E-OP-001", f"{display} failed while loading: {described(e)}",
                  location=loc, fix=_FIX, notes=[("at", where)]) from None
  mine = [n for n, op in OPS.items() if op.source == path]
  if not mine:
    raise SxError("E-OP-001", f"{display} declares no op", location=loc,
                  fix='decorate a JAX function with @sexpgpu.op("name", doc="...")')
  return builtins_for(mine)

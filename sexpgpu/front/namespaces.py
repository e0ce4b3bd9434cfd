"""The standard library's namespaces: each std library's names its own, the user's first."""

from __future__ import annotations

from collections import ChainMap
from typing import Any

from sexpgpu.errors import Loc, SxError
from sexpgpu.front.values import Closure, Env
from sexpgpu.lang.program import Program


def std_namespaces(program: Program, env: Env) -> tuple[dict[str, Env], dict[str, Any]]:
  """Each std library's namespace, and the user's view of them, put between the user's
  top level `env` and the builtins (`env.parent`).

  A library's functions see its own names, then those of the std libraries it requires
  (transitively) and the qualified names, then the builtins: never the user's definitions
  or knobs, so a user's `block` leaves std/lm's `transformer-lm` calling std/lm's `block`.
  The user sees their own top level first, then every loaded library's names, then
  `lib/name` for each (`lm/block`).

  Returns:
    (library → its namespace, the qualified names: filled as the libraries' forms run).
  """
  base = env.parent
  own = {lib: {} for lib in program.std_requires}
  qualified: dict[str, Any] = {}

  def reach(lib: str, seen: list[str]) -> list[str]:
    for dep in program.std_requires.get(lib, ()):
      if dep not in seen:
        seen.append(dep)
        reach(dep, seen)
    return seen

  spaces = {lib: Env(Env(base, ChainMap(qualified, *(own[d] for d in reach(lib, [])))),
                     own[lib])
            for lib in own}
  env.parent = Env(base, ChainMap(qualified, *own.values()))
  return spaces, qualified


def hidden_std_function(name: str, what: str, hidden: Any, call_loc: Loc | None) -> None:
  """Raises E-NAME-002 at a call of the user's knob or def `name` when the name it hides
  is a standard-library function: the user's name wins in their files, and the library's
  stays reachable qualified (`lm/block`), which the error says.
  """
  if not (isinstance(hidden, Closure) and str(hidden.loc.file).startswith("std/")):
    return
  lib = str(hidden.loc.file)[4:].rsplit(".", 1)[0]
  raise SxError("E-NAME-002", f"`{name}` here is your {what}, not a function: in your files "
                f"your own `{name}` hides {hidden.loc.file}'s, which is `{lib}/{name}`",
                location=call_loc, fix=f"call ({lib}/{name} ...), or rename the {what}")

"""Where the loss calls each function: a trained function's parameters, reached from any program.

Parameter paths follow the call path (`unet/down/w` when the loss calls `unet`). Another
program (a pass metric, sampling, a generation loop, `Experiment.call`) that reaches `unet`
through a caller of its own (`generate › ddim-step › unet`) would make a path the loss never
creates. So the loss's build records, for every named function it calls, the scope of each
call (by the `:as` name written there); another program's call of that function opens the
scope the loss gave it, and its parameters are the trained ones:

- the program's own path when it is one of the loss's (a metric that calls as the loss does);
- else the loss's one call of the function (under the same `:as` name, if one is written);
- a function the loss calls at several places with different parameters is ambiguous
  (E-PARAM-001, naming the places and how to name one with `:as`), as is one whose
  parameters a `repeat` stacks a layer each;
- a function the loss never calls keeps the caller's path, and a parameter it creates is
  E-RUN-002, naming the program and calls that asked for it and why training misses it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from sexpgpu.errors import Loc, SxError


@dataclasses.dataclass(frozen=True)
class Place:
  """One call of a function by the loss: the scope it opened and the repeats around it."""

  scope: tuple[str, ...]
  stack: tuple[int, ...]
  loc: Loc | None


# closure → {`:as` name or None: the loss's calls}; the closures are the experiment's own,
# so the record goes when they do
_HOMES: "weakref.WeakKeyDictionary[Any, dict[str | None, list[Place]]]" = \
    weakref.WeakKeyDictionary()


def start(recorded: dict) -> None:
  """Before a loss's build: `recorded` (the builder's) collects its calls afresh."""
  recorded.clear()


def record(recorded: dict, fn, as_name: str | None, scope: tuple[str, ...],
           stack: tuple[int, ...], loc: Loc | None) -> None:
  """The loss's build calls `fn` (under `as_name`) opening `scope` inside `stack` repeats."""
  places = recorded.setdefault(fn, {}).setdefault(as_name, {})  # scope → Place: a recursion
  places.setdefault(scope, Place(scope, stack, loc))           # thousands deep stays linear


def finish(recorded: dict) -> None:
  """After a loss's build: its calls become the homes other programs' calls open."""
  for fn, homes in recorded.items():
    _HOMES[fn] = {as_name: list(places.values()) for as_name, places in homes.items()}


def _owns(params: dict, scope: tuple[str, ...]) -> bool:
  prefix = "/".join(scope) + "/"
  return any(path.startswith(prefix) for path in params)


def _where(p: Place) -> str:
  return "/".join(p.scope) + (f" ({p.loc})" if p.loc is not None else "")


def home(params: dict, fn, as_name: str | None, natural: tuple[str, ...],
         stack: tuple[int, ...], who: str, loc: Loc | None) -> tuple[str, ...] | None:
  """The scope another program's call of `fn` opens, or None for its own (`natural`).

  Args:
    params: the trained parameters, by path.
    natural: the scope the call would open by its caller's path.
    stack: the repeats around the call.
    who: the program and calls asking, for the error.

  Raises:
    SxError: E-PARAM-001 when the loss calls `fn` at several places with different
      parameters, or inside a repeat that stacks them.
  """
  homes = _HOMES.get(fn)
  if homes is None:
    return None
  places = homes.get(as_name) or ([p for ps in homes.values() for p in ps]
                                  if as_name is None else [])
  if any(p.scope == natural and p.stack == stack for p in places):
    return None
  owning = [p for p in places if _owns(params, p.scope)]
  if not owning:
    return None  # no parameters of its own: any path reads the same ones
  if len(owning) > 1:
    named = sorted({a for a in homes if a is not None})
    raise SxError(
        "E-PARAM-001", f"{who} calls `{fn.name}`, which the loss calls at {len(owning)} places "
        f"with different parameters ({'; '.join(_where(p) for p in owning)}), so which "
        "trained one is meant is ambiguous", location=loc,
        fix=(f"name the one meant with :as, as the loss names them: ({fn.name} ... :as "
             f"{named[0]}) (the loss's names: {', '.join(named)})" if named else
             f"name each of the loss's calls of `{fn.name}` with :as ({fn.name} ... :as enc) "
             "and call it here with the same :as"))
  (p,) = owning
  if p.stack != stack:
    raise SxError(
        "E-PARAM-001", f"{who} calls `{fn.name}`, whose parameters the loss stacks in a "
        f"repeat of {' × '.join(map(str, p.stack))} ({_where(p)}), one set a layer, so which "
        "layer's is meant is ambiguous", location=loc,
        fix=f"call the function that repeats `{fn.name}` (the loss's caller of it), not "
        f"`{fn.name}` alone")
  return p.scope


def untrained(path: str, who: str, chain: list[str], calls: list, loc: Loc | None) -> SxError:
  """E-RUN-002 for a parameter only another program would create: who asked for it (the
  program and its calls) and why training would never update it."""
  fn, as_name = calls[-1] if calls else (None, None)
  homes = _HOMES.get(fn) if fn is not None else None
  if fn is None:
    why = "the program creates it itself, outside any function the loss calls"
  elif homes is None:
    why = f"the loss never calls `{fn.name}`, so none of its parameters are trained"
  elif as_name is not None and as_name not in homes:
    named = ", ".join(str(a) for a in homes) if any(a is not None for a in homes) else "none"
    why = (f"the loss calls `{fn.name}` but never :as {as_name} (its :as names: {named}), "
           "and that name makes new parameters")
  else:
    why = f"the loss's calls of `{fn.name}` create no parameter of this name"
  name = fn.name if fn is not None else "it"
  return SxError("E-RUN-002", f"parameter {path} is created only by {who} (through "
                 f"{' › '.join(chain)}), never by the loss, so training would never update it: "
                 f"{why}", location=loc,
                 fix=f"create every parameter in the loss's functions: call `{name}` from the "
                 "loss as this program calls it (the same :as name), or pass the values in "
                 "as arguments")


def who_of(program: str) -> str:
  """The program a builder builds, in words: "a pass metric `eval/loss`", ..."""
  kinds = {"sample": "the sampling program", "generate": "the generation program"}
  head = program.split("/")[0]
  if program and head in kinds:
    return f"{kinds[head]} `{program}`"
  if "/" in program:
    return f"a pass metric `{program}`"
  return f"the program `{program}`" if program else "this program"

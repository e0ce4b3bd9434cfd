"""Values of the evaluator besides numbers, strings and tensors (IR nodes)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sexpgpu.errors import Loc
from sexpgpu.reader import Form


class Env:
  """A chain of bindings; lookups walk outwards."""

  __slots__ = ("vars", "parent")

  def __init__(self, parent: "Env | None" = None, vars: dict | None = None):
    self.vars = vars if vars is not None else {}
    self.parent = parent

  def lookup(self, name: str) -> Any:
    env = self
    while env is not None:
      if name in env.vars:
        return env.vars[name]
      env = env.parent
    raise KeyError(name)

  def names(self) -> set[str]:
    out, env = set(), self
    while env is not None:
      out.update(env.vars)
      env = env.parent
    return out


@dataclasses.dataclass(eq=False)
class Closure:
  """A `defn` or `fn`: parameters, keyword parameters with default forms, body."""

  name: str | None
  params: tuple[Form, ...]
  kwparams: tuple[tuple[str, Form], ...]
  body: tuple[Form, ...]
  env: Env
  loc: Loc

  def __repr__(self) -> str:
    return f"<fn {self.name or 'anonymous'}>"


@dataclasses.dataclass(eq=False)
class Builtin:
  """A primitive or library function implemented in Python.

  Attributes:
    name: the name it is called by.
    fn: `(builder, call) → value`.
    usage: how it is written, for the reference (`(dim X AXIS)`); an op's comes from its
      declaration (ir/ops.py), so only a builtin that is no op declares one.
    doc: one line for the reference.
  """

  name: str
  fn: Callable[..., Any]
  usage: str = ""
  doc: str = ""

  def __repr__(self) -> str:
    return f"<builtin {self.name}>"


@dataclasses.dataclass(frozen=True)
class Spec:
  """A configuration value: an optimizer, a schedule (kind, name, keyword args)."""

  kind: str
  name: str
  args: tuple[tuple[str, Any], ...]
  loc: Loc | None = None

  def get(self, key: str, default: Any = None) -> Any:
    return dict(self.args).get(key, default)


@dataclasses.dataclass(eq=False)
class Batch:
  """A record batch: field name → input node."""

  fields: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamRef:
  """A `defparam`: a parameter shared by name wherever it is used."""

  name: str
  shape: tuple[int, ...]
  init: Any
  dtype: str
  loc: Loc

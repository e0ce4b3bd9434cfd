"""The forms the reader produces: atoms, lists and vectors with locations."""

from __future__ import annotations

import dataclasses
from typing import Any

from sexpgpu.errors import Loc


class Symbol(str):
  """A symbol's name, such as `eval/loss` or `split-heads`."""

  __slots__ = ()

  def __repr__(self) -> str:
    return f"Symbol({str.__repr__(self)})"


class Keyword(str):
  """A keyword's name without the colon: `:batch` is Keyword("batch")."""

  __slots__ = ()

  def __repr__(self) -> str:
    return f":{str(self)}"


@dataclasses.dataclass(frozen=True, eq=False)
class Form:
  """Any form; `loc` spans its text."""

  loc: Loc


@dataclasses.dataclass(frozen=True, eq=False)
class Atom(Form):
  """A number, string, boolean, nil, symbol or keyword."""

  value: Any

  def __str__(self) -> str:
    v = self.value
    if v is None:
      return "nil"
    if isinstance(v, bool):
      return "true" if v else "false"
    if isinstance(v, Keyword):
      return f":{v}"
    if isinstance(v, Symbol):
      return str(v)
    if isinstance(v, str):
      return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return repr(v)


@dataclasses.dataclass(frozen=True, eq=False)
class List(Form):
  """A parenthesised list: a call or a special form."""

  items: tuple[Form, ...]

  def __str__(self) -> str:
    return render(self)


@dataclasses.dataclass(frozen=True, eq=False)
class Vector(Form):
  """A bracketed vector: a shape, a binding list or a parameter list."""

  items: tuple[Form, ...]

  def __str__(self) -> str:
    return render(self)


def render(form: Form) -> str:
  """The form as text, without recursion (forms may nest a thousand deep)."""
  parts: list[str] = []
  stack: list = [form]
  while stack:
    f = stack.pop()
    if isinstance(f, str):
      parts.append(f)
    elif isinstance(f, (List, Vector)):
      opener, closer = ("(", ")") if isinstance(f, List) else ("[", "]")
      stack.append(closer)
      for k, item in enumerate(reversed(f.items)):
        stack.append(item)
        if k < len(f.items) - 1:
          stack.append(" ")
      parts.append(opener)
    else:
      parts.append(str(f))
  return "".join(parts)


def head_symbol(form: Form) -> str | None:
  """The symbol at the head of a list form, or None."""
  if isinstance(form, List) and form.items:
    first = form.items[0]
    if isinstance(first, Atom) and isinstance(first.value, Symbol):
      return str(first.value)
  return None

"""Reads `.sx` text into forms; every position is counted in one place (`_Cursor`)."""

from __future__ import annotations

import re

from sexpgpu.errors import Loc, SxError, register_source
from sexpgpu.reader.forms import Atom, Form, Keyword, List, Symbol, Vector

_SYMBOL_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_+*/<>=!?.%")
_DELIMS = set("()[]\";") | set(" \t\r\n,")
_INT = re.compile(r"^[+-]?\d[\d_]*$")
_FLOAT = re.compile(r"^[+-]?(\d[\d_]*)?(\.\d[\d_]*)?([eE][+-]?\d+)?$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "0": "\0"}
_CLOSERS = {"(": ")", "[": "]"}


class _Cursor:
  """Walks the text one character at a time, counting lines and columns."""

  def __init__(self, text: str, file: str):
    self.text = text
    self.file = file
    self.i = 0
    self.line = 1
    self.col = 1

  def peek(self, ahead: int = 0) -> str:
    j = self.i + ahead
    return self.text[j] if j < len(self.text) else ""

  def getc(self) -> str:
    c = self.text[self.i]
    self.i += 1
    if c == "\n":
      self.line += 1
      self.col = 1
    else:
      self.col += 1
    return c

  def here(self) -> tuple[int, int]:
    return self.line, self.col

  def loc(self, start: tuple[int, int]) -> Loc:
    return Loc(self.file, start[0], start[1], self.line, self.col)

  def point(self) -> Loc:
    return Loc(self.file, self.line, self.col, self.line, self.col + 1)


def read_text(text: str, file: str = "<string>") -> list[Form]:
  """Reads every top-level form of `text`.

  Args:
    text: the `.sx` source.
    file: the name used in locations and errors.

  Returns:
    The top-level forms, in order.

  Raises:
    SxError: E-READ-001 (brackets), E-READ-002 (strings), E-READ-003 (tokens).
  """
  register_source(file, text)
  cur = _Cursor(text, file)
  forms = []
  while True:
    _skip_space(cur)
    if not cur.peek():
      return forms
    form = _read_form(cur, top=True)
    if form is not None:
      forms.append(form)


def read_file(path: str, display: str | None = None) -> list[Form]:
  """Reads a `.sx` file; `display` is the name shown in errors (default: path)."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  return read_text(text, display or path)


def _skip_space(cur: _Cursor) -> None:
  while True:
    c = cur.peek()
    if c and c in " \t\r\n,":
      cur.getc()
    elif c == ";":
      while cur.peek() and cur.peek() != "\n":
        cur.getc()
    elif c == "#" and cur.peek(1) == ";":
      start = cur.here()
      cur.getc()
      cur.getc()
      _skip_space(cur)
      if not cur.peek():
        raise SxError("E-READ-001", "`#;` at the end of the file has no form to skip",
                      location=cur.loc(start), fix="remove the `#;` or put a form after it")
      _read_form(cur, top=False)
    else:
      return


def _read_form(cur: _Cursor, top: bool) -> Form:
  c = cur.peek()
  if c in "([":
    return _read_seq(cur)
  if c in ")]":
    where = cur.point()
    cur.getc()
    raise SxError("E-READ-001", f"unexpected `{c}` with no form open",
                  location=where, fix=f"remove the `{c}` or open a form before it")
  if c == '"':
    return _read_string(cur)
  return _read_token(cur)


def _read_seq(cur: _Cursor) -> Form:
  start = cur.here()
  opener = cur.getc()
  closer = _CLOSERS[opener]
  items = []
  while True:
    _skip_space(cur)
    c = cur.peek()
    if not c:
      raise SxError(
          "E-READ-001",
          f"`{opener}` opened at line {start[0]}, column {start[1]} is never closed",
          location=Loc(cur.file, start[0], start[1], start[0], start[1] + 1),
          fix=f"add `{closer}` where the form should end")
    if c in ")]":
      if c != closer:
        where = cur.point()
        raise SxError(
            "E-READ-001",
            f"`{c}` closes the `{opener}` opened at line {start[0]}, column {start[1]}",
            location=where, fix=f"write `{closer}` here, or open this form with "
            f"`{'(' if c == ')' else '['}`")
      cur.getc()
      loc = cur.loc(start)
      return List(loc, tuple(items)) if opener == "(" else Vector(loc, tuple(items))
    items.append(_read_form(cur, top=False))


def _read_string(cur: _Cursor) -> Form:
  start = cur.here()
  cur.getc()
  out = []
  while True:
    c = cur.peek()
    if not c:
      raise SxError("E-READ-002", "string never ends",
                    location=Loc(cur.file, start[0], start[1], start[0], start[1] + 1),
                    fix='close the string with `"`')
    if c == '"':
      cur.getc()
      return Atom(cur.loc(start), "".join(out))
    if c == "\\":
      where = cur.here()
      cur.getc()
      e = cur.peek()
      if e not in _ESCAPES or not e:
        raise SxError("E-READ-002", f"bad escape `\\{e}` in a string",
                      location=Loc(cur.file, where[0], where[1], where[0], where[1] + 2),
                      fix="use one of \\n \\t \\r \\\" \\\\ \\0")
      cur.getc()
      out.append(_ESCAPES[e])
      continue
    out.append(cur.getc())


def _read_token(cur: _Cursor) -> Form:
  start = cur.here()
  chars = []
  while cur.peek() and cur.peek() not in _DELIMS:
    chars.append(cur.getc())
  if not chars:  # a lone delimiter we do not accept, such as `#`
    chars.append(cur.getc())
  tok = "".join(chars)
  loc = cur.loc(start)
  value = _parse_token(tok)
  if value is _BAD:
    raise SxError("E-READ-003", f"`{tok}` is no number, symbol or keyword",
                  location=loc, fix=_token_fix(tok))
  return Atom(loc, value)


_BAD = object()


def _parse_token(tok: str):
  if tok == "true":
    return True
  if tok == "false":
    return False
  if tok == "nil":
    return None
  if _INT.match(tok):
    return int(tok.replace("_", ""))
  if (tok[0].isdigit() or (tok[0] in "+-." and len(tok) > 1 and (tok[1].isdigit() or tok[1] == "."))) \
      and _FLOAT.match(tok) and any(ch.isdigit() for ch in tok):
    try:
      return float(tok.replace("_", ""))
    except ValueError:
      return _BAD
  if tok.startswith(":"):
    name = tok[1:]
    if name and all(ch in _SYMBOL_CHARS for ch in name):
      return Keyword(name)
    return _BAD
  if tok[0].isdigit() or not all(ch in _SYMBOL_CHARS for ch in tok):
    return _BAD
  return Symbol(tok)


def _token_fix(tok: str) -> str:
  if tok[0].isdigit():
    return "a number is digits with an optional `.`, exponent and `_` separators; " \
           "a symbol may not start with a digit"
  bad = sorted({ch for ch in tok if ch not in _SYMBOL_CHARS and ch != ":"})
  if bad:
    return f"symbols use letters, digits and -_+*/<>=!?.%; remove {' '.join(bad)}"
  return "write a keyword as `:name`"

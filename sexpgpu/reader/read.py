"""Reads `.sx` text into forms; every position is counted in one place (`_Cursor`)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys

from sexpgpu.errors import Loc, SxError, register_source
from sexpgpu.reader.forms import Atom, Form, Keyword, List, Symbol, Vector

_SYMBOL_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_+*/<>=!?.%")
_DELIMS = set("()[]\";") | set(" \t\r\n,")
_INT = re.compile(r"^[+-]?\d[\d_]*$")
_FLOAT = re.compile(r"^[+-]?(\d[\d_]*)?(\.\d[\d_]*)?([eE][+-]?\d+)?$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "0": "\0"}
_CLOSERS = {"(": ")", "[": "]"}
# Forms nest at most this deep: every later stage walks them recursively, and a file
# deeper than this is a generated mistake, not an experiment.
MAX_DEPTH = 1000
# Integer literals fit in 64 bits: a knob, a shape or a seed never needs more.
INT_LIMIT = 2**63
_BOM = "\ufeff"
# Python frames the reader and the evaluator may use for forms MAX_DEPTH deep.
RECURSION_LIMIT = 20 * MAX_DEPTH


@contextlib.contextmanager
def deep_recursion():
  """Raises Python's recursion limit to RECURSION_LIMIT for the block (forms nest deep)."""
  old = sys.getrecursionlimit()
  sys.setrecursionlimit(max(old, RECURSION_LIMIT))
  try:
    yield
  finally:
    sys.setrecursionlimit(old)


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
  if text.startswith(_BOM):  # editors on Windows write one; it is no part of the text
    text = text[1:]
  register_source(file, text)
  cur = _Cursor(text, file)
  forms = []
  with deep_recursion():
    while True:
      _skip_space(cur)
      if not cur.peek():
        return forms
      form = _read_form(cur, top=True)
      if form is not None:
        forms.append(form)


def read_source(path: str, display: str | None = None) -> str:
  """The text of a `.sx` file: UTF-8, a leading byte-order mark dropped.

  Args:
    path: the file to read.
    display: the name shown in errors (default: path).

  Returns:
    The file's text.

  Raises:
    SxError: E-REQ-001 when it is no readable file, E-READ-003 when it is not UTF-8 text.
  """
  shown = display or path
  if os.path.isdir(path):
    raise SxError("E-REQ-001", f"`{shown}` is a directory, not an experiment file", where=shown,
                  fix="give the path of a .sx file")
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise SxError("E-REQ-001", f"cannot read `{shown}`: {e.strerror or e}", where=shown,
                  fix="check the path and its permissions") from None
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    before = data[:e.start].decode("utf-8", errors="replace")
    line = before.count("\n") + 1
    col = len(before) - (before.rfind("\n") + 1) + 1
    raise SxError("E-READ-003", f"byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8 "
                  "text: this looks like a binary file",
                  location=Loc(shown, line, col, line, col + 1),
                  fix="an experiment is a UTF-8 text file; check that this is the .sx you meant"
                  ) from None
  return text[1:] if text.startswith(_BOM) else text


def read_file(path: str, display: str | None = None) -> list[Form]:
  """Reads a `.sx` file; `display` is the name shown in errors (default: path)."""
  return read_text(read_source(path, display), display or path)


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


def _read_form(cur: _Cursor, top: bool, depth: int = 0) -> Form:
  c = cur.peek()
  if c in "([":
    return _read_seq(cur, depth + 1)
  if c in ")]":
    where = cur.point()
    cur.getc()
    raise SxError("E-READ-001", f"unexpected `{c}` with no form open",
                  location=where, fix=f"remove the `{c}` or open a form before it")
  if c == '"':
    return _read_string(cur)
  return _read_token(cur)


def _read_seq(cur: _Cursor, depth: int) -> Form:
  start = cur.here()
  if depth > MAX_DEPTH:
    raise SxError("E-READ-001", f"forms nest more than {MAX_DEPTH} deep here",
                  location=Loc(cur.file, start[0], start[1], start[0], start[1] + 1),
                  fix="name the inner parts with let or defn, or check the brackets")
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
    items.append(_read_form(cur, top=False, depth=depth))


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
    raise SxError("E-READ-003", f"`{shown(tok)}` is no number, symbol or keyword",
                  location=loc, fix=_token_fix(tok))
  return Atom(loc, value)


_BAD = object()


def parse_int(text: str, limit: int = INT_LIMIT) -> int | None:
  """The integer a decimal literal writes (a sign, digits, `_` between them), or None when
  `text` is no such literal or its size reaches `limit`: the one place integers are read.

  The digits are counted before anything converts them, so a literal of any length (past
  Python's 4,300-digit limit on int()) is answered at once, never with a ValueError.
  """
  if not isinstance(text, str) or not _INT.match(text):
    return None
  digits = text.lstrip("+-").replace("_", "").lstrip("0")
  if len(digits) > len(str(limit)):
    return None
  value = int(digits or "0") * (-1 if text.startswith("-") else 1)
  return value if -limit <= value < limit else None


def is_int_literal(text: str) -> bool:
  """Whether `text` is written as a decimal integer (whatever its size)."""
  return isinstance(text, str) and bool(_INT.match(text))


def shown(tok: str, most: int = 40) -> str:
  """A token as an error quotes it: cut to `most` characters, with its length when cut."""
  return tok if len(tok) <= most else f"{tok[:most]}... ({len(tok)} characters)"


def _parse_token(tok: str):
  if tok == "true":
    return True
  if tok == "false":
    return False
  if tok == "nil":
    return None
  if _INT.match(tok):
    value = parse_int(tok)
    return _BAD if value is None else value
  if (tok[0].isdigit() or (tok[0] in "+-." and len(tok) > 1 and (tok[1].isdigit() or tok[1] == "."))) \
      and _FLOAT.match(tok) and any(ch.isdigit() for ch in tok):
    try:
      value = float(tok.replace("_", ""))
    except ValueError:
      return _BAD
    return value if math.isfinite(value) else _BAD
  if tok.startswith(":"):
    name = tok[1:]
    if name and all(ch in _SYMBOL_CHARS for ch in name):
      return Keyword(name)
    return _BAD
  if tok[0].isdigit() or not all(ch in _SYMBOL_CHARS for ch in tok):
    return _BAD
  return Symbol(tok)


def _token_fix(tok: str) -> str:
  if _INT.match(tok):
    return "integers fit in 64 bits (below 9223372036854775808 in size)"
  if _FLOAT.match(tok) and any(ch.isdigit() for ch in tok):
    return "floats are finite, below about 1.8e308 in size"
  if tok[0].isdigit():
    return "a number is digits with an optional `.`, exponent and `_` separators; " \
           "a symbol may not start with a digit"
  bad = sorted({ch for ch in tok if ch not in _SYMBOL_CHARS and ch != ":"})
  if bad:
    return f"symbols use letters, digits and -_+*/<>=!?.%; remove {' '.join(bad)}"
  return "write a keyword as `:name`"

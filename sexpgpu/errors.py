"""Source locations and the one error type a user ever sees: SxError."""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Iterable, Sequence

from sexpgpu.catalogue import CATALOGUE

# The text of every file the reader has read, so an error can show its line.
_SOURCES: dict[str, str] = {}


def register_source(path: str, text: str) -> None:
  """Remembers the text of a file so errors can quote its lines."""
  _SOURCES[path] = text


def source_text(path: str) -> str | None:
  """The text registered for `path`, or None."""
  return _SOURCES.get(path)


@dataclasses.dataclass(frozen=True)
class Loc:
  """A span of `.sx` text: file, 1-based line and column, and where it ends."""

  file: str
  line: int
  col: int
  end_line: int = 0
  end_col: int = 0

  def __str__(self) -> str:
    return f"{self.file}:{self.line}:{self.col}"


class SxError(Exception):
  """A user's mistake, with its code, place and fix.

  Attributes:
    code: the catalogue code, such as "E-SHAPE-001" (`sexpgpu.catalogue`).
    message: one line saying what was found and what was expected.
    location: the `.sx` place (a Loc), or None for errors found outside a file.
    where: for errors outside a file, the flag, variable or location named.
    fix: how to fix it; the catalogue's fix for the code when a raise gives none.
    notes: further `= key: value` lines (operands, scope chain, ...).
  """

  def __init__(self, code: str, message: str, *, location: Loc | None = None,
               where: str | None = None, fix: str | None = None,
               notes: Sequence[tuple[str, str]] = ()):
    if code not in CATALOGUE:  # a programming error: every code is catalogued
      raise ValueError(f"error code {code!r} is not in sexpgpu/catalogue.py")
    self.code = code
    self.message = message
    self.location = location
    self.where = where
    self.fix = fix if fix is not None else CATALOGUE[code].fix
    self.notes = list(notes)
    super().__init__(self.render())

  def with_note(self, key: str, value: str) -> "SxError":
    """Adds a `= key: value` line and returns self (for re-raising)."""
    self.notes.append((key, value))
    self.args = (self.render(),)
    return self

  def render(self) -> str:
    """The text printed on standard error, as in the error catalogue."""
    lines = [f"error[{self.code}]: {self.message}"]
    if self.location is not None:
      lines.append(f"  --> {self.location}")
      lines.extend(_quote(self.location))
    elif self.where:
      lines.append(f"  --> {self.where}")
    for key, value in self.notes:
      lines.append(f"   = {key}: {value}")
    if self.fix:
      lines.append(f"   = fix: {self.fix}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.render()


def _quote(loc: Loc) -> list[str]:
  text = source_text(loc.file)
  if text is None and os.path.isfile(loc.file):
    try:
      with open(loc.file, encoding="utf-8") as f:
        text = f.read()
    except (OSError, UnicodeDecodeError):
      text = None
  if text is None:
    return []
  src_lines = text.split("\n")
  if not 1 <= loc.line <= len(src_lines):
    return []
  line = src_lines[loc.line - 1].rstrip("\r")
  num = str(loc.line)
  pad = " " * (len(num) + 1)
  start = max(0, min(loc.col - 1, len(line)))
  if loc.end_line == loc.line and loc.end_col > loc.col:
    width = loc.end_col - loc.col
  else:
    width = max(1, len(line) - start)
  shown, caret_at, width = _window(line, start, width)
  return [f"{pad}|", f"{num} | {shown}", f"{pad}| {' ' * caret_at}{'^' * width}"]


# A quoted line longer than this is cut around the error's column, as rustc cuts it.
QUOTE_WIDTH = 100
_BEFORE = 40  # characters kept before the column when a line is cut


def _window(line: str, start: int, width: int) -> tuple[str, int, int]:
  """The part of `line` to quote: (text, where the caret starts in it, the caret's width).

  A line up to QUOTE_WIDTH characters is quoted whole; a longer one is cut to QUOTE_WIDTH
  characters around `start`, each cut side marked `...`, and the caret is clipped to what
  is shown.
  """
  if len(line) <= QUOTE_WIDTH:
    return line, start, max(1, width)
  lo = max(0, start - _BEFORE)
  hi = min(len(line), lo + QUOTE_WIDTH)
  lo = max(0, hi - QUOTE_WIDTH)
  head = "..." if lo > 0 else ""
  tail = "..." if hi < len(line) else ""
  return (head + line[lo:hi] + tail, len(head) + start - lo,
          max(1, min(width, hi - start)))


def nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
  """The candidates closest to `name`, best first (for "did you mean")."""
  return difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.5)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
  """A fix suggestion naming the nearest candidates, or "" when none is near."""
  near = nearest(name, candidates)
  if not near:
    return ""
  return "did you mean " + " or ".join(f"`{c}`" for c in near) + "?"

"""The one reader for a file a command reads whole: a bound on its size, its kind and its nesting.

A user names a prompt, a task list, a status file, a metrics stream or a model's
`config.json`; a hostile or careless name (a binary file, `/dev/zero`, a FIFO, a folder,
a 30 MB line, JSON nested 100,000 levels deep) must end in the caller's error code, never
a traceback, a hang or a read that fills memory. Every such read goes through here:

  read_bytes   a regular file's bytes, at most `limit`
  read_text    the same, decoded as UTF-8
  read_json    the same, parsed as JSON of a stated type and nesting depth
  read_lines   a text file line by line, each line and the whole file bounded

Each raises SxError with the code, fix and `where` its caller gives, so the message names
the flag or variable the path came from.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Iterator

from sexpgpu.errors import SxError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
DEPTH = 64  # JSON nesting any file sexpgpu reads stays far below
_BLOCK = 1 << 20


def size_text(n: int) -> str:
  """`n` bytes as a person reads it ("64 KiB", "1.5 GiB")."""
  for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
    if n >= size:
      value = n / size
      return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
  return f"{n} bytes"


class _Reader:
  """What a caller says about a file: its name in messages and the error it raises."""

  def __init__(self, path: str, what: str, code: str, fix: str | None, where: str | None):
    self.path, self.what, self.code, self.fix, self.where = path, what, code, fix, where

  def error(self, problem: str) -> SxError:
    return SxError(self.code, f"{self.what} {self.path}: {problem}", where=self.where,
                   fix=self.fix)

  def open(self) -> int:
    """A descriptor of the path, refused unless it is a regular file (checked on the open
    descriptor, so a file swapped for a FIFO after a look is still refused; O_NONBLOCK keeps
    the open of a FIFO from waiting for a writer)."""
    try:
      fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
      raise self.error("not found") from None
    except IsADirectoryError:
      raise self.error("is a folder, not a file") from None
    except OSError as e:
      raise self.error(f"cannot be read: {e.strerror or type(e).__name__}") from None
    except ValueError:  # a NUL in the name
      raise self.error("is no path (it holds a NUL character)") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      os.close(fd)
      raise self.error(f"is {_kind(mode)}, not a regular file")
    return fd


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                     (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                     (stat.S_ISSOCK, "a socket")):
    if test(mode):
      return name
  return "not a regular file"


def read_bytes(path: str, *, limit: int, what: str, code: str, fix: str | None = None,
               where: str | None = None) -> bytes:
  """A regular file's bytes, at most `limit` of them.

  Args:
    path: the file, as the user named it.
    limit: the most bytes the caller accepts; a larger file is refused after reading at
      most `limit + 1` bytes.
    what: the file's part in messages ("prompt file", "status file").
    code: the E-code raised; fix: its fix; where: the flag or variable the path came from.

  Returns:
    The file's bytes.

  Raises:
    SxError: `code` when the file is missing, not a regular file, unreadable or too large.
  """
  reader = _Reader(path, what, code, fix, where)
  fd = reader.open()
  chunks, total = [], 0
  try:
    while total <= limit:
      try:
        chunk = os.read(fd, min(_BLOCK, limit + 1 - total))
      except OSError as e:
        raise reader.error(f"cannot be read: {e.strerror or type(e).__name__}") from None
      if not chunk:
        break
      chunks.append(chunk)
      total += len(chunk)
  finally:
    os.close(fd)
  if total > limit:
    raise reader.error(f"is larger than {size_text(limit)}, the most read from one")
  return b"".join(chunks)


def _decoded(reader: _Reader, data: bytes) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise reader.error(f"is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None


def read_text(path: str, *, limit: int, what: str, code: str, fix: str | None = None,
              where: str | None = None) -> str:
  """A regular file's text (UTF-8), at most `limit` bytes: `read_bytes`, then decoded.

  Raises:
    SxError: `code` as `read_bytes` raises it, or when the bytes are not UTF-8.
  """
  data = read_bytes(path, limit=limit, what=what, code=code, fix=fix, where=where)
  return _decoded(_Reader(path, what, code, fix, where), data)


_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
          float: "a number", bool: "true or false", type(None): "null"}


def json_depth(value) -> int:
  """How deeply `value`'s arrays and objects nest (0 for a scalar), without recursion."""
  deepest, stack = 0, [(value, 1)]
  while stack:
    item, depth = stack.pop()
    if isinstance(item, dict):
      children = item.values()
    elif isinstance(item, list):
      children = item
    else:
      continue
    deepest = max(deepest, depth)
    stack.extend((c, depth + 1) for c in children)
  return deepest


def parse_json(text: str, reader: _Reader, kind: type | None = dict, depth: int = DEPTH):
  """`text` parsed as JSON of type `kind` nesting at most `depth` levels, or reader's error."""
  try:
    value = json.loads(text)
  except RecursionError:
    raise reader.error(f"nests deeper than {depth} levels") from None
  except ValueError as e:
    where = f" (line {e.lineno}, column {e.colno})" if hasattr(e, "lineno") else ""
    raise reader.error(f"is not JSON{where}: {getattr(e, 'msg', e)}") from None
  if kind is not None and not isinstance(value, kind):
    raise reader.error(f"holds {_TYPES.get(type(value), type(value).__name__)}, "
                       f"where {_TYPES[kind]} was expected")
  if json_depth(value) > depth:
    raise reader.error(f"nests deeper than {depth} levels")
  return value


def read_json(path: str, *, limit: int, what: str, code: str, kind: type | None = dict,
              depth: int = DEPTH, fix: str | None = None, where: str | None = None):
  """A regular file's JSON value: at most `limit` bytes, of type `kind`, `depth` levels deep.

  Returns:
    The parsed value (a dict when `kind` is dict, as by default).

  Raises:
    SxError: `code` as `read_text` raises it, or when the text is not JSON, holds another
      type than `kind`, or nests deeper than `depth`.
  """
  reader = _Reader(path, what, code, fix, where)
  return parse_json(read_text(path, limit=limit, what=what, code=code, fix=fix, where=where),
                    reader, kind, depth)


def read_lines(path: str, *, limit: int, line_limit: int, what: str, code: str,
               fix: str | None = None, where: str | None = None) -> Iterator[tuple[int, str]]:
  """A text file's lines as (line number from 1, text without its newline), read as they go.

  The whole file is held to `limit` bytes and each line to `line_limit`, so a file of one
  30 MB line or an endless one is refused after reading at most about `line_limit` bytes
  more than the lines already yielded.

  Raises:
    SxError: `code` when the file is missing, not a regular file, unreadable, larger than
      `limit`, holds a line longer than `line_limit`, or is not UTF-8.
  """
  reader = _Reader(path, what, code, fix, where)
  fd = reader.open()
  try:
    with os.fdopen(fd, "rb", closefd=False) as f:
      total = 0
      for number in range(1, 1 << 62):
        try:
          line = f.readline(line_limit + 1)
        except OSError as e:  # EIO from a /proc file, a disk going away
          raise reader.error(f"cannot be read at line {number}: "
                             f"{e.strerror or type(e).__name__}") from None
        if not line:
          return
        total += len(line)
        if total > limit:
          raise reader.error(f"is larger than {size_text(limit)}, the most read from one")
        if len(line) > line_limit and not line.endswith(b"\n"):
          raise reader.error(f"line {number} is longer than {size_text(line_limit)}")
        yield number, _decoded(reader, line).rstrip("\r\n")
  finally:
    os.close(fd)

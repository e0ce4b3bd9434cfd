"""The `jsonl:PATH` target: one compact JSON event per line, appended."""

from __future__ import annotations

import json
import os
import sys

from sexpgpu.paths import scrub
from sexpgpu.track.events import to_json
from sexpgpu.track.targets import TargetError, ensure_dir, os_reason


class JsonlTarget:
  """Appends events to a file, one line each, flushed as written.

  A resume opens the same file and continues it. Each line is written with a
  single `write` and flushed, so a reader polling the file sees whole lines
  (a partial last line only while a write is in flight). Keys keep the
  event's order; a non-finite number is written as NaN or Infinity, as
  Python's json module reads them. A last line cut off (a full disk, a kill
  mid-write) is dropped before appending, so every line stays one event; a
  write that fails is taken back, so the file ends with a whole line.
  """

  def __init__(self, spec: str, path: str, slug: str):
    self.spec = spec
    self.location = path
    try:
      parent = os.path.dirname(os.path.abspath(path))
      ensure_dir(parent)
      self.repaired = repair(path)
      self._file = open(path, "a", encoding="utf-8")
      self._size = os.fstat(self._file.fileno()).st_size  # where the next line starts
    except OSError as e:
      raise TargetError(f"cannot open metrics file {path}: {os_reason(e)}",
                        "give a file path in a directory you can write") from e

  def write(self, event: dict) -> None:
    """Appends the event as one line and flushes it."""
    line = json.dumps(event, separators=(",", ":"), default=to_json)
    try:
      self._file.write(line + "\n")
      self._file.flush()
    except OSError as e:
      self._take_back(self._size)
      raise TargetError(f"cannot write metrics file {self.location}: "
                        f"{os_reason(e)}") from e
    self._size += len(line) + 1  # json.dumps writes ASCII: a character a byte

  def _take_back(self, size: int) -> None:
    """After a failed write: the file cut back to its last whole line, reopened."""
    try:
      self._file.close()
    except OSError:
      pass  # the buffer that failed to flush fails again: it is dropped
    try:
      os.truncate(self.location, size)
      self._file = open(self.location, "a", encoding="utf-8")
    except OSError:
      pass

  def close(self) -> None:
    """Closes the file."""
    try:
      self._file.close()
    except OSError:
      pass


def repair(path: str) -> int:
  """Cuts a partial last line off a jsonl file, saying so on standard error.

  Returns:
    The bytes dropped (0 when the file is missing, empty or ends with a newline).
  """
  try:
    with open(path, "rb+") as f:
      end = f.seek(0, os.SEEK_END)
      if end == 0:
        return 0
      f.seek(end - 1)
      if f.read(1) == b"\n":
        return 0
      cut, at = 0, end
      while at > 0:  # back from the end, a chunk at a time, to the last newline
        start = max(0, at - (1 << 20))
        f.seek(start)
        chunk = f.read(at - start)
        if b"\n" in chunk:
          cut = start + chunk.rfind(b"\n") + 1
          break
        at = start
      f.truncate(cut)
  except FileNotFoundError:
    return 0
  print(f"metrics: {scrub(path)} ended in a cut-off line ({end - cut} bytes, no whole event); "
        "removed it before appending", file=sys.stderr, flush=True)
  return end - cut

"""The `jsonl:PATH` target: one compact JSON event per line, appended."""

from __future__ import annotations

import json
import os

from sexpgpu.track.events import to_json
from sexpgpu.track.targets import TargetError, ensure_dir, os_reason


class JsonlTarget:
  """Appends events to a file, one line each, flushed as written.

  A resume opens the same file and continues it. Each line is written with a
  single `write` and flushed, so a reader polling the file sees whole lines
  (a partial last line only while a write is in flight). Keys keep the
  event's order; a non-finite number is written as NaN or Infinity, as
  Python's json module reads them.
  """

  def __init__(self, spec: str, path: str, slug: str):
    self.spec = spec
    self.location = path
    try:
      parent = os.path.dirname(os.path.abspath(path))
      ensure_dir(parent)
      self._file = open(path, "a", encoding="utf-8")
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
      raise TargetError(f"cannot write metrics file {self.location}: "
                        f"{os_reason(e)}") from e

  def close(self) -> None:
    """Closes the file."""
    self._file.close()

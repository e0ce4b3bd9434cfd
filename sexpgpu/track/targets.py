"""The shape every metrics target has, and the error a target raises."""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from typing import Iterator, Protocol


class TargetError(Exception):
  """A target that cannot be opened or written; becomes E-METRICS-001.

  Attributes:
    message: what went wrong, naming the target.
    fix: how to fix it, or None.
  """

  def __init__(self, message: str, fix: str | None = None):
    super().__init__(message)
    self.message = message
    self.fix = fix


class Target(Protocol):
  """One place events go: a jsonl file, a TensorBoard log, an MLflow run."""

  spec: str       # the target as given, "jsonl:/tmp/x.jsonl"
  location: str   # the path or URI after the scheme

  def write(self, event: dict) -> None:
    """Records one event (kind, fields, slug, time)."""

  def close(self) -> None:
    """Flushes and closes; called once."""


def os_reason(error: OSError) -> str:
  """An OSError's reason with the path it concerns: "Not a directory: /a/b"."""
  reason = error.strerror or str(error)
  return f"{reason}: {error.filename}" if error.filename else reason


def ensure_dir(directory: str) -> None:
  """Creates `directory` and its parents; a file in the way is ENOTDIR."""
  try:
    os.makedirs(directory, exist_ok=True)
  except FileExistsError as e:
    raise NotADirectoryError(errno.ENOTDIR, "Not a directory",
                             e.filename) from e


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
  """Keeps a tracker library's Python warnings off standard error."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    yield

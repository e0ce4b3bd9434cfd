"""The `--status` file: one JSON object, replaced atomically, throttled."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.paths import scrub, scrubbed, write_atomic
from sexpgpu.track.events import to_json
from sexpgpu.track.targets import ensure_dir, os_reason

# While training, the file is rewritten at most this often (seconds).
THROTTLE_SECONDS = 1.0
STATES = ("compiling", "running", "evaluating", "checkpointing", "stopped",
          "done", "failed")


class StatusFile:
  """The status object and the file it is written to.

  The object's fields (the training loop fills them): slug, pid, state
  (one of STATES), step, steps, stage, train_loss, last_pass {},
  counters {}, started_at, updated_at, steps_per_second, eta_seconds,
  checkpoint {step, location} or None, error {code, message} or None.
  Every write sets `updated_at` (unix seconds). With no path nothing is
  written, but the object is still kept.
  """

  def __init__(self, path: str | None, where: str = "--status"):
    """Args: path: the local file to keep the status in, or None; where: its flag.

    Raises:
      SxError: E-METRICS-001 when `path` is a remote location (it would become a local
        folder named `s3:`).
    """
    if path is not None and "://" in path:
      raise SxError("E-METRICS-001", f"the status file {scrub(path)} is a remote location; "
                    "it is a local file, replaced several times a second", where=where,
                    fix="give --status a path on a local disk (sexpgpu watch reads it there)")
    self.path = path
    self.where = where
    self.last: dict[str, Any] = {}
    self._written_at: float | None = None

  def write(self, status: dict) -> None:
    """Replaces the status with `status` and writes it.

    Args:
      status: the whole status object.

    Raises:
      SxError: E-METRICS-001 when the file cannot be written.
    """
    self.last = dict(status)
    self.last["updated_at"] = time.time()
    if self.path is None:
      return
    try:
      _replace(self.path, json.dumps(scrubbed(self.last), default=to_json))
    except OSError as e:
      raise SxError("E-METRICS-001",
                    f"cannot write status file {scrub(self.path)}: {scrub(os_reason(e))}",
                    where=self.where,
                    fix="give a file path in a directory you can write") from e

  def update(self, **fields) -> None:
    """Merges `fields` into the last status and writes it.

    Raises:
      SxError: E-METRICS-001 when the file cannot be written.
    """
    self.write({**self.last, **fields})

  def maybe_update(self, now: float, force: bool = False, **fields) -> bool:
    """Merges `fields`, writing at most once per THROTTLE_SECONDS.

    The fields are kept even when nothing is written, so the next write
    carries them.

    Args:
      now: a clock reading in seconds (time.monotonic()); only differences
        between calls matter.
      force: write regardless of the throttle (a phase change).
      **fields: status fields to merge.

    Returns:
      Whether the file was written.

    Raises:
      SxError: E-METRICS-001 when the file cannot be written.
    """
    due = (self._written_at is None
           or now - self._written_at >= THROTTLE_SECONDS)
    if not (force or due):
      self.last.update(fields)
      return False
    self.update(**fields)
    self._written_at = now
    return True


def read_status(path: str) -> dict:
  """Reads a status file (the `watch` command's side).

  Args:
    path: the status file.

  Returns:
    The status object; always whole, since writers replace the file.

  Raises:
    SxError: E-METRICS-001 when it is missing (no status written yet), no regular file,
      larger than STATUS_LIMIT, or not a JSON object.
  """
  from sexpgpu import bounded
  return bounded.read_json(path, limit=STATUS_LIMIT, what="status file", code="E-METRICS-001",
                           where=path, fix="give the --status file a run writes")


STATUS_LIMIT = 1 << 20  # a run's status object is a few hundred bytes


def _replace(path: str, text: str) -> None:
  """Writes `text` beside `path`, syncs it, then renames it over `path`."""
  ensure_dir(os.path.dirname(os.path.abspath(path)))
  write_atomic(path, text + "\n", sync=True)

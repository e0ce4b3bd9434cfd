"""Where a run's events go: `--metrics` parsed into targets, and emit."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.paths import scrub
from sexpgpu.track.jsonl_target import JsonlTarget
from sexpgpu.track.mlflow_target import MlflowTarget
from sexpgpu.track.targets import Target, TargetError
from sexpgpu.track.tensorboard_target import TensorBoardTarget

CODE = "E-METRICS-001"
_FORMS = "jsonl:PATH, tensorboard:DIR or mlflow:URI, several joined by commas"

# The schemes whose location is a local path (a URI there would make a folder `s3:`).
LOCAL_SCHEMES = ("jsonl", "tensorboard")
# scheme → target class, each built as cls(spec, location, slug).
SCHEMES: dict[str, Callable[[str, str, str], Target]] = {
    "jsonl": JsonlTarget,
    "tensorboard": TensorBoardTarget,
    "mlflow": MlflowTarget,
}


class Metrics:
  """The session's metrics targets; emit sends one event to all of them.

  An event is a flat JSON object: `kind` first, then the fields in the order
  given, then `slug` (unless a field already set it) and `time` (unix
  seconds). A Metrics without targets accepts events and writes nothing.
  """

  def __init__(self, targets: list[Target], slug: str, where: str):
    self._targets = targets
    self._slug = slug
    self._where = where
    self._closed = False
    # Checkpoint callbacks may emit from a writer thread.
    self._lock = threading.Lock()

  def describe(self) -> str | None:
    """The text of the `metrics: <target>` line: the targets as given.

    Returns:
      The spec, several joined by commas, or None when there is no target.
    """
    if not self._targets:
      return None
    return ",".join(scrub(t.spec) for t in self._targets)

  def summary_path(self) -> str | None:
    """The summary's `metrics` field.

    Returns:
      The path of the (first) jsonl target, else the first target's path or
      URI, else None.
    """
    for target in self._targets:
      if isinstance(target, JsonlTarget):
        return target.location
    return scrub(self._targets[0].location) if self._targets else None

  def emit(self, kind: str, **fields) -> dict:
    """Sends one event to every target.

    Args:
      kind: the event kind (config, annotation, step, pass, stage,
        diagnostic, checkpoint, summary).
      **fields: the event's fields, `step` among them where one applies.
        Names with `/` (such as `train/loss`) pass through `**{...}`.

    Returns:
      The event as written.

    Raises:
      SxError: E-METRICS-001 when a target cannot be written.
    """
    event = {"kind": kind, **fields}
    event.setdefault("slug", self._slug)
    event["time"] = time.time()
    with self._lock:
      if self._closed:
        return event
      for target in self._targets:
        with _as_sx_error(target.spec, self._where):
          target.write(event)
    return event

  def close(self) -> None:
    """Flushes and closes every target; later calls do nothing.

    Raises:
      SxError: E-METRICS-001 when a target fails to close (all are tried).
    """
    with self._lock:
      if self._closed:
        return
      self._closed = True
      failure = None
      for target in self._targets:
        try:
          with _as_sx_error(target.spec, self._where):
            target.close()
        except SxError as e:
          failure = failure or e
    if failure is not None:
      raise failure

  def __enter__(self) -> "Metrics":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def open_metrics(spec: str | None, slug: str,
                 where: str = "--metrics") -> Metrics:
  """Parses a metrics spec and opens its targets.

  Args:
    spec: `jsonl:PATH`, `tensorboard:DIR`, `mlflow:URI`, or several joined by
      commas; None or "" for no target.
    slug: the run slug (TensorBoard subdirectory, MLflow experiment name).
    where: the flag or variable the spec came from, for errors.

  Returns:
    A Metrics; one with no targets when spec is empty.

  Raises:
    SxError: E-METRICS-001 for a spec that does not parse, a target that
      cannot be opened or created, or MLflow not installed. Targets already
      opened are closed first.
  """
  pieces = parse(spec, where)
  targets: list[Target] = []
  try:
    for piece, scheme, location in pieces:
      with _as_sx_error(piece, where):
        targets.append(SCHEMES[scheme](piece, location, slug))
  except SxError:
    for target in targets:
      _close_quietly(target)
    raise
  return Metrics(targets, slug, where)


def parse(spec: str | None, where: str) -> list[tuple[str, str, str]]:
  """Splits a metrics spec into (piece, scheme, location) triples.

  Raises:
    SxError: E-METRICS-001 for an empty piece, a missing or unknown scheme,
      an empty location, or the same target twice.
  """
  if spec is None or not spec.strip():
    return []
  triples = []
  for piece in (p.strip() for p in spec.split(",")):
    triples.append(_parse_piece(piece, spec, where))
  seen = set()
  for piece, _, _ in triples:
    if piece in seen:
      raise _error(f"metrics target `{scrub(piece)}` given twice", where,
                   "name each target once")
    seen.add(piece)
  return triples


def _parse_piece(piece: str, spec: str, where: str) -> tuple[str, str, str]:
  if not piece:
    raise _error(f"empty metrics target in `{scrub(spec)}`", where,
                 f"write {_FORMS}, with no empty entry between commas")
  scheme, colon, location = piece.partition(":")
  if not colon:
    raise _error(f"metrics target `{scrub(piece)}` has no scheme", where,
                 f"write {_FORMS}, e.g. jsonl:{piece}")
  if scheme not in SCHEMES:
    hint = did_you_mean(scheme, SCHEMES)
    raise _error(f"unknown metrics scheme `{scrub(scheme)}` in `{scrub(piece)}`", where,
                 (hint + " " if hint else "") + f"targets are {_FORMS}")
  if not location.strip():
    raise _error(f"metrics target `{scrub(piece)}` has no location", where,
                 f"write {_FORMS}")
  if scheme in LOCAL_SCHEMES and "://" in location:
    raise _error(f"metrics target `{scrub(piece)}`: {scheme} writes a local "
                 f"{'file' if scheme == 'jsonl' else 'folder'}, and "
                 f"{scrub(location)} is a remote location", where,
                 f"write {scheme}:PATH on a local disk (and copy it to the store when the run "
                 "ends), or log to mlflow:URI")
  return piece, scheme, location


def _error(message: str, where: str, fix: str) -> SxError:
  return SxError(CODE, message, where=where, fix=fix)


@contextlib.contextmanager
def _as_sx_error(piece: str, where: str) -> Iterator[None]:
  """Turns a TargetError raised inside into E-METRICS-001 naming the target."""
  try:
    yield
  except TargetError as e:
    raise SxError(CODE, f"metrics target `{scrub(piece)}`: {scrub(e.message)}", where=where,
                  fix=scrub(e.fix) if e.fix else f"write {_FORMS}") from e


def _close_quietly(target: Target) -> None:
  try:
    target.close()
  except Exception:  # Already failing; the first error is the one to show.
    pass

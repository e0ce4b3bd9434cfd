"""Where a run's events go: `--metrics` parsed into targets, and emit."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Callable, Iterator

from sexpgpu.env import METRICS_FORMS, parse_metrics
from sexpgpu.errors import SxError
from sexpgpu.paths import scrub, scrubbed
from sexpgpu.track.jsonl_target import JsonlTarget
from sexpgpu.track.mlflow_target import MlflowTarget
from sexpgpu.track.targets import Target, TargetError
from sexpgpu.track.tensorboard_target import TensorBoardTarget
from sexpgpu.track.wandb_target import WandbTarget

CODE = "E-METRICS-001"
# scheme → target class, each built as cls(spec, location, slug); env.METRICS_SCHEMES, which
# parses a spec, names the same schemes (tests/test_env.py).
SCHEMES: dict[str, Callable[[str, str, str], Target]] = {
    "jsonl": JsonlTarget,
    "tensorboard": TensorBoardTarget,
    "mlflow": MlflowTarget,
    "wandb": WandbTarget,
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
        return scrub(target.location)
    return scrub(self._targets[0].location) if self._targets else None

  def folder(self) -> str | None:
    """A local folder beside the metrics stream for the files a run makes (a defgenerate's
    samples): `PATH.files` beside the first jsonl target `PATH.jsonl`, else the first
    TensorBoard target's log dir `DIR/<slug>`; None without either."""
    for target in self._targets:
      if isinstance(target, JsonlTarget):
        return os.path.splitext(target.location)[0] + ".files"
    for target in self._targets:
      if isinstance(target, TensorBoardTarget):
        return target.logdir
    return None

  def emit(self, kind: str, **fields) -> dict:
    """Sends one event to every target, its strings scrubbed of credentials (paths.scrub:
    the one place every target's events pass).

    Args:
      kind: the event kind (config, annotation, step, pass, eval, sample,
        stage, diagnostic, checkpoint, summary).
      **fields: the event's fields, `step` among them where one applies.
        Names with `/` (such as `train/loss`) pass through `**{...}`.

    Returns:
      The event as written.

    Raises:
      SxError: E-METRICS-001 when a target cannot be written.
    """
    # The kind is ours and the run's slug is whole (sweep matches it; make_slug keeps out
    # credentials): the fields alone are scrubbed, a step's numbers in one short walk.
    event = {"kind": kind, **scrubbed(fields)}
    event.setdefault("slug", self._slug)
    if fields.get("slug") == self._slug:
      event["slug"] = self._slug
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
    spec: `jsonl:PATH`, `tensorboard:DIR`, `mlflow:URI`, `wandb:PROJECT[/RUN]`, or
      several joined by commas; None or "" for no target.
    slug: the run slug (TensorBoard subdirectory, MLflow experiment name, W&B run name and
      id).
    where: the flag or variable the spec came from, for errors.

  Returns:
    A Metrics; one with no targets when spec is empty.

  Raises:
    SxError: E-METRICS-001 for a spec that does not parse, a target that
      cannot be opened or created, or MLflow or wandb not installed. Targets already
      opened are closed first.
  """
  pieces = parse_metrics(spec, where)
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


@contextlib.contextmanager
def _as_sx_error(piece: str, where: str) -> Iterator[None]:
  """Turns a TargetError raised inside into E-METRICS-001 naming the target."""
  try:
    yield
  except TargetError as e:
    raise SxError(CODE, f"metrics target `{scrub(piece)}`: {scrub(e.message)}", where=where,
                  fix=scrub(e.fix) if e.fix else f"write {METRICS_FORMS}") from e


def _close_quietly(target: Target) -> None:
  try:
    target.close()
  except Exception:  # Already failing; the first error is the one to show.
    pass

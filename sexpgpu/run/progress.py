"""What a run has done so far, and the two records that say it: the status file's object and
the summary (the `--json` line and the metrics stream's last event)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any


@dataclasses.dataclass
class Summary:
  """The run's final summary (the `--json` object)."""

  steps: int
  train_loss: float | None
  eval: dict[str, float]
  counters: dict[str, int]
  stage: int
  metrics: str | None
  status: str | None
  slug: str
  stopped_by: str | None
  checkpoint: str | None
  exit_code: int = 0
  goodput: float | None = None
  # Reads the final parameters to the host (path → array) when asked: Run.params in the API.
  read_params: Any = dataclasses.field(default=None, repr=False, compare=False)

  def as_dict(self) -> dict:
    return {"kind": "summary", "steps": self.steps, "train_loss": self.train_loss,
            "eval": self.eval, "counters": self.counters, "stage": self.stage,
            "metrics": self.metrics, "status": self.status, "slug": self.slug,
            "stopped_by": self.stopped_by, "checkpoint": self.checkpoint,
            "goodput": self.goodput}


@dataclasses.dataclass
class Progress:
  """What the run has done so far: what the status file, the meta and the summary say.

  The status object's fields are `base` (slug, pid, steps, stage, started_at, error,
  checkpoint, goodput, stopped_by) and those set_status() adds (state, step, train_loss,
  last_pass, counters, steps_per_second, eta_seconds); the StatusFile adds updated_at.
  """

  steps: int
  status: Any  # the StatusFile
  base: dict
  stage: int = 0
  counters: dict = dataclasses.field(default_factory=lambda: {"records": 0})
  last_pass: dict = dataclasses.field(default_factory=dict)
  train_loss: float | None = None
  # the step whose passes a stop cut short (checkpointed, so a resume runs them again)
  passes_unfinished: int | None = None
  step_times: list = dataclasses.field(default_factory=list)
  pass_times: dict = dataclasses.field(default_factory=dict)
  first_pass: dict = dataclasses.field(default_factory=dict)
  last_ckpt: str | None = None
  t_first_step: float | None = None
  state: str | None = None  # the phase last written
  flops: list = dataclasses.field(default_factory=list)  # model flops of a step, per stage
  peak: float | None = None  # the device's peak flop/s (MFU's denominator)

  @classmethod
  def begin(cls, slug: str, steps: int, status, passes) -> "Progress":
    """A run's progress at its start; writes the status `compiling`.

    Args:
      slug: the run's slug.
      steps: the steps it will train.
      status: the StatusFile (one without a path writes nothing).
      passes: the experiment's pass names.
    """
    base = {"slug": slug, "pid": os.getpid(), "steps": steps, "stage": 0,
            "started_at": time.time(), "error": None, "checkpoint": None, "goodput": None,
            "stopped_by": None}
    progress = cls(steps, status, base, pass_times={p: [] for p in passes})
    status.write({**base, "state": "compiling", "step": 0, "train_loss": None, "last_pass": {},
                  "counters": {}, "steps_per_second": None, "eta_seconds": None})
    return progress

  def set_status(self, state: str, step: int, force: bool = True) -> None:
    """Writes the status file: at once when the phase changes or `force`, else at most once
    a second (the StatusFile's throttle)."""
    sps = eta = None
    if self.step_times:
      sps = 1.0 / max(statistics.median(self.step_times[-20:]), 1e-9)
      eta = (self.steps - step) / sps
    changed, self.state = state != self.state, state
    self.status.maybe_update(time.monotonic(), force=force or changed,
                             **dict(self.base, state=state, step=step,
                                    train_loss=self.train_loss, last_pass=dict(self.last_pass),
                                    counters=dict(self.counters), steps_per_second=sps,
                                    eta_seconds=eta))

  def failed(self, code: str, message: str) -> None:
    """The status `failed`, with the error's code and message."""
    self.status.update(state="failed", error={"code": code, "message": message})

  def checkpointed(self, step: int, location: str) -> None:
    """Records the last checkpoint, saved or restored (the status file's `checkpoint`)."""
    self.last_ckpt = location
    self.base["checkpoint"] = {"step": step, "location": location}

  def since_first_step(self) -> float:
    """Seconds since the first step began (0 before it): the progress line's last field."""
    return 0.0 if self.t_first_step is None else time.perf_counter() - self.t_first_step


def stopped_at_start(previous, stopped_by: str) -> dict:
  """The status object of a run that a signal stopped during start-up.

  Args:
    previous: what the status file held (the `compiling` object this process wrote, or
      anything else, which is replaced).
    stopped_by: the signal's name.
  """
  ours = isinstance(previous, dict) and previous.get("pid") in (None, os.getpid())
  status = dict(previous) if ours else {}
  now = time.time()
  status.update(pid=os.getpid(), state="stopped", stopped_by=stopped_by, updated_at=now,
                error=None)
  status.setdefault("started_at", now)
  status.setdefault("step", 0)
  return status

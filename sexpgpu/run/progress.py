"""What a run has done so far, and the two records that say it: the status file's object and
the summary (the `--json` line and the metrics stream's last event)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import time
from typing import Any

from sexpgpu.run import output


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


# JAX's monitoring event of one XLA compile: a scalar at its start, a duration at its end,
# each with the jitted function's name (a persistent-cache hit passes here too).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# A compile shows once it has run this long (a cache hit is done sooner); the line stays
# this long after the last one ends, so that the next does not make it flicker.
SHOW_AFTER_S = 0.1
LINGER_S = 0.5
# The jitted functions a run compiles, as the line names them (lower/step.py, fsdp.py).
COMPILING = {"_full_step": "the train step", "_dp_step": "the train step",
             "_sharded_full": "the train step", "_apply": "the update",
             "_dp_update": "the update", "_sharded_update": "the update",
             "_chunk_grads": "a microbatch's gradients", "_sharded_chunk":
             "a microbatch's gradients", "_zeros": "the accumulators",
             "_sharded_zeros": "the accumulators", "_metrics": "a pass's metrics",
             "initial_state": "the initial state", "<lambda>": "a small function"}


class CompileLine:
  """On a terminal, a transient line on standard error while XLA compiles: what, how many
  executables the run has built so far, and the seconds spent compiling since the first.

  It is erased before any other line is written there (output.write), when the compiles
  stop, and at close; off a terminal it is never started, and the run's lines are the same
  byte for byte.
  """

  _listening = False
  _active: "CompileLine | None" = None

  def __init__(self, stream):
    self.stream = stream
    self.lock = threading.RLock()
    self._cond = threading.Condition(self.lock)
    self.built = 0
    self.current: str | None = None  # the latest compile that is still running
    self._running: list[tuple[str, float]] = []  # (name, start): compiles run in threads too
    self._since = 0.0  # the current compile's start (monotonic)
    self._ended = 0.0  # the last compile's end
    self._first: float | None = None
    self._shown = False
    self._closed = False
    self._thread = threading.Thread(target=self._tick, name="sexpgpu-compile-line",
                                    daemon=True)

  @classmethod
  def start(cls, stream=None) -> "CompileLine | None":
    """Starts the line when `stream` (standard error by default) is a terminal.

    Returns:
      The CompileLine (close it at the run's end), or None off a terminal.
    """
    stream = sys.stderr if stream is None else stream
    try:
      if not stream.isatty():
        return None
    except (AttributeError, ValueError, OSError):
      return None
    if not cls._listening:
      import jax
      jax.monitoring.register_scalar_listener(
          lambda event, value, **kw: cls._on(event, kw, True))
      jax.monitoring.register_event_duration_secs_listener(
          lambda event, secs, **kw: cls._on(event, kw, False))
      cls._listening = True
    line = cls(stream)
    cls._active = line
    output.TRANSIENT[:] = [line]
    line._thread.start()
    return line

  @classmethod
  def _on(cls, event: str, kw: dict, started: bool) -> None:
    line = cls._active
    if line is None or event != BACKEND_COMPILE:
      return
    name = str(kw.get("fun_name", ""))
    with line._cond:
      now = time.monotonic()
      if started:
        line._running.append((name, now))
        line._first = now if line._first is None else line._first
      else:
        line.built += 1
        line._ended = now
        ended = next((i for i, (n, _) in enumerate(line._running) if n == name), 0)
        if line._running:
          del line._running[ended]
      line.current, line._since = line._running[-1] if line._running else (None, line._since)
      line._cond.notify()

  def text(self, now: float) -> str:
    """The line as it reads at `now` (monotonic seconds)."""
    names = [n for n, _ in self._running[::-1]] or [self.current or ""]
    what = ", ".join(dict.fromkeys(COMPILING.get(n, n or "-") for n in (
        n.removeprefix("jit(").removesuffix(")") for n in names)))
    secs = now - (self._first if self._first is not None else now)
    return (f"compiling {what}: {self.built} executable{'s' if self.built != 1 else ''} "
            f"built, {secs:.1f}s")

  def _tick(self) -> None:
    with self._cond:
      while not self._closed:
        now = time.monotonic()
        if self.current is not None and now - self._since >= SHOW_AFTER_S:
          self._draw(self.text(now))
          self._cond.wait(0.25)
        elif self.current is not None:
          self._cond.wait(SHOW_AFTER_S - (now - self._since))
        elif self._shown and now - self._ended < LINGER_S:
          self._cond.wait(LINGER_S - (now - self._ended))
        else:
          self.erase()
          self._cond.wait()

  def _draw(self, text: str) -> None:
    cut = text[:max(output.width() - 1, 10)]
    try:
      self.stream.write("\r\x1b[K" + cut)
      self.stream.flush()
      self._shown = True
    except (OSError, ValueError):
      self._closed = True

  def erase(self) -> None:
    """Erases the line when it shows (the caller holds `lock` or is its thread)."""
    with self.lock:
      if self._shown:
        self._shown = False
        try:
          self.stream.write("\r\x1b[K")
          self.stream.flush()
        except (OSError, ValueError):
          self._closed = True

  def close(self) -> None:
    """Erases the line and stops its thread."""
    with self._cond:
      self._closed = True
      self.erase()
      self._cond.notify()
    self._thread.join(timeout=2)
    with self.lock:
      if CompileLine._active is self:
        CompileLine._active = None
        output.TRANSIENT[:] = []

"""The run's passes: evaluation passes with their progress lines, defeval and defsample
passes, and the curriculum stage that the passes' numbers decide."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder
from sexpgpu.front.values import Env
from sexpgpu.run import output, signals
from sexpgpu.run.stepping import quiet


# A pass that runs longer than this says how far it has come, every this many seconds.
PASS_PROGRESS_SECONDS = 10.0


def _duration(seconds: float) -> str:
  """`42 s`, `17 min`, `5.2 h` or `3.1 days`: how long the rest of a pass takes."""
  for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
    if seconds >= 2 * size:
      return f"{seconds / size:.1f} {unit}" if unit != "min" else f"{seconds / size:.0f} min"
  return f"{seconds:.0f} s"


def due(p, step: int, c) -> bool:
  """Whether pass `p` runs after `step` (`--eval-every` replaces every pass's :every)."""
  every = p.every if c.exp.run.get("eval-every") is None else c.exp.run.get("eval-every")
  return bool(every) and step % every == 0


class Passes:
  """Runs the passes due at a step, and moves the curriculum on when its condition holds."""

  def __init__(self, ctx, samplers, evaluators, resumed_at: int | None, generators=None):
    """Args: ctx: the RunContext (the experiment, its Training, where the numbers go);
    samplers: its Samplers; evaluators: its Evaluators (defeval); resumed_at: the step a
    resume starts at (its passes ran before the checkpoint), else None; generators: its
    Generators (defgenerate), or None."""
    self.ctx, self.c, self.training = ctx, ctx.c, ctx.training
    self.samplers, self.evaluators, self.generators = samplers, evaluators, generators
    progress = ctx.out.progress
    self.metrics, self.progress, self.log = ctx.out.metrics, progress, ctx.out.log
    # a resume at a step whose passes a stop cut short runs them again, all of them, and
    # then the curriculum's decision they feed (first())
    self.redo = resumed_at if resumed_at is not None and (
        progress.passes_unfinished == resumed_at) else None
    self.resumed_at = None if self.redo is not None else resumed_at
    progress.passes_unfinished = None

  def due(self, step: int, at_end: bool) -> bool:
    """Whether any pass, sample or generation runs after `step`."""
    return (at_end or any(due(p, step, self.c) for p in self.c.exp.passes.values())
            or self.samplers.due(step, at_end) or self.evaluators.due(step, at_end)
            or (self.generators is not None and self.generators.due(step, at_end)))

  def first(self, state, step: int, feed, stop) -> None:
    """The passes due as the loop starts (step 0's evaluation, or a resumed step's that a
    stop cut short), unless a stop came during start-up (none runs after it); from then on
    a stop signal is only recorded, and the loop takes it at a step boundary
    (signals.loop_started). When the curriculum moves on then, `feed` (the run's Feed)
    restarts its loaders for the new stage."""
    if not stop.here():
      ran = self.run(state, step, step == self.progress.steps, feed.lock)
      if ran and step == self.redo and self.progress.passes_unfinished is None and (
          self.advance(step)):
        feed.restart(self.progress.stage, step)
    signals.loop_started()

  def run(self, state, step: int, at_end: bool, lock) -> bool:
    """Every pass and sample due at `step`, holding `lock` (the loader's, which a pass may
    read); returns whether an evaluation pass ran."""
    place = self.training.place
    # A pass gathers sharded parameters over the nodes: gloo announces each new group of
    # peers on our output when a pass first runs its collectives.
    with quiet(place.multiprocess and self.training.sharding != "replicate"):
      with lock:
        ran = self._evaluate(state, step, at_end)
      if self.progress.passes_unfinished == step:
        return False  # cut short by a stop: the rest run again on resume, none now
      for kind in (self.evaluators, self.samplers, self.generators):
        if kind is not None:
          kind.run(self.ctx, state["params"], step, at_end, self.resumed_at)
    return ran

  def _evaluate(self, state, step: int, at_end: bool) -> bool:
    c, training, progress = self.c, self.training, self.progress
    place = training.place
    ran = False
    for name, p in c.exp.passes.items():
      if not (due(p, step, c) or at_end) or step == self.resumed_at:
        continue
      progress.set_status("evaluating", step)
      t = time.perf_counter()
      sums = self._batches(name, p, state, step, t)
      if sums is None:  # a stop came during the pass: it has no numbers, and the loop stops;
        progress.passes_unfinished = step  # the checkpoint says so, and a resume redoes them
        return False
      # host sync: the progress line needs the numbers
      values = {f"{name}/{mname}": float(place.host(sums[mname])) / p.batches
                for mname, _ in p.metrics}
      dt = time.perf_counter() - t
      if name in progress.first_pass:
        progress.pass_times[name].append(dt)
      else:
        progress.first_pass[name] = dt
      progress.last_pass.update(values)
      self.metrics.emit("pass", step=step, **{"pass": name, "metrics": values, "time/pass": dt})
      self.log(output.progress_line(name, step, values, progress))
      bad = [m for m, v in values.items() if not np.isfinite(v)]
      if bad and training.on_nan == "stop":
        # The steps' guard keeps a non-finite update out; a finite but diverged state can
        # still evaluate to inf or nan, and a run must not end as if that were a result.
        raise SxError("E-NUM-001", f"{', '.join(bad)} is not finite at step {step}",
                      where=c.program.path, fix="lower the learning rate or add :clip; the "
                      "last checkpoint before this step is intact")
      ran = True
    return ran

  def _batches(self, name: str, p, state, step: int, t: float) -> dict | None:
    """The sums of pass `name`'s metrics over its batches; a line every
    PASS_PROGRESS_SECONDS when it runs long; None when a stop signal came while it ran long
    (on one process: the nodes of a run over several finish the pass together). A pass
    that has not yet run long finishes first, as a step does: a resume skips the passes of
    the step it resumes, so a stop at a step whose pass decides the curriculum must not
    lose that pass."""
    training, place = self.training, self.training.place
    loader = self.c.loaders[p.data]
    sums: dict[str, Any] = {}
    told = t
    for i in range(p.batches):
      if signals.FLAG.received is not None and told > t and not place.multiprocess:
        self.log(f"{name}: stopped by {signals.FLAG.name} after {i} of {p.batches} batches "
                 f"at step {step}; the pass's numbers are not written")
        return None
      batch = place.replicate(loader.batch(i))
      vals = training.pass_steps[name](state["params"], batch, i)
      for mname, v in vals.items():
        sums[mname] = v if mname not in sums else sums[mname] + v
      now = time.perf_counter()
      if now - told >= PASS_PROGRESS_SECONDS and i + 1 < p.batches:
        jax.block_until_ready(sums)  # host sync: the line counts batches computed
        now = time.perf_counter()
        rate = (i + 1) / (now - t)
        self.log(f"{name}: batch {i + 1}/{p.batches} at step {step}, {rate:.1f} batches/s, "
                 f"about {_duration((p.batches - i - 1) / rate)} left")
        told = now
    return sums

  def advance(self, step: int) -> bool:
    """Moves to the next curriculum stage when its condition holds; returns whether it did."""
    stages, progress = self.c.stages, self.progress
    if progress.stage + 1 >= len(stages):
      return False
    nxt = stages[progress.stage + 1]
    env = Env(self.c.exp.env, dict(progress.last_pass))
    try:
      holds = Builder(env).eval(nxt.when, env)
    except SxError as e:
      if e.code == "E-NAME-001":
        return False  # a metric the condition names has not been measured yet
      raise
    if holds is None or holds is False:
      return False
    self.metrics.emit("stage", step=step, **{"from": progress.stage, "to": progress.stage + 1,
                                             "reason": str(nxt.when)})
    progress.stage += 1
    progress.base["stage"] = progress.stage
    return True

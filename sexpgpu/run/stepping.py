"""The loop's step: dispatching it, reading its numbers one step late, and the stop.

A step's metrics are read after the next step has been dispatched (`Steps.step()` reads
the one before as it starts the next; `Steps.flush()` reads the last one now, the host sync
point at a pass, a checkpoint or the end), so the host never waits on the device between
steps. `Stop` owns why a run ends before its last step: a signal on this process, or one
the nodes agreed on.
"""

from __future__ import annotations

import contextlib
import gc
import time

import jax
import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.run import signals
from sexpgpu.run.backend import peak_bytes
from sexpgpu.run.planning.plan import shrink_hints


class NonFinite(Exception):
  """`:on-nan stop` met a non-finite step (the guard in the step kept the state); `state`
  is the newest state the runner handed out (what the run checkpoints)."""

  def __init__(self, step: int, state=None):
    super().__init__(step)
    self.step = step
    self.state = state

  def error(self, where: str) -> SxError:
    """The E-NUM-001 a run ends with (its last finite state checkpointed, when it can be)."""
    return SxError("E-NUM-001", f"the loss is not finite at step {self.step}", where=where,
                   fix="lower the learning rate, add :clip, or set :on-nan skip; the last "
                   "finite state was checkpointed when a location was given")


class Stop:
  """Whether, and by which signal, the run stops before its last step.

  On one node a signal stops the run at the next step boundary. On several, each node puts
  the signal it received into the step, and all of them stop at the step that carried it.
  """

  def __init__(self, flag: signals.Flag, several_nodes: bool):
    self.flag = flag
    self.several_nodes = several_nodes
    self.signum: int | None = None

  def here(self) -> bool:
    """Whether to stop now, before the next step (a signal on one node, or one agreed)."""
    if self.flag.received is not None and not self.several_nodes:
      self.signum = self.flag.received
    return self.signum is not None

  def agreed(self, signum: int | None) -> bool:
    """Records the signal a read step carried (several nodes); returns whether to stop."""
    if signum:
      self.signum = signum
    return self.signum is not None

  def needs_numbers(self) -> bool:
    """Whether the step just dispatched must be read now: several nodes agree on a stop at
    every step, and a signal that has arrived here stops the run at this one."""
    return self.several_nodes or self.signum is not None or self.flag.received is not None

  @property
  def name(self) -> str | None:
    """The signal's name (SIGTERM, …) for the summary's and the status file's `stopped_by`."""
    return signals.SIGNALS.get(self.signum, str(self.signum)) if self.signum else None

  @property
  def exit_code(self) -> int:
    return 128 + int(self.signum) if self.signum else 0

  def line(self, step: int, steps: int, checkpoint: str | None, located: bool) -> str:
    """`stopped: SIGTERM at step S; checkpoint LOCATION; continue with --resume latest`
    (standard error's last line; see signals.stop_line)."""
    del steps  # the line names the step a resume starts from
    return signals.stop_line(self.name, step, checkpoint, located)


class Steps:
  """Dispatches train steps and reads each one's numbers after the next is dispatched.

  Reading records the step: its loss, counters, timing and the `step` and `diagnostic`
  events, the state of the loader it drew from (what a checkpoint at it records), and the
  signal the nodes agreed to stop at (into the run's Stop).
  """

  def __init__(self, ctx, feed, profile, rdv, stop: Stop):
    """Args: ctx: the RunContext; feed: the run's Feed; profile: its Profile or None; rdv:
    the rendezvous of several nodes or None; stop: the run's Stop (its signal flag goes
    into each step of several nodes)."""
    self.c, self.training = ctx.c, ctx.training
    self.progress, self.metrics, self.log = ctx.out.progress, ctx.out.metrics, ctx.out.log
    self.feed, self.profile, self.rdv, self.stop = feed, profile, rdv, stop
    self._pending = None  # the dispatched step whose numbers are not read yet
    self._state = None  # the newest state handed out (NonFinite carries it)
    self._first = True  # no step dispatched yet in this session
    self.t_ready: float | None = None  # when the last read step's numbers reached the host

  def step(self, st, state, batches, info: dict, step: int):
    """Starts step `step` (1-based) on `state` without waiting for it, then reads the step
    before it (a host sync: its numbers, while this one runs).

    Args:
      st: the TrainStep of the stage and stacking.
      state, batches: its inputs (the state is donated).
      info: what the feed said about the batches (loader state, records, tokens, wait).
      step: the step being run.

    Returns:
      The new state.

    Raises:
      NonFinite: under `:on-nan stop`, when the step before was not finite.
    """
    state, dispatched = self._dispatch(st, state, batches, info, step)
    self._state = state
    self.flush()
    self._pending = dispatched
    return state

  def flush(self) -> bool:
    """Reads the dispatched step's numbers now (a host sync), if one is unread; returns
    whether the run stops (a signal here, or one the nodes agreed to stop at).

    Raises:
      NonFinite: under `:on-nan stop`, when the step was not finite.
    """
    return self.stop.agreed(self._read())

  def _dispatch(self, st, state, batches, info: dict, step: int):
    if self.profile is not None:
      self.profile.before(step)
    t_dispatch = time.perf_counter()
    if self.progress.t_first_step is None:
      self.progress.t_first_step = t_dispatch
    first_cross_node = self._first and self.training.place.multiprocess
    self._first = False
    with watch(self.rdv, f"step {step}"), quiet(first_cross_node):
      state, m = self._call(st, state, batches, step)
      if first_cross_node:
        # The first collective connects gloo's peers, which prints a line of its own when
        # it runs, not when it is dispatched: wait for it inside the quiet block.
        jax.block_until_ready(m)
    return state, (step, st, m, info, t_dispatch)

  def _read(self) -> int | None:
    """Reads the pending step's numbers; returns a signal number when the nodes agreed to
    stop at that step."""
    if self._pending is None:
      return None
    step, st, m, info, t_dispatch = self._pending
    self._pending = None
    values = np.asarray(self.training.place.host(m)).tolist()  # host sync
    now = time.perf_counter()
    if self.profile is not None:
      self.profile.after(step, lambda: None)
    # The step's time: from when the device could start it (dispatched, and the step before
    # it done) to when its numbers arrived.
    dt = now - max(t_dispatch, self.t_ready or t_dispatch)
    self.t_ready = now
    m = dict(zip(st.step_names, values))
    progress = self.progress
    progress.step_times.append(dt)
    progress.counters["records"] += info["records"]
    if "tokens" in progress.counters and info["tokens"] is not None:
      progress.counters["tokens"] += info["tokens"]
    if not bool(m["finite"]):
      progress.counters["skipped-steps"] = progress.counters.get("skipped-steps", 0) + 1
      if self.training.on_nan == "stop":
        raise NonFinite(step, self._state)
    else:
      progress.train_loss = float(m["loss"])
    self.feed.trained(info)
    self._events(step, m, dt, info)
    return int(m["stop"]) if m.get("stop") else None  # a signal on some node: all stop here

  def close(self) -> None:
    """Ends a trace that the run stopped before its last step."""
    self._state = None
    if self.profile is not None:
      self.profile.stop()

  def _events(self, step: int, m: dict, dt: float, info: dict) -> None:
    progress, training = self.progress, self.training
    mfu = (progress.flops[progress.stage] / max(dt, 1e-9) / progress.peak if progress.peak
           else None)
    tps = info["tokens"] / max(dt, 1e-9) if info["tokens"] is not None else None
    ev = {"train/loss": float(m["loss"]), "train/lr": float(m["lr"]),
          "train/grad-norm": float(m["grad_norm"]), "time/step": dt,
          "time/data-wait": info.get("wait", 0.0),
          "throughput/tokens-per-second": tps, "throughput/mfu": mfu,
          "counters": dict(progress.counters)}
    if training.place.first.platform != "cpu":
      ev["runtime/peak_bytes"] = peak_bytes(training.place.first)
    self.metrics.emit("step", step=step, **ev)
    for d in training.diags:
      dd = self.c.exp.diagnostics[d.name]
      if step % max(dd.every, 1) == 0:
        self.metrics.emit("diagnostic", step=step, name=d.name, value=float(m["diag/" + d.name]))

  def _call(self, st, state, batches, step: int):
    """One step; an allocation that fails is retried once after releasing JAX's caches,
    when the state it was given is still whole (not yet donated to the failed call)."""
    for attempt in (0, 1):
      try:
        if st.ranks > 1:
          return st(state, batches, st.stop_flags(self.stop.flag.received or 0))
        return st(state, batches)
      except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        whole = not any(getattr(x, "is_deleted", lambda: False)()
                        for x in jax.tree_util.tree_leaves(state))
        detail = str(e).strip().splitlines()[0][:200]
        retry = attempt == 0 and whole
        line = (f"memory: allocation failed at step {step} ({detail}); caches released, "
                + ("retrying once" if retry else "stopping"))
        self.log(line)
        self.metrics.emit("annotation", name="allocation failed", text=line, step=step,
                          retried=retry)
        if not retry:
          raise SxError("E-MEM-001", f"an allocation failed at step {step} although the "
                        f"plan fit ({detail})", where="the device's memory",
                        fix="the last checkpoint is intact; shrink the run: "
                        + "; ".join(shrink_hints(self.c.selection.knobs) +
                                    [":remat true on the repeated block",
                                     "SEXPGPU_MEMORY to plan against less"])) from None
        jax.clear_caches()
        gc.collect()


def node_left(rdv, e: BaseException, step: int, checkpoint: str | None) -> None:
  """A runtime error of step `step`: a collective that fails across nodes is a node that
  left (gloo: "Connection reset by peer"), E-DP-007 at once, not a traceback and then
  JAX's abort at its shutdown barrier; anything else is raised again.

  Raises:
    the error `e`, when it is not a node that left (the rendezvous exits the process when
    it is).
  """
  if rdv is None or "RESOURCE_EXHAUSTED" in str(e):
    raise e
  rdv.lost(f"step {step}", cause(e), checkpoint)


def cause(e: BaseException) -> str:
  """A runtime error's gist: its last `:`-separated part of the first line (gloo's
  "Read error [127.0.0.1]:23785: Connection reset by peer" → "Connection reset by peer",
  "[…/pair.cc:547] Connection closed by peer [127.0.0.1]:18819" → "Connection closed by
  peer [127.0.0.1]:18819")."""
  line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  gist = line.rsplit(": ", 1)[-1].strip() or line
  if gist.startswith("[") and "] " in gist:  # gloo's "[…/pair.cc:547] " source position
    gist = gist.split("] ", 1)[1]
  return gist


def quiet(first_cross_node: bool):
  """Around the first cross-node step: gloo announces its peers on our output streams."""
  if first_cross_node:
    from sexpgpu.devices.nodes import quiet_collectives
    return quiet_collectives()
  return contextlib.nullcontext()


def watch(rdv, what: str):
  """Around a wait on other nodes: a node that left becomes E-DP-007, not a hang."""
  return rdv.watch(what) if rdv is not None else contextlib.nullcontext()

"""The training loop: set up, plan, initialize or restore, loop, finish.

It reads top to bottom in `run_compiled`. Two things keep the device busy:
the next steps' batches are drawn and placed in a background thread
(run/feed.py), and a step's metrics are read one step late, after the next
step has been dispatched; the loop drains first at a pass, a checkpoint, a
signal, a curriculum check and the last step, so what is printed, saved and
written is what a loop that waited on every step would have written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any

import jax
import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.run import output, saving, signals
from sexpgpu.run.compile import Compiled, cache_dir
from sexpgpu.run.devices import (CompileCounter, microbatches_divide, open_devices,
                                 parse_device_list)

@dataclasses.dataclass
class RunOptions:
  """What `sexpgpu run` was asked: flags already merged with the environment."""

  file: str
  device: str = "cpu"
  metrics: str | None = None
  status: str | None = None
  checkpoint_dir: str | None = None
  resume: str | None = None
  stacking: int | None = None
  json: bool = False
  quiet: bool = False  # the API: no standard error lines
  profile: tuple[int, int] | None = None  # steps A..B to trace
  profile_dir: str | None = None
  pipeline: bool = True  # batches drawn ahead and metrics read one step late
  metrics_where: str = "--metrics"  # the flag or variable `metrics` came from, for errors


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

  def as_dict(self) -> dict:
    return {"kind": "summary", "steps": self.steps, "train_loss": self.train_loss,
            "eval": self.eval, "counters": self.counters, "stage": self.stage,
            "metrics": self.metrics, "status": self.status, "slug": self.slug,
            "stopped_by": self.stopped_by, "checkpoint": self.checkpoint,
            "goodput": self.goodput}


@dataclasses.dataclass
class Progress:
  """What the run has done so far: what the status file, the meta and the summary say."""

  steps: int
  status: Any
  base: dict
  stage: int = 0
  counters: dict = dataclasses.field(default_factory=lambda: {"records": 0})
  last_pass: dict = dataclasses.field(default_factory=dict)
  train_loss: float | None = None
  step_times: list = dataclasses.field(default_factory=list)
  pass_times: dict = dataclasses.field(default_factory=dict)
  first_pass: dict = dataclasses.field(default_factory=dict)
  last_ckpt: str | None = None
  t_first_step: float | None = None
  state: str | None = None  # the phase last written
  flops: list = dataclasses.field(default_factory=list)  # model flops of a step, per stage
  peak: float | None = None  # the device's peak flop/s (MFU's denominator)
  _status_at: float = 0.0

  def set_status(self, state: str, step: int, force: bool = True) -> None:
    """Writes the status file: at once when the phase changes, else at most once a second."""
    now = time.time()
    if not force and state == self.state and now - self._status_at < 1.0:
      return
    self._status_at, self.state = now, state
    sps = eta = None
    if self.step_times:
      sps = 1.0 / max(float(np.median(self.step_times[-20:])), 1e-9)
      eta = (self.steps - step) / sps
    self.status.write(dict(self.base, state=state, step=step, train_loss=self.train_loss,
                           last_pass=dict(self.last_pass), counters=dict(self.counters),
                           steps_per_second=sps, eta_seconds=eta))


def wants_kept_host_memory(c) -> bool:
  """Whether keeping host memory between steps pays for this experiment on the CPU.

  It does when a microbatch's forward values (an estimate of the step's temporary
  buffer, counted from the IR) lie between glibc's mmap ceiling, below which glibc
  reuses buffers without help, and its trim ceiling, above which it gives a freed
  buffer back to the OS anyway (devices.keep_host_memory).
  """
  from sexpgpu.lower.flops import forward_bytes
  from sexpgpu.run.devices import MMAP_CEILING, TRIM_CEILING
  return MMAP_CEILING < max(forward_bytes(s.graph) for s in c.stages) <= TRIM_CEILING


def run_compiled(compiled: Compiled, opts: RunOptions) -> Summary:
  """Trains a compiled experiment in this process and returns its Summary.

  Raises:
    SxError: any error of the run, after the status file says `failed`.
  """
  from sexpgpu.devices.env import parse_nodes
  from sexpgpu.track import StatusFile
  c, o = compiled, opts
  t_begin = time.perf_counter()
  # Node variables are read before anything starts a JAX backend (E-DP-005).
  nodes_cfg = parse_nodes(os.environ, o.device)
  node = nodes_cfg.rank if nodes_cfg else 0
  counter = CompileCounter.install(cache_dir())
  status = StatusFile(o.status if node == 0 else None)  # node 0 writes it
  steps = int(c.exp.run["steps"])
  base = {"slug": c.slug, "pid": os.getpid(), "steps": steps, "stage": 0,
          "started_at": time.time(), "error": None, "checkpoint": None, "goodput": None}
  progress = Progress(steps, status, base, pass_times={p: [] for p in c.passes})
  status.write({**base, "state": "compiling", "step": 0, "train_loss": None, "last_pass": {},
                "counters": {}, "steps_per_second": None, "eta_seconds": None})
  try:
    return _train(c, o, nodes_cfg, node, counter, progress, t_begin)
  except SxError as e:
    status.update(state="failed", error={"code": e.code, "message": e.message})
    raise


def _train(c, o: RunOptions, nodes_cfg, node: int, counter, progress: Progress,
           t_begin: float) -> Summary:
  from sexpgpu.run import plan
  from sexpgpu.run.training import build
  from sexpgpu.track import open_metrics
  log = (lambda line: None) if o.quiet else output.err
  run = c.exp.run
  steps, k = int(run["steps"]), int(run["microbatches"])

  # --- set up: devices, checkpoints, metrics ------------------------------------------------
  ordinals = parse_device_list(os.environ.get("SEXPGPU_DEVICES"))
  t_open = time.perf_counter()
  rdv = _before_backend(c, o, nodes_cfg, ordinals, progress.status)
  if rdv is not None:  # E-DP-007 names it, also when a thread of ours sees a node leave
    rdv.checkpoint = lambda: progress.last_ckpt
  place = open_devices(o.device, ordinals, nodes_cfg)
  open_s = time.perf_counter() - t_open
  microbatches_divide(k, place.ranks)
  store, resume_dir, resume_text = _checkpoint_setup(c, o, node)
  metrics = open_metrics(o.metrics if node == 0 else None, c.slug, where=o.metrics_where)
  log(output.config_line(o.file, c.slug, o.device, steps, k,
                         _evals_field(c.exp.passes, run.get("eval-every")),
                         ",".join(c.diagnostics) or "-", run["precision"], run["seed"],
                         o.checkpoint_dir or "-", resume_text, o.status or "-",
                         ranks=place.ranks, nodes=place.nodes))
  if metrics.describe():
    log(f"metrics: {metrics.describe()}")
  metrics.emit("config", file=c.program.path, fingerprint=c.fingerprint, device=o.device,
               ranks=place.ranks, nodes=place.nodes,
               knobs={n: {"value": saving.jsonable(v.value), "source": v.source}
                      for n, v in c.selection.knobs.items()},
               versions=saving.versions(), resume=resume_text)
  t_setup = time.perf_counter()
  node_gradients = nodes_cfg.gradients if nodes_cfg else "f32"
  if rdv is not None:
    from sexpgpu.devices.nodes import compare_at_rendezvous
    from sexpgpu.lang.select import NOT_IN_FINGERPRINT
    compare_at_rendezvous({"nodes": place.nodes, "node": node, "gpus": len(place.local_devices),
                           "fingerprint": c.fingerprint, "gradients": node_gradients,
                           "resume": resume_dir or "-",
                           "knobs": {k: str(v.value) for k, v in c.selection.knobs.items()
                                     if k in NOT_IN_FINGERPRINT}}, rdv)
  training = build(c, place, node_gradients)
  from sexpgpu.lower.flops import device_peak, train_flops
  progress.flops = [train_flops(s.graph, training.k) for s in c.stages]
  progress.peak = device_peak(place.first, training.precision)
  if any("tokens" in f for f in c.fields.values()):
    progress.counters["tokens"] = 0
  try:
    with signals.deferred() as sig:
      summary = _loop(c, o, place, training, store, resume_dir, metrics, progress, rdv, sig,
                      counter, log, t_begin, t_setup, open_s)
  except BaseException:
    if store is not None:  # the error in flight is the one to report
      with contextlib.suppress(Exception):
        store.close()
    raise
  if store is not None:
    store.close()  # orbax's threads, and a remote run's staging folder
  return summary


def _loop(c, o, place, training, store, resume_dir, metrics, progress: Progress, rdv, sig,
          counter, log, t_begin: float, t_setup: float, open_s: float) -> Summary:
  from sexpgpu.run import plan
  from sexpgpu.run.feed import Feeder
  steps, k, on_nan = training.steps, training.k, training.on_nan
  multi = place.multiprocess
  from sexpgpu.run.sampling import Samplers
  samplers = Samplers(c)  # a defsample's prompts checked before anything is initialized

  # --- plan: every step compiled for abstract values; nothing initialized before it fits --
  fixed = o.stacking
  if resume_dir is not None:
    from sexpgpu.ckpt import read_meta
    resume_meta = read_meta(resume_dir)
    saving.check_same(c, place, resume_meta, resume_dir)
    progress.stage = int(resume_meta["stage"])
    if "stacking" in resume_meta:
      fixed = int(resume_meta["stacking"])  # a resume keeps its stacking: the same sums
  state = training.abstract_state(progress.stage)
  batches_abs = training.abstract_batches(c.stages[progress.stage].data, (k,))
  choice = plan.choose(training, progress.stage, fixed, state, batches_abs, place.first,
                       store is not None, cache_dir(), several_nodes=multi)
  _annotate(c, training, choice, metrics, place, log)

  # --- initialize or restore ----------------------------------------------------------------
  if resume_dir is not None:
    state, meta, secs = saving.restore(resume_dir, state, place,
                                       lambda s: training.place_state(s, progress.stage),
                                       training.place_abstract(state, progress.stage),
                                       training.sharding != "replicate")
    start = int(meta["step"])
    progress.stage = int(meta["stage"])
    progress.base["stage"] = progress.stage
    progress.counters = {n: int(v) for n, v in meta["counters"].items()}
    progress.last_pass = dict(meta.get("last_pass") or {})
    progress.train_loss = meta.get("train_loss")
    for n, st in meta["loaders"].items():
      c.loaders[n].set_state(st)
    progress.last_ckpt = resume_dir
    progress.base["checkpoint"] = {"step": start, "location": resume_dir}
    metrics.emit("checkpoint", step=start, action="restored", location=resume_dir, bytes=None,
                 seconds=secs)
  else:
    start = 0
    from sexpgpu.models.warm import start_state  # cold, or warm from :init-from
    state = start_state(c, training, progress.stage, log)
  loader_states = {n: ld.state() for n, ld in c.loaders.items()}
  stacking = choice.degree
  # The compiler's objects live as long as the run: keep them out of the collector's scans,
  # so a collection in the step loop walks only what the loop itself allocates.
  gc.collect()
  gc.freeze()
  step0_s = time.perf_counter() - t_setup
  resumed_at = start if resume_dir is not None else None

  def passes(step: int, at_end: bool) -> bool:
    # A pass gathers sharded parameters over the nodes: gloo announces each new group of
    # peers on our output when a pass first runs its collectives.
    with _quiet(multi and training.sharding != "replicate"):
      with feed.lock:  # a pass may read the loader the feed draws from
        ran = _run_passes(c, training, place, state, step, at_end, resumed_at, metrics,
                          progress, log)
      samplers.run(place, state["params"], step, steps, at_end, resumed_at, metrics,
                   progress, log)
    return ran

  def new_feed(first_step: int) -> Feeder:
    name = c.stages[progress.stage].data
    draw = lambda: _draw(c.loaders[name], name, k, place)
    return Feeder(draw, lambda host: place.shard(host, k), steps - first_step, ahead=o.pipeline)

  def save(step: int, wait: bool) -> None:
    if store is None:
      return
    progress.set_status("checkpointing", step)
    meta_ = saving.meta(c, progress, step, place, training.node_gradients, stacking,
                        loader_states, training.sharding)
    if multi:
      if training.sharding == "replicate":
        saving.save_nodes(store, state, meta_, step, place, rdv)
      else:
        saving.save_sharded_nodes(store, state, meta_, step, rdv)
      _emit_saved(store, progress, metrics)
      if place.node != 0:  # node 0 wrote it, and every node waited until it was committed
        progress.last_ckpt = store.step_dir(step)
      return
    _emit_saved(store, progress, metrics)  # the previous save completes first
    store.save(step, state, meta_, wait=wait)
    if wait:
      _emit_saved(store, progress, metrics)

  profile = None
  if o.profile is not None:
    from sexpgpu.run.profile import Profile, default_dir
    profile = Profile(*o.profile, o.profile_dir or default_dir(c.slug, o.metrics))

  # --- the loop -----------------------------------------------------------------------------
  feed = new_feed(start)
  step = start
  stopped_by = None
  pending = None  # the dispatched step whose numbers are not read yet
  t_ready = None  # when the last step's numbers reached the host

  def drain() -> int | None:
    """Reads the pending step's numbers (a host sync); returns a signal number when the
    nodes agreed to stop at that step."""
    nonlocal pending, t_ready
    if pending is None:
      return None
    t_ready, stop = _report(c, training, pending, t_ready, progress, metrics, profile,
                            loader_states)
    pending = None
    return stop

  passes(start, start == steps)
  progress.set_status("running", step)
  try:
    while step < steps:
      if sig.received is not None and not multi:
        stopped_by = sig.received
        break
      if not feed.ready():
        # The loader is behind and the device will idle anyway: read the last step now,
        # so its time is the device's and not the wait's.
        stopped_by = drain()
        if stopped_by is not None:
          break
      waited = feed.waited
      batches, info = feed.get()
      info["wait"] = feed.waited - waited  # the time this step's batch kept the loop waiting
      if choice.how == "measure":
        choice = plan.measure(choice, training, progress.stage, state, batches, place.first,
                              cache_dir())
        stacking = choice.degree
        _emit_stacking(choice, metrics)
      st = training.step(progress.stage, stacking)
      if profile is not None:
        profile.before(step + 1)
      t_dispatch = time.perf_counter()
      if progress.t_first_step is None:
        progress.t_first_step = t_dispatch
      first_cross_node = multi and step == start
      with _watch(rdv, f"step {step + 1}"), _quiet(first_cross_node):
        state, m = _call_step(c, st, state, batches, sig, step + 1, metrics, log)
        if first_cross_node:
          # The first collective connects gloo's peers, which prints a line of its own when
          # it runs, not when it is dispatched: wait for it inside the quiet block.
          jax.block_until_ready(m)
      step += 1
      # Host sync point: the previous step's numbers, read while this step runs.
      stopped_by = drain()
      pending = (step, st, m, info, t_dispatch)
      at_end = step == steps
      due_pass = (at_end or any(_due(p, step, c) for p in c.exp.passes.values())
                  or samplers.due(step, at_end))
      due_ckpt = bool(training_ckpt_every(c)) and step % training_ckpt_every(c) == 0
      # What follows needs this step's numbers, or several nodes must agree on a stop now.
      if (not o.pipeline or at_end or due_pass or due_ckpt or multi or stopped_by is not None
          or sig.received is not None):
        stopped_by = drain() or stopped_by
      if stopped_by is not None:
        break
      if due_pass and passes(step, at_end) and c.exp.passes:
        if _advance(c, progress, metrics, step):
          feed.close()
          _rewind(c, loader_states)
          feed = new_feed(step)
      if at_end:
        break
      if due_ckpt:
        save(step, wait=False)
      progress.set_status("running", step, force=False)
    stopped_by = drain() or stopped_by
  except jax.errors.JaxRuntimeError as e:
    if rdv is None or "RESOURCE_EXHAUSTED" in str(e):
      raise
    # A collective that fails across nodes is a node that left (gloo: "Connection reset by
    # peer"): E-DP-007 now, not a traceback and then JAX's abort at its shutdown barrier.
    rdv.lost(f"step {step + 1}", _cause(e), progress.last_ckpt)
  except _NonFinite as e:
    feed.close()
    _rewind(c, loader_states)
    save(e.step - 1, wait=True)
    raise SxError("E-NUM-001", f"the loss is not finite at step {e.step}", where=c.program.path,
                  fix="lower the learning rate, add :clip, or set :on-nan skip; the last "
                  "finite state was checkpointed when a location was given") from None
  finally:
    feed.close()
    if profile is not None:
      profile.stop()
  _rewind(c, loader_states)  # batches drawn ahead and not trained on are drawn again

  # --- finish -------------------------------------------------------------------------------
  if store is not None:
    if step == steps or stopped_by is not None:
      if step > start or resume_dir is None:
        save(step, wait=True)
    _emit_saved(store, progress, metrics)
  total = time.perf_counter() - t_begin
  compiled_n, compile_s, hits = counter.snapshot()
  for line in output.timing_lines(c.graph_seconds, open_s, compiled_n, compile_s, hits, step0_s,
                                  progress.first_pass, progress.step_times, start + 1, step,
                                  progress.pass_times, total, step - start):
    log(line)
  if profile is not None and (line := profile.line()) is not None:
    log(line)
    metrics.emit("annotation", name="profile", text=line, folder=profile.folder)
  _peak_line(place, choice, metrics, log)
  goodput = sum(progress.step_times) / max(time.perf_counter() - t_begin, 1e-9)
  goodput = round(min(goodput, 1.0), 4)
  progress.base["goodput"] = goodput
  summary = Summary(step, progress.train_loss, dict(progress.last_pass), dict(progress.counters),
                    progress.stage, metrics.summary_path(), o.status, c.slug,
                    signals.SIGNALS.get(stopped_by) if stopped_by else None, progress.last_ckpt,
                    128 + int(stopped_by) if stopped_by else 0, goodput)
  gc.unfreeze()  # a notebook may compile and run again in this process
  progress.set_status("stopped" if stopped_by else "done", step)
  metrics.emit("summary", **{n: v for n, v in summary.as_dict().items() if n != "kind"})
  metrics.close()
  if not o.json:
    for line in output.done_lines(step, progress.train_loss, summary.eval, summary.counters):
      log(line)
  return summary


# --- the loop's parts -------------------------------------------------------------------------

class _NonFinite(Exception):
  """`:on-nan stop` met a non-finite step (the guard in the step kept the state)."""

  def __init__(self, step: int):
    super().__init__(step)
    self.step = step


def training_ckpt_every(c) -> int:
  return int(c.exp.run["checkpoint-every"])


def _due(p, step: int, c) -> bool:
  every = p.every if c.exp.run.get("eval-every") is None else c.exp.run.get("eval-every")
  return bool(every) and step % every == 0


def _draw(loader, name: str, k: int, place) -> tuple[dict, dict]:
  """One step's microbatches from the loader, stacked on the host, and what the loop needs."""
  if not place.multiprocess:
    mbs = [loader.next() for _ in range(k)]
  else:  # this process's share; every node's loader moves past the whole step
    base = loader.position
    mbs = [loader.batch(base + j) for j in place.local_share(k)]
    st = loader.state()
    st["position"] = base + k
    loader.set_state(st)
  host = {f: np.stack([b[f] for b in mbs]) for f in mbs[0]}
  tokens = None
  if hasattr(loader, "count_tokens"):  # a packed loader: padding is not a token
    # (several nodes: this process's share, scaled to the step)
    tokens = sum(loader.count_tokens(b) for b in mbs) * k // len(mbs)
  elif "tokens" in mbs[0]:
    tokens = k * int(mbs[0]["tokens"].size)
  return host, {"loader": name, "state": loader.state(), "records": k * loader.batch_size,
                "tokens": tokens}


def _rewind(c, loader_states: dict) -> None:
  """Loaders back to the states of the steps trained on (the feed may have drawn ahead)."""
  for n, st in loader_states.items():
    c.loaders[n].set_state(st)


def _report(c, training, pending, t_ready, progress: Progress, metrics, profile,
            loader_states: dict):
  """Reads a dispatched step's numbers (a host sync) and records them, with the state of the
  loader it drew from (what a checkpoint at this step records).

  Returns:
    (when they reached the host, a signal number when several nodes agreed to stop).

  Raises:
    _NonFinite: under `:on-nan stop`, when the step was not finite.
  """
  step, st, m, info, t_dispatch = pending
  values = np.asarray(training.place.host(m)).tolist()  # host sync
  now = time.perf_counter()
  if profile is not None:
    profile.after(step, lambda: None)
  # The step's time: from when the device could start it (dispatched, and the step before
  # it done) to when its numbers arrived.
  dt = now - max(t_dispatch, t_ready or t_dispatch)
  m = dict(zip(st.step_names, values))
  progress.step_times.append(dt)
  progress.counters["records"] += info["records"]
  if "tokens" in progress.counters and info["tokens"] is not None:
    progress.counters["tokens"] += info["tokens"]
  if not bool(m["finite"]):
    progress.counters["skipped-steps"] = progress.counters.get("skipped-steps", 0) + 1
    if training.on_nan == "stop":
      raise _NonFinite(step)
  else:
    progress.train_loss = float(m["loss"])
  loader_states[info["loader"]] = info["state"]
  _step_event(c, training, progress, metrics, step, m, dt, info)
  stop = int(m["stop"]) if m.get("stop") else None  # a signal on some node: all stop here
  return now, stop


def _step_event(c, training, progress: Progress, metrics, step: int, m: dict, dt: float,
                info: dict) -> None:
  place = training.place
  mfu = (progress.flops[progress.stage] / max(dt, 1e-9) / progress.peak if progress.peak
         else None)
  tps = info["tokens"] / max(dt, 1e-9) if info["tokens"] is not None else None
  ev = {"train/loss": float(m["loss"]), "train/lr": float(m["lr"]),
        "train/grad-norm": float(m["grad_norm"]), "time/step": dt,
        "time/data-wait": info.get("wait", 0.0),
        "throughput/tokens-per-second": tps, "throughput/mfu": mfu,
        "counters": dict(progress.counters)}
  if place.first.platform != "cpu":
    from sexpgpu.run.devices import peak_bytes
    ev["runtime/peak_bytes"] = peak_bytes(place.first)
  metrics.emit("step", step=step, **ev)
  for d in training.diags:
    dd = c.exp.diagnostics[d.name]
    if step % max(dd.every, 1) == 0:
      metrics.emit("diagnostic", step=step, name=d.name, value=float(m["diag/" + d.name]))


def _run_passes(c, training, place, state, step: int, at_end: bool, resumed_at, metrics,
                progress: Progress, log) -> bool:
  """Every pass due at `step`; returns whether any ran."""
  ran = False
  for name, p in c.exp.passes.items():
    if not (_due(p, step, c) or at_end) or step == resumed_at:
      continue
    progress.set_status("evaluating", step)
    t = time.perf_counter()
    loader = c.loaders[p.data]
    sums: dict[str, Any] = {}
    for i in range(p.batches):
      batch = place.replicate(loader.batch(i))
      vals = training.pass_steps[name](state["params"], batch)
      for mname, v in vals.items():
        sums[mname] = v if mname not in sums else sums[mname] + v
    # host sync: the progress line needs the numbers
    values = {f"{name}/{mname}": float(place.host(sums[mname])) / p.batches
              for mname, _ in p.metrics}
    dt = time.perf_counter() - t
    if name in progress.first_pass:
      progress.pass_times[name].append(dt)
    else:
      progress.first_pass[name] = dt
    progress.last_pass.update(values)
    metrics.emit("pass", step=step, **{"pass": name, "metrics": values, "time/pass": dt})
    since = 0.0 if progress.t_first_step is None else time.perf_counter() - progress.t_first_step
    log(output.progress_line(name, step, progress.steps, None if step == 0 or
                             progress.train_loss is None else progress.train_loss, values,
                             progress.counters["records"], since))
    bad = [m for m, v in values.items() if not np.isfinite(v)]
    if bad and training.on_nan == "stop":
      # The steps' guard keeps a non-finite update out; a finite but diverged state can
      # still evaluate to inf or nan, and a run must not end as if that were a result.
      raise SxError("E-NUM-001", f"{', '.join(bad)} is not finite at step {step}",
                    where=c.program.path, fix="lower the learning rate or add :clip; the last "
                    "checkpoint before this step is intact")
    ran = True
  return ran


def _advance(c, progress: Progress, metrics, step: int) -> bool:
  """Moves to the next curriculum stage when its condition holds; returns whether it did."""
  from sexpgpu.front.build import Builder
  from sexpgpu.front.values import Env
  stages = c.stages
  if progress.stage + 1 >= len(stages):
    return False
  nxt = stages[progress.stage + 1]
  env = Env(c.exp.env, dict(progress.last_pass))
  try:
    holds = Builder(env).eval(nxt.when, env)
  except SxError as e:
    if e.code == "E-NAME-001":
      return False  # a metric the condition names has not been measured yet
    raise
  if holds is None or holds is False:
    return False
  metrics.emit("stage", step=step, **{"from": progress.stage, "to": progress.stage + 1,
                                      "reason": str(nxt.when)})
  progress.stage += 1
  progress.base["stage"] = progress.stage
  return True


def _call_step(c, st, state, batches, sig, step: int, metrics, log):
  """One step; an allocation that fails is retried once after releasing JAX's caches,
  when the state it was given is still whole (not yet donated to the failed call)."""
  for attempt in (0, 1):
    try:
      if st.ranks > 1:
        return st(state, batches, st.stop_flags(sig.received or 0))
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
      log(line)
      metrics.emit("annotation", name="allocation failed", text=line, step=step, retried=retry)
      if not retry:
        from sexpgpu.run.plan import shrink_hints
        raise SxError("E-MEM-001", f"an allocation failed at step {step} although the plan "
                      f"fit ({detail})", where="the device's memory",
                      fix="the last checkpoint is intact; shrink the run: "
                      + "; ".join(shrink_hints(c.selection.knobs) +
                                  [":remat true on the repeated block",
                                   "SEXPGPU_MEMORY to plan against less"])) from None
      jax.clear_caches()
      gc.collect()


def _emit_saved(store, progress: Progress, metrics) -> None:
  info = store.wait()
  if info is not None and info.location != progress.last_ckpt:
    progress.last_ckpt = info.location
    progress.base["checkpoint"] = {"step": info.step, "location": info.location}
    metrics.emit("checkpoint", step=info.step, action="saved", location=info.location,
                 bytes=info.bytes, seconds=info.seconds)


# --- set up -----------------------------------------------------------------------------------

def _before_backend(c, o, nodes_cfg, ordinals, status):
  """What must happen before anything starts a JAX backend; returns the rendezvous or None."""
  if o.device == "cpu" and wants_kept_host_memory(c):
    from sexpgpu.run.devices import keep_host_memory
    keep_host_memory()
  if o.device == "cuda":  # on one node or several
    from sexpgpu.run.devices import autotune_of, deterministic, deterministic_flags
    deterministic_flags(autotune_of(_resume_meta(c, o)) if deterministic() else None)
  if nodes_cfg is None:
    return None
  from sexpgpu.devices import nodes
  from sexpgpu.devices.env import rendezvous_timeout

  def on_timeout(err):
    status.update(state="failed", error={"code": err.code, "message": err.message})

  if o.device == "cpu":
    from sexpgpu.run.devices import cpu_flags
    cpu_flags()
    if ordinals:  # SEXPGPU_DEVICES=0,1 gives each node that many host devices
      import jax
      from sexpgpu.devices.env import check_visible, cpu_visible
      check_visible(ordinals, cpu_visible(), "cpu")
      if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", max(ordinals) + 1)
  return nodes.initialize(nodes_cfg, rendezvous_timeout(), on_timeout, ordinals)


def _resume_meta(c, o) -> dict | None:
  """The meta of the checkpoint --resume names, read before the device opens, or None."""
  from sexpgpu.ckpt import peek_meta, resolve_resume
  if not o.resume:
    return None
  try:
    step_dir, _ = resolve_resume(o.resume, o.checkpoint_dir, c.slug)
  except SxError:
    return None  # reported with its code when the run resolves it again
  return peek_meta(step_dir) if step_dir else None


def _checkpoint_setup(c, o, node: int):
  store = None
  if o.checkpoint_dir:
    from sexpgpu.ckpt import CheckpointStore
    store = CheckpointStore(o.checkpoint_dir, c.slug, int(c.exp.run["keep"]))
    if node == 0:  # node 0 writes the checkpoints
      store.check_writable()
  if not o.resume:
    return store, None, "-"
  from sexpgpu.ckpt import resolve_resume
  step_dir, text = resolve_resume(o.resume, o.checkpoint_dir, c.slug)
  return store, step_dir, text


def _evals_field(passes: dict, every_override) -> str:
  if not passes:
    return "-"
  out = []
  for name, p in passes.items():
    every = p.every if every_override is None else every_override
    out.append(f"{name}@{every}" if every else f"{name}@end")
  return ",".join(out)


# --- reports ----------------------------------------------------------------------------------

def _annotate(c, training, choice, metrics, place, log) -> None:
  from sexpgpu.devices.report import lowering_annotation, lowering_report
  compiled = next(iter(choice.executables.values()))
  regions = region_lines(c.regions, training.step(0, choice.degree).notes)
  ann = lowering_annotation(place.first, c.patterns, regions, compiled, choice.plan, choice.text)
  metrics.emit("annotation", name="lowering", text="\n".join(ann["lines"]),
               **{n: v for n, v in ann.items() if n not in ("kind", "lines")})
  metrics.emit("annotation", name="memory", text=choice.plan.text(), parts=choice.plan.parts,
               peak_at=choice.plan.peak_at, total=choice.plan.total, free=choice.plan.free)
  _emit_stacking(choice, metrics)
  if place.first.platform != "cpu":
    for line in lowering_report(place.first, c.patterns, regions, compiled, choice.plan,
                                choice.text):
      log(line)


def _emit_stacking(choice, metrics) -> None:
  metrics.emit("annotation", name="stacking", text=choice.text, degree=choice.degree,
               how=choice.how, plans={str(d): t for d, t in choice.totals.items()},
               predicted={str(d): t for d, t in choice.predicted.items()})


def _peak_line(place, choice, metrics, log) -> None:
  """On a GPU: `memory: peak X of Y planned (+Z%)`, the allocator's peak against the plan."""
  from sexpgpu.devices.memory import peak_line
  from sexpgpu.run.devices import peak_bytes
  if place.first.platform == "cpu":
    return
  peak = peak_bytes(place.first)
  if peak is not None:
    line = peak_line(peak, choice.plan)
    log(line)
    metrics.emit("annotation", name="memory peak", text=line, peak=peak,
                 planned=choice.plan.total)


def _quiet(first_cross_node: bool):
  """Around the first cross-node step: gloo announces its peers on our output streams."""
  if first_cross_node:
    from sexpgpu.devices.nodes import quiet_collectives
    return quiet_collectives()
  return contextlib.nullcontext()


def _cause(e: BaseException) -> str:
  """A runtime error's gist: its last `:`-separated part of the first line (gloo's
  "Read error [127.0.0.1]:23785: Connection reset by peer" → "Connection reset by peer",
  "[…/pair.cc:547] Connection closed by peer [127.0.0.1]:18819" → "Connection closed by
  peer [127.0.0.1]:18819")."""
  line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  cause = line.rsplit(": ", 1)[-1].strip() or line
  if cause.startswith("[") and "] " in cause:  # gloo's "[…/pair.cc:547] " source position
    cause = cause.split("] ", 1)[1]
  return cause


def _watch(rdv, what: str):
  """Around a wait on other nodes: a node that left becomes E-DP-007, not a hang."""
  return rdv.watch(what) if rdv is not None else contextlib.nullcontext()


def region_lines(regions, notes) -> list[tuple[str, str]]:
  """The lowering report's region lines: what each recognized region became."""
  out = []
  att = [r for r in regions if r.kind == "attention"]
  if att:
    n = sum(r.times for r in att)
    impls = sorted({nt["impl"] for nt in notes if nt.get("kind") == "attention"})
    whys = sorted({nt.get("why") for nt in notes if nt.get("kind") == "attention" and nt.get("why")})
    how = {"cudnn": "cudnn fused attention", "pallas": "Pallas flash attention",
           "xla": "XLA attention"}
    became = " + ".join(how[i] for i in impls) or "XLA attention"
    causal = "causal" if all(r.detail.startswith("causal") for r in att) else "mixed masks"
    if any("segment mask" in r.detail for r in att):
      causal += ", segment mask"
    text = f"{n} region{'s' if n != 1 else ''} → {became} ({causal})"
    if whys and "cudnn" not in impls:
      text += f": {'; '.join(whys)}"
    out.append(("attention", text))
  for r in regions:
    if r.kind == "cross-entropy":
      out.append(("cross-entropy", f"{r.times} region → chunked, {r.detail}"))
  return out

"""One training session: init or restore, then step, passes, curriculum, checkpoint."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.front.build import Builder
from sexpgpu.front.values import Env
from sexpgpu.lang.select import NOT_IN_FINGERPRINT, format_value
from sexpgpu.lower.init import init_params
from sexpgpu.lower.optim import make_optimizer
from sexpgpu.lower.step import Diag, PassStep, TrainStep, init_state
from sexpgpu.run import output


def _stack(batches: list[dict]) -> dict:
  return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


class Session:
  """The state of one `sexpgpu run` while it trains."""

  def __init__(self, compiled, opts, device, metrics, status, status_base, store, log, counter,
               rdv=None, node_gradients: str = "f32"):
    self.c = compiled
    self.rdv = rdv
    self.node_gradients = node_gradients
    self.o = opts
    self.place = device
    self.device = device.first
    self.metrics = metrics
    self.status = status
    self.status_base = status_base
    self.store = store
    self.log = log
    self.counter = counter
    run = compiled.exp.run
    self.steps = int(run["steps"])
    self.k = int(run["microbatches"])
    self.seed = int(run["seed"])
    self.precision = run["precision"]
    self.on_nan = run["on-nan"]
    self.ckpt_every = int(run["checkpoint-every"])
    self.every_override = run.get("eval-every")
    per_rank = self.k // device.ranks
    self.stacking = opts.stacking or per_rank
    if per_rank % self.stacking:
      raise SxError("E-ENV-001", f"stacking {self.stacking} does not divide the {per_rank} "
                    "microbatches of each rank", where="SEXPGPU_STACKING",
                    fix="use a divisor of :microbatches / ranks")
    self.stage = 0
    self.counters: dict[str, int] = {"records": 0}
    if any("tokens" in f for f in compiled.fields.values()):
      self.counters["tokens"] = 0
    self.last_pass: dict[str, float] = {}
    self.train_loss: float | None = None
    self.step_times: list[float] = []
    self.pass_times: dict[str, list[float]] = {p: [] for p in compiled.passes}
    self.first_pass: dict[str, float] = {}
    self.last_ckpt: str | None = None
    self._status_at = 0.0
    self.diags = tuple(Diag(n, d.kind, d.arg, d.reduce) for n, d in
                       ((n, compiled.exp.diagnostics[n]) for n in compiled.diagnostics))
    self._train_steps: dict[int, TrainStep] = {}
    self._pass_steps = {p: PassStep(gs, self.precision) for p, gs in compiled.passes.items()}
    from sexpgpu.lower.flops import device_peak, train_flops
    self.step_flops = [train_flops(s.graph, self.k) for s in compiled.stages]
    self.peak = device_peak(device.first, self.precision)

  # --- pieces ----------------------------------------------------------------
  def train_step(self, degree: int | None = None) -> TrainStep:
    """The current stage's step at a stacking degree (the chosen one by default)."""
    key = (self.stage, degree or self.stacking)
    if key not in self._train_steps:
      st = self.c.stages[self.stage]
      opt, sched = make_optimizer(st.exp.optimizer, self.steps)
      self._train_steps[key] = TrainStep(st.graph, opt, sched, self.precision, self.k, key[1],
                                         self.seed, self.on_nan, self.diags, self.place.mesh,
                                         self.node_gradients, self.device.platform)
    return self._train_steps[key]

  def pass_every(self, p) -> int | None:
    return p.every if self.every_override is None else self.every_override

  def run_passes(self, step: int, at_end: bool, resumed_at: int | None) -> bool:
    ran = False
    for name, p in self.c.exp.passes.items():
      every = self.pass_every(p)
      due = (every and step % every == 0) or at_end
      if not due or step == resumed_at:
        continue
      self.set_status("evaluating", step)
      t = time.perf_counter()
      loader = self.c.loaders[p.data]
      sums: dict[str, Any] = {}
      for i in range(p.batches):
        batch = self.place.replicate(loader.batch(i))
        vals = self._pass_steps[name](self.state["params"], batch)
        for m, v in vals.items():
          sums[m] = v if m not in sums else sums[m] + v
      # host sync: the progress line needs the numbers
      metrics = {f"{name}/{m}": float(self.place.host(sums[m])) / p.batches
                 for m, _ in p.metrics}
      dt = time.perf_counter() - t
      if name in self.first_pass:
        self.pass_times[name].append(dt)
      else:
        self.first_pass[name] = dt
      self.last_pass.update(metrics)
      self.metrics.emit("pass", step=step, **{"pass": name, "metrics": metrics, "time/pass": dt})
      since = 0.0 if self.t_first_step is None else time.perf_counter() - self.t_first_step
      self.log(output.progress_line(name, step, self.steps, None if step == 0 or
                                    self.train_loss is None else self.train_loss, metrics,
                                    self.counters["records"], since))
      ran = True
    return ran

  def maybe_advance(self, step: int) -> None:
    stages = self.c.stages
    if self.stage + 1 >= len(stages):
      return
    nxt = stages[self.stage + 1]
    env = Env(self.c.exp.env, {k: v for k, v in self.last_pass.items()})
    try:
      holds = Builder(env).eval(nxt.when, env)
    except SxError as e:
      if e.code == "E-NAME-001":
        return  # a metric the condition names has not been measured yet
      raise
    if holds is not None and holds is not False:
      self.metrics.emit("stage", step=step, **{"from": self.stage, "to": self.stage + 1,
                                              "reason": str(nxt.when)})
      self.stage += 1
      self.status_base["stage"] = self.stage

  def set_status(self, state: str, step: int, force: bool = True) -> None:
    now = time.time()
    if not force and now - self._status_at < 1.0:
      return  # written at most once a second while training
    self._status_at = now
    sps = None
    eta = None
    if self.step_times:
      sps = 1.0 / max(float(np.median(self.step_times[-20:])), 1e-9)
      eta = (self.steps - step) / sps
    fields = dict(self.status_base, state=state, step=step, train_loss=self.train_loss,
                  last_pass=dict(self.last_pass), counters=dict(self.counters),
                  steps_per_second=sps, eta_seconds=eta)
    self.status.write(fields)

  # --- checkpoints ------------------------------------------------------------
  def meta(self, step: int) -> dict:
    from sexpgpu.run.loop import _jsonable, _versions
    c = self.c
    meta = {"fingerprint": c.fingerprint, "graph_fingerprint": c.graph_fingerprint,
            "slug": c.slug, "step": step, "stage": self.stage, "ranks": self.place.ranks,
            "nodes": self.place.nodes, "node_gradients": self.node_gradients,
            "stacking": self.stacking, "counters": dict(self.counters),
            "last_pass": dict(self.last_pass), "train_loss": self.train_loss,
            "loaders": {n: ld.state() for n, ld in c.loaders.items()},
            "knobs": {k: _jsonable(v.value) for k, v in c.selection.knobs.items()},
            "versions": _versions(), "sources": dict(c.program.sources)}
    if self.device.platform != "cpu":
      from sexpgpu.run.devices import autotune_results
      tuned = autotune_results()  # under SEXPGPU_DETERMINISTIC: a resume picks the same kernels
      if tuned is not None:
        meta["xla_autotune"] = tuned
    return meta

  def save(self, step: int, wait: bool) -> None:
    if self.store is None:
      return
    self.set_status("checkpointing", step)
    if self.place.multiprocess:
      self._save_nodes(step)
      return
    self._emit_saved()  # the previous save completes first (the store waits for it anyway)
    self.store.save(step, self.state, self.meta(step), wait=wait)
    if wait:
      self._emit_saved()

  def _host_state(self) -> dict:
    """The state on the host; per-device carries gathered from every node (a collective)."""
    from jax.experimental import multihost_utils
    out = {}
    for k, v in self.state.items():
      if k == "carry":
        out[k] = jax.tree_util.tree_map(
            lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), v)
      else:
        out[k] = jax.tree_util.tree_map(self.place.host, v)
    return out

  def _save_nodes(self, step: int) -> None:
    """Every node checks that the ranks agree (E-DP-004); node 0 writes; all wait for it."""
    from sexpgpu.devices.nodes import agree_at_checkpoint, params_hash
    host = self._host_state()
    agree_at_checkpoint(step, params_hash({"params": host["params"], "opt": host["opt"]}),
                        self.rdv)
    if self.place.node == 0:
      self.store.save(step, host, self.meta(step), wait=True)
      self._emit_saved()
    self.rdv.barrier(f"saved-{step}")

  def _emit_saved(self) -> None:
    info = self.store.wait()
    if info is not None and info.location != self.last_ckpt:
      self.last_ckpt = info.location
      self.status_base["checkpoint"] = {"step": info.step, "location": info.location}
      self.metrics.emit("checkpoint", step=info.step, action="saved", location=info.location,
                        bytes=info.bytes, seconds=info.seconds)

  def restore(self, step_dir: str) -> int:
    from sexpgpu.ckpt import read_meta, restore_checkpoint
    meta = read_meta(step_dir)
    self._check_same(meta, step_dir)
    abstract = jax.eval_shape(lambda: self.state)
    t = time.perf_counter()
    state, meta = restore_checkpoint(step_dir, abstract)
    carry = state.pop("carry", None)
    self.state = self.place.replicate(state)
    if carry is not None:  # each node takes its own devices' carries
      share = self.place.local_share(self.place.ranks)
      self.state["carry"] = jax.tree_util.tree_map(
          lambda x: jax.make_array_from_process_local_data(
              self.place._shard, np.asarray(x)[share.start:share.stop], x.shape), carry)
    self.stage = int(meta["stage"])
    self.status_base["stage"] = self.stage
    self.counters = {k: int(v) for k, v in meta["counters"].items()}
    self.last_pass = dict(meta.get("last_pass") or {})
    self.train_loss = meta.get("train_loss")
    self.stacking = int(meta.get("stacking", self.stacking))
    for n, st in meta["loaders"].items():
      self.c.loaders[n].set_state(st)
    self.last_ckpt = step_dir
    self.status_base["checkpoint"] = {"step": int(meta["step"]), "location": step_dir}
    self.metrics.emit("checkpoint", step=int(meta["step"]), action="restored", location=step_dir,
                      bytes=None, seconds=time.perf_counter() - t)
    return int(meta["step"])

  def _check_same(self, meta: dict, step_dir: str) -> None:
    ranks, nodes = self.place.ranks, self.place.nodes
    if meta.get("ranks", 1) != ranks or meta.get("nodes", 1) != nodes:
      raise SxError("E-DP-002", f"the checkpoint was written by {meta.get('ranks')} ranks on "
                    f"{meta.get('nodes')} nodes; this run has {ranks} rank"
                    f"{'s' if ranks != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''}",
                    where=step_dir,
                    fix="resume with the checkpoint's nodes and devices")
    if meta.get("fingerprint") == self.c.fingerprint:
      return
    theirs = meta.get("knobs", {})
    ours = {k: v.value for k, v in self.c.selection.knobs.items()}
    diffs = [f"{k} {format_value(theirs.get(k))} → {format_value(ours.get(k))}"
             for k in sorted(set(theirs) | set(ours)) if k not in NOT_IN_FINGERPRINT
             and str(theirs.get(k)) != str(ours.get(k))]
    what = ("knobs differ: " + ", ".join(diffs)) if diffs else "the model's IR differs"
    raise SxError("E-CKPT-002", f"the checkpoint is of another experiment ({what})",
                  where=step_dir, fix="resume with the selection that wrote it, or start afresh "
                  "without --resume")

  # --- the loop -------------------------------------------------------------
  def _abstract_batches(self, loader_name: str, lead: tuple) -> dict:
    return {f: jax.ShapeDtypeStruct(lead + sh, jnp.dtype(_np(dt)))
            for f, (dt, sh) in self.c.fields[loader_name].items()}

  def _plan(self, fixed: int | None):
    """Compiles the steps abstractly, plans memory (E-MEM-001) and chooses the stacking."""
    from sexpgpu.run import plan
    from sexpgpu.run.compile import cache_dir
    c = self.c
    batches = self._abstract_batches(c.stages[self.stage].data, (self.k,))
    rep = self.place.abstract
    pass_inputs = {n: (rep(self.state["params"]), rep(self._abstract_batches(p.data, ())))
                   for n, p in c.exp.passes.items()}
    choice = plan.choose(self.train_step, self.k // self.place.ranks, fixed, self.state, batches,
                         self._pass_steps, pass_inputs, self.device, self.store is not None,
                         c.graph_fingerprint, cache_dir(), c.selection.knobs,
                         several_nodes=self.place.multiprocess, ranks=self.place.ranks)
    self.choice = choice
    self.stacking = choice.degree
    self._annotate(choice)
    return choice

  def _annotate(self, choice) -> None:
    from sexpgpu.devices.report import lowering_annotation, lowering_report
    compiled = next(iter(choice.executables.values()))
    patterns = self.c.patterns
    regions = region_lines(self.c.regions, self.train_step().notes)
    ann = lowering_annotation(self.device, patterns, regions, compiled, choice.plan, choice.text)
    self.metrics.emit("annotation", name="lowering", text="\n".join(ann["lines"]),
                      **{k: v for k, v in ann.items() if k not in ("kind", "lines")})
    self.metrics.emit("annotation", name="memory", text=choice.plan.text(),
                      parts=choice.plan.parts, peak_at=choice.plan.peak_at,
                      total=choice.plan.total, free=choice.plan.free)
    self._emit_stacking(choice)
    if self.device.platform != "cpu":
      for line in lowering_report(self.device, patterns, regions, compiled, choice.plan,
                                  choice.text):
        self.log(line)

  def _measure(self, batches) -> None:
    from sexpgpu.run import plan
    from sexpgpu.run.compile import cache_dir
    self.choice = plan.measure(self.choice, self.train_step, self.state, batches,
                               self.k // self.place.ranks, self.c.graph_fingerprint, self.device,
                               cache_dir(), self.place.ranks)
    self.stacking = self.choice.degree
    self._emit_stacking(self.choice)

  def _emit_stacking(self, choice) -> None:
    self.metrics.emit("annotation", name="stacking", text=choice.text, degree=choice.degree,
                      how=choice.how, plans={str(d): t for d, t in choice.totals.items()},
                      predicted={str(d): t for d, t in choice.predicted.items()})

  def train(self, resume_dir: str | None, sig, t_setup: float, open_s: float):
    from sexpgpu.run.loop import Summary
    t0 = time.perf_counter()
    self.t_first_step = None
    c = self.c
    fixed = self.o.stacking
    resume_meta = None
    if resume_dir is not None:
      from sexpgpu.ckpt import read_meta
      resume_meta = read_meta(resume_dir)
      self._check_same(resume_meta, resume_dir)
      self.stage = int(resume_meta["stage"])
      fixed = int(resume_meta.get("stacking", self.stacking))  # a resume keeps its stacking
    # Everything is planned on abstract values: no initializer runs before the plan fits.
    opt, _ = make_optimizer(c.stages[self.stage].exp.optimizer, self.steps)
    self.state = jax.eval_shape(lambda: init_state(init_params(self.seed, c.params), opt))
    carried = self.place.multiprocess and self.node_gradients == "bf16"
    if carried:  # one rounding-error carry per device for the bf16 sum between nodes
      self.state["carry"] = jax.tree_util.tree_map(
          lambda p: jax.ShapeDtypeStruct((self.place.ranks,) + p.shape, jnp.float32),
          self.state["params"])
    choice = self._plan(fixed)
    if resume_dir is not None:
      start = self.restore(resume_dir)
    else:
      start = 0
      with jax.default_device(self.device):
        self.state = self.place.replicate(init_state(init_params(self.seed, c.params), opt))
      if carried:
        n = len(self.place.local_devices)
        self.state["carry"] = {k: self.place.shard(np.zeros((n,) + v.shape, np.float32),
                                                   self.place.ranks)
                               for k, v in self.state["params"].items()}
    resumed_at = start if resume_dir is not None else None
    # The compiler's objects live as long as the run: keep them out of the collector's scans,
    # so a collection in the step loop walks only what the loop itself allocates.
    import gc
    gc.collect()
    gc.freeze()
    step0_s = time.perf_counter() - t0
    self.run_passes(start, start == self.steps, resumed_at)
    stopped_by = None
    step = start
    self.set_status("running", step)
    multi = self.place.multiprocess
    while step < self.steps:
      if sig.received is not None and not multi:
        stopped_by = sig.received
        break
      loader = c.loaders[c.stages[self.stage].data]
      mbs = self._next_microbatches(loader)
      batches = self.place.shard(_stack(mbs), self.k)
      if self.choice.how == "measure":
        self._measure(batches)
      st = self.train_step()
      t = time.perf_counter()
      if self.t_first_step is None:
        self.t_first_step = t
      with self._watch(f"step {step + 1}"), self._quiet(step == start):
        self.state, m = self._call_step(st, batches, sig, step + 1)
        m = dict(zip(st.step_names, np.asarray(self.place.host(m)).tolist()))  # host sync
      dt = time.perf_counter() - t
      step += 1
      self.step_times.append(dt)
      self.counters["records"] += self.k * loader.batch_size
      if "tokens" in self.counters and "tokens" in mbs[0]:
        self.counters["tokens"] += self.k * int(mbs[0]["tokens"].size)
      if not bool(m["finite"]):
        self.counters["skipped-steps"] = self.counters.get("skipped-steps", 0) + 1
        if self.on_nan == "stop":
          self.save(step - 1, wait=True)
          raise SxError("E-NUM-001", f"the loss is not finite at step {step}", where=c.program.path,
                        fix="lower the learning rate, add :clip, or set :on-nan skip; the last "
                        "finite state was checkpointed when a location was given")
      else:
        self.train_loss = float(m["loss"])
      self._step_event(step, m, dt, len(mbs))
      if multi and m.get("stop"):  # a signal on some node: every node stops here
        stopped_by = int(m["stop"])
        break
      at_end = step == self.steps
      self.run_passes(step, at_end, None)
      if self.c.exp.passes:
        self.maybe_advance(step)
      if at_end:
        break
      if self.ckpt_every and step % self.ckpt_every == 0:
        self.save(step, wait=False)
      self.set_status("running", step, force=False)
    if self.store is not None:
      if step == self.steps or stopped_by is not None:
        if step > start or resume_dir is None:
          self.save(step, wait=True)
      self._emit_saved()
    total = time.perf_counter() - t_setup
    compiled_n, compile_s, hits = self.counter.snapshot()
    for line in output.timing_lines(c.graph_seconds, open_s, compiled_n, compile_s, hits, step0_s,
                                    self.first_pass, self.step_times, start + 1, step,
                                    self.pass_times, total, step - start):
      self.log(line)
    self._peak_line()
    from sexpgpu.run.loop import SIGNALS
    summary = Summary(step, self.train_loss, {k: v for k, v in self.last_pass.items()},
                      dict(self.counters), self.stage, self.metrics.summary_path(), self.o.status,
                      c.slug, SIGNALS.get(stopped_by) if stopped_by else None, self.last_ckpt,
                      128 + int(stopped_by) if stopped_by else 0)
    import gc
    gc.unfreeze()  # a notebook may compile and run again in this process
    self.set_status("stopped" if stopped_by else "done", step)
    self.metrics.emit("summary", **{k: v for k, v in summary.as_dict().items() if k != "kind"})
    self.metrics.close()
    if not self.o.json:
      for line in output.done_lines(step, self.train_loss, summary.eval, summary.counters):
        self.log(line)
    return summary

  def _call_step(self, st, batches, sig, step: int):
    """One step; an allocation that fails is retried once after releasing JAX's caches,
    when the state it was given is still whole (not yet donated to the failed call)."""
    import gc
    for attempt in (0, 1):
      try:
        if st.ranks > 1:
          return st(self.state, batches, st.stop_flags(sig.received or 0))
        return st(self.state, batches)
      except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        whole = not any(getattr(x, "is_deleted", lambda: False)()
                        for x in jax.tree_util.tree_leaves(self.state))
        detail = str(e).strip().splitlines()[0][:200]
        retry = attempt == 0 and whole
        line = (f"memory: allocation failed at step {step} ({detail}); caches released, "
                + ("retrying once" if retry else "stopping"))
        self.log(line)
        self.metrics.emit("annotation", name="allocation failed", text=line, step=step,
                          retried=retry)
        if not retry:
          from sexpgpu.run.plan import shrink_hints
          raise SxError("E-MEM-001", f"an allocation failed at step {step} although the plan "
                        f"fit ({detail})", where="the device's memory",
                        fix="the last checkpoint is intact; shrink the run: "
                        + "; ".join(shrink_hints(self.c.selection.knobs) +
                                    [":remat true on the repeated block",
                                     "SEXPGPU_MEMORY to plan against less"])) from None
        jax.clear_caches()
        gc.collect()

  def _peak_line(self) -> None:
    """On a GPU: `memory: peak X of Y planned (+Z%)`, the allocator's peak against the plan."""
    from sexpgpu.devices.memory import peak_line
    from sexpgpu.run.devices import peak_bytes
    if self.device.platform == "cpu":
      return
    peak = peak_bytes(self.device)
    if peak is not None:
      line = peak_line(peak, self.choice.plan)
      self.log(line)
      self.metrics.emit("annotation", name="memory peak", text=line, peak=peak,
                        planned=self.choice.plan.total)

  def _next_microbatches(self, loader) -> list[dict]:
    """The step's microbatches this process computes (all K on one process)."""
    if not self.place.multiprocess:
      return [loader.next() for _ in range(self.k)]
    base = loader.position
    mbs = [loader.batch(base + j) for j in self.place.local_share(self.k)]
    state = loader.state()
    state["position"] = base + self.k  # every node's loader moves past the whole step
    loader.set_state(state)
    return mbs

  def _quiet(self, first: bool):
    """Around the first cross-node step: gloo announces its peers on our output streams."""
    import contextlib
    if first and self.place.multiprocess:
      from sexpgpu.devices.nodes import quiet_collectives
      return quiet_collectives()
    return contextlib.nullcontext()

  def _watch(self, what: str):
    """Around a wait on other nodes: a node that left becomes E-DP-007, not a hang."""
    import contextlib
    return self.rdv.watch(what) if self.rdv is not None else contextlib.nullcontext()

  def _step_event(self, step: int, m: dict, dt: float, n_mb: int) -> None:
    toks = self.counters.get("tokens")
    tps = None
    mfu = None
    if self.peak:
      mfu = self.step_flops[self.stage] / max(dt, 1e-9) / self.peak
    if toks is not None:
      per_step = self.k * int(np.prod(self.c.fields[self.c.stages[self.stage].data]
                                      .get("tokens", ("i32", (0,)))[1]))
      tps = per_step / max(dt, 1e-9)
    ev = {"train/loss": float(m["loss"]), "train/lr": float(m["lr"]),
          "train/grad-norm": float(m["grad_norm"]), "time/step": dt,
          "throughput/tokens-per-second": tps, "throughput/mfu": mfu,
          "counters": dict(self.counters)}
    if self.device.platform != "cpu":
      from sexpgpu.run.devices import peak_bytes
      ev["runtime/peak_bytes"] = peak_bytes(self.device)
    self.metrics.emit("step", step=step, **ev)
    for d in self.diags:
      dd = self.c.exp.diagnostics[d.name]
      if step % max(dd.every, 1) == 0:
        self.metrics.emit("diagnostic", step=step, name=d.name, value=float(m["diag/" + d.name]))


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
    text = f"{n} region{'s' if n != 1 else ''} → {became} ({causal})"
    if whys and "cudnn" not in impls:
      text += f": {'; '.join(whys)}"
    out.append(("attention", text))
  for r in regions:
    if r.kind == "cross-entropy":
      out.append(("cross-entropy", f"{r.times} region → chunked, {r.detail}"))
  return out


def _np(dt: str):
  from sexpgpu.ir.shapes import np_dtype
  return np_dtype(dt)

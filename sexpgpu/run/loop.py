"""The training loop: setup, steps, passes, curriculum, checkpoints, the done block."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import time
from typing import Any

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.front.values import Env
from sexpgpu.lang.select import format_value
from sexpgpu.run import output
from sexpgpu.run.compile import Compiled, cache_dir
from sexpgpu.run.devices import (CompileCounter, microbatches_divide, open_devices,
                                 parse_device_list)

SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", signal.SIGHUP: "SIGHUP"}


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

  def as_dict(self) -> dict:
    d = {"kind": "summary", "steps": self.steps, "train_loss": self.train_loss,
         "eval": self.eval, "counters": self.counters, "stage": self.stage,
         "metrics": self.metrics, "status": self.status, "slug": self.slug,
         "stopped_by": self.stopped_by, "checkpoint": self.checkpoint}
    return d


class _Signals:
  """Turns SIGTERM/SIGINT/SIGHUP into a flag read at step boundaries."""

  def __init__(self):
    self.received: int | None = None
    self._old = {}

  def __enter__(self):
    for s in SIGNALS:
      self._old[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.received is None:
      self.received = signum

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


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


def _evals_field(passes: dict, every_override) -> str:
  if not passes:
    return "-"
  out = []
  for name, p in passes.items():
    every = p.every if every_override is None else every_override
    out.append(f"{name}@{every}" if every else f"{name}@end")
  return ",".join(out)


def _versions() -> dict:
  import jax
  import jaxlib
  from importlib.metadata import version
  return {"sexpgpu": version("sexpgpu"), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": platform.python_version()}


class Trainer:
  """Runs one compiled experiment; `run()` returns its Summary."""

  def __init__(self, compiled: Compiled, opts: RunOptions):
    self.c = compiled
    self.o = opts
    self.exp = compiled.exp
    self.run_knobs = compiled.exp.run
    self.steps = int(self.run_knobs["steps"])
    self.k = int(self.run_knobs["microbatches"])
    self.every = self.run_knobs.get("eval-every")
    self.t_begin = time.perf_counter()

  def _log(self, line: str) -> None:
    if not self.o.quiet:
      output.err(line)

  # --- setup ---------------------------------------------------------------
  def run(self) -> Summary:
    from sexpgpu.track import StatusFile, open_metrics
    c, o = self.c, self.o
    from sexpgpu.devices.env import parse_nodes
    # Node variables are read before anything starts a JAX backend (E-DP-005).
    self.nodes_cfg = parse_nodes(os.environ, o.device)
    self.node = self.nodes_cfg.rank if self.nodes_cfg else 0
    counter = CompileCounter.install(cache_dir())
    self.status = StatusFile(o.status if self.node == 0 else None)  # node 0 writes it
    started = time.time()
    self.status_base = {"slug": c.slug, "pid": os.getpid(), "steps": self.steps, "stage": 0,
                        "started_at": started, "error": None, "checkpoint": None}
    self.status.write({**self.status_base, "state": "compiling", "step": 0, "train_loss": None,
                       "last_pass": {}, "counters": {}, "steps_per_second": None,
                       "eta_seconds": None})
    try:
      return self._run(counter, open_metrics)
    except SxError as e:
      self.status.update(state="failed", error={"code": e.code, "message": e.message})
      raise

  def _run(self, counter, open_metrics) -> Summary:
    import jax
    c, o = self.c, self.o
    ordinals = parse_device_list(os.environ.get("SEXPGPU_DEVICES"))
    t_open = time.perf_counter()
    self.rdv = None
    if o.device == "cpu" and wants_kept_host_memory(c):  # before anything starts the backend
      from sexpgpu.run.devices import keep_host_memory
      keep_host_memory()
    if o.device == "cuda":  # before anything starts the backend, on one node or several
      from sexpgpu.run.devices import autotune_of, deterministic, deterministic_flags
      deterministic_flags(autotune_of(self._resume_meta()) if deterministic() else None)
    if self.nodes_cfg is not None:
      from sexpgpu.devices import nodes
      from sexpgpu.devices.env import rendezvous_timeout

      def on_timeout(err):
        self.status.update(state="failed", error={"code": err.code, "message": err.message})

      if o.device == "cpu":
        from sexpgpu.run.devices import cpu_flags
        cpu_flags()
      self.rdv = nodes.initialize(self.nodes_cfg, rendezvous_timeout(), on_timeout, ordinals)
    device = open_devices(o.device, ordinals, self.nodes_cfg)
    open_s = time.perf_counter() - t_open
    microbatches_divide(self.k, device.ranks)
    store, resume_dir, resume_text = self._checkpoint_setup()
    self.metrics = open_metrics(o.metrics if self.node == 0 else None, c.slug)
    self._log(output.config_line(
        o.file, c.slug, o.device, self.steps, self.k, _evals_field(c.exp.passes, self.every),
        ",".join(c.diagnostics) or "-", self.run_knobs["precision"], self.run_knobs["seed"],
        o.checkpoint_dir or "-", resume_text, o.status or "-", ranks=device.ranks,
        nodes=device.nodes))
    if self.metrics.describe():
      self._log(f"metrics: {self.metrics.describe()}")
    self.metrics.emit("config", file=c.program.path, fingerprint=c.fingerprint, device=o.device,
                      ranks=device.ranks, nodes=device.nodes, knobs={k: {"value": _jsonable(v.value), "source": v.source}
                                                for k, v in c.selection.knobs.items()},
                      versions=_versions(), resume=resume_text)
    t0 = time.perf_counter()
    from sexpgpu.run.session import Session
    if self.rdv is not None:
      from sexpgpu.devices.nodes import compare_at_rendezvous
      compare_at_rendezvous({"nodes": device.nodes, "node": self.node,
                             "gpus": len(device.local_devices), "fingerprint": c.fingerprint,
                             "gradients": self.nodes_cfg.gradients, "resume": resume_dir or "-"},
                            self.rdv)
    sess = Session(c, o, device, self.metrics, self.status, self.status_base, store, self._log,
                   counter, self.rdv, self.nodes_cfg.gradients if self.nodes_cfg else "f32")
    try:
      with _Signals() as sig:
        summary = sess.train(resume_dir, sig, t0, open_s)
    except BaseException:
      if store is not None:  # the error in flight is the one to report
        with contextlib.suppress(Exception):
          store.close()
      raise
    if store is not None:
      store.close()  # orbax's threads, and a remote run's staging folder
    return summary

  def _resume_meta(self) -> dict | None:
    """The meta of the checkpoint --resume names, read before the device opens, or None."""
    from sexpgpu.ckpt import peek_meta, resolve_resume
    if not self.o.resume:
      return None
    try:
      step_dir, _ = resolve_resume(self.o.resume, self.o.checkpoint_dir, self.c.slug)
    except SxError:
      return None  # reported with its code when the run resolves it again
    return peek_meta(step_dir) if step_dir else None

  def _checkpoint_setup(self):
    o = self.o
    store = None
    if o.checkpoint_dir:
      from sexpgpu.ckpt import CheckpointStore
      store = CheckpointStore(o.checkpoint_dir, self.c.slug, int(self.run_knobs["keep"]))
      if self.node == 0:  # node 0 writes the checkpoints
        store.check_writable()
    if not o.resume:
      return store, None, "-"
    from sexpgpu.ckpt import resolve_resume
    step_dir, text = resolve_resume(o.resume, o.checkpoint_dir, self.c.slug)
    return store, step_dir, text


def _jsonable(v: Any) -> Any:
  if isinstance(v, (bool, int, float)) or v is None:
    return v
  return str(v)


def run_compiled(compiled: Compiled, opts: RunOptions) -> Summary:
  """Trains a compiled experiment in this process."""
  return Trainer(compiled, opts).run()

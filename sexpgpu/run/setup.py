"""A run's set-up before its plan: the backend and devices, the checkpoint location and the
resume, the metrics targets with the configuration line, and the training steps."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import jax

from sexpgpu import env
from sexpgpu import record, retrying
from sexpgpu.env import check_visible, cpu_visible, rendezvous_timeout
from sexpgpu.errors import SxError, scrub
from sexpgpu.lang.select import NOT_IN_FINGERPRINT
from sexpgpu.lower.flops import device_peak, forward_bytes, train_flops
from sexpgpu.models.warm import source_of
from sexpgpu.run import output, signals
from sexpgpu.run.planning import layout_choice
from sexpgpu.run.compile import cache_dir
from sexpgpu.run.backend import (MMAP_CEILING, TRIM_CEILING, autotune_of, cpu_flags, deterministic,
                                 deterministic_flags, keep_host_memory, microbatches_divide,
                                 open_devices, parse_device_list)
from sexpgpu.run.profile import Profile, default_dir
from sexpgpu.run.training import build
from sexpgpu.track import open_metrics as open_targets


def wants_kept_host_memory(c) -> bool:
  """Whether keeping host memory between steps pays for this experiment on the CPU.

  It does when a microbatch's forward values (an estimate of the step's temporary
  buffer, counted from the IR) lie between glibc's mmap ceiling, below which glibc
  reuses buffers without help, and its trim ceiling, above which it gives a freed
  buffer back to the OS anyway (devices.keep_host_memory).
  """
  return MMAP_CEILING < max(forward_bytes(s.graph) for s in c.stages) <= TRIM_CEILING


def open_backend(c, o, nodes_cfg, progress, log):
  """Starts the backend, opens the run's devices and, for `:sharding auto`, chooses the
  layout on them (written into the experiment before its Training is built).

  Returns:
    (the Placement, the rendezvous of several nodes or None, seconds it took).

  Raises:
    SxError: E-DEV-*, E-DP-* (devices, nodes, microbatches that do not divide), E-MEM-001
      (no layout fits).
  """
  ordinals = parse_device_list(env.get("SEXPGPU_DEVICES"))
  t_open = time.perf_counter()
  rdv = _before_backend(c, o, nodes_cfg, ordinals, progress)
  if rdv is not None:  # E-DP-007 names it, also when a thread of ours sees a node leave
    rdv.checkpoint = lambda: progress.last_ckpt
  place = open_devices(o.device, ordinals, nodes_cfg)
  open_s = time.perf_counter() - t_open
  microbatches_divide(int(c.exp.run["microbatches"]), place.ranks)
  layout_choice.resolve(c, place, cache_dir(), log)
  return place, rdv, open_s


def _before_backend(c, o, nodes_cfg, ordinals, progress):
  """What must happen before anything starts a JAX backend; returns the rendezvous or None."""
  if o.device == "cpu" and wants_kept_host_memory(c):
    keep_host_memory()
  if o.device == "cuda":  # on one node or several
    deterministic_flags(autotune_of(_resume_meta(c, o)) if deterministic() else None)
  if nodes_cfg is None:
    return None
  from sexpgpu.devices import nodes

  def on_timeout(err):
    progress.failed(err.code, err.message)

  if o.device == "cpu":
    cpu_flags()
    if ordinals:  # SEXPGPU_DEVICES=0,1 gives each node that many host devices
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


def open_checkpoints(c, o, node: int):
  """The checkpoint store (None without a location) and the step folder to resume from.

  Returns:
    (store or None, step folder or None, the configuration line's `resume` field).

  Raises:
    SxError: E-CKPT-* for a location that cannot be written (node 0 checks) or a
      resume that cannot be resolved.
  """
  store = None
  if o.checkpoint_dir:
    from sexpgpu.ckpt import CheckpointStore
    store = CheckpointStore(o.checkpoint_dir, c.slug, int(c.exp.run["keep"]))
    if node == 0:  # node 0 writes the checkpoints
      store.check_writable()
  signals.starting(None, store is not None)  # what a stop's line says from now
  if not o.resume:
    if store is not None:
      _refuse_unresumed(c, store)
    return store, None, "-"
  from sexpgpu.ckpt import resolve_resume
  step_dir, text = resolve_resume(o.resume, o.checkpoint_dir, c.slug)
  signals.starting(step_dir, store is not None)
  if store is not None and node == 0 and step_dir:
    _say_later_steps(store, step_dir)
  return store, step_dir, text


def _say_later_steps(store, step_dir: str) -> None:
  """A resume from an older step of the run's own location: its later steps are replaced as
  this run saves those steps (a rollback past a loss spike), said before the first one is."""
  parent, name = os.path.split(step_dir.rstrip("/"))
  same = (parent.rstrip("/") == store.run_dir.rstrip("/") if store.remote
          else os.path.realpath(parent) == os.path.realpath(store.run_dir))
  if not (same and name.isdigit()):
    return
  later = [s for s in store.steps() if s > int(name)]
  if later:
    shown = ", ".join(map(str, later[:5])) + (", ..." if len(later) > 5 else "")
    output.err(f"resume: from step {name} of {scrub(store.run_dir)}, which holds later "
               f"step{'s' if len(later) > 1 else ''} {shown}: each is replaced when this run "
               "saves that step")


def _refuse_unresumed(c, store) -> None:
  """Refuses, before anything is planned or initialized, a run that does not resume into a
  location that already holds its slug's checkpoints (E-CKPT-006): its saves would replace
  them a step at a time, and `--resume latest` would then mix the two runs.

  Raises:
    SxError: E-CKPT-006 naming the steps there, the store closed (its lock released).
  """
  earlier = store.steps()
  if not earlier:
    return
  store.close()
  shown = ", ".join(map(str, earlier[-5:]))
  run_dir = scrub(store.run_dir)
  raise SxError("E-CKPT-006", f"{run_dir} already holds run {c.slug}'s checkpoints "
                f"(step{'s' if len(earlier) > 1 else ''} {shown}), and this run does not "
                "resume: its own would replace them one step at a time", where=store.where,
                fix=f"--resume latest continues from step {earlier[-1]}; to start over, "
                f"give another --checkpoint-dir or SEXPGPU_RUN_SLUG, or remove {run_dir}")


def open_metrics(c, o, place, node: int, resume_text: str, log):
  """The metrics targets (node 0 writes them), announced: the configuration line, the
  `metrics:` line and the config event."""
  metrics = open_targets(o.metrics if node == 0 else None, c.slug, where=o.metrics_where)
  log(output.config_line(c, o, place, resume_text))
  if metrics.describe():
    log(f"metrics: {metrics.describe()}")
  metrics.emit("config", file=c.program.path, fingerprint=c.fingerprint, device=o.device,
               ranks=place.ranks, nodes=place.nodes,
               knobs={n: {"value": record.jsonable(v.value), "source": v.source}
                      for n, v in c.selection.knobs.items()},
               versions=record.versions(), resume=resume_text)
  return metrics


@contextlib.contextmanager
def retries_noted(metrics) -> Iterator[None]:
  """While the block runs, each retry line of a remote operation (a checkpoint's upload, a
  loader's fetch, from whichever thread) is also an annotation on the metrics stream:
  `retry`, `retry-succeeded` or `retry-failed`, with the line as its text."""
  stop = retrying.listen(lambda name, text: metrics.emit("annotation", name=name, text=text))
  try:
    yield
  finally:
    stop()


def build_training(c, place, nodes_cfg, rdv, resume_dir: str | None, progress):
  """The run's Training, once every node agrees that it runs the same experiment; the
  model flops of a step and the device's peak (for MFU) go into `progress`.

  Raises:
    SxError: E-DP-006 when a node differs from node 0 at the rendezvous.
  """
  node_gradients = nodes_cfg.gradients if nodes_cfg else "f32"
  if rdv is not None:
    from sexpgpu.devices.nodes import compare_at_rendezvous
    compare_at_rendezvous({"nodes": place.nodes, "node": nodes_cfg.rank,
                           "gpus": len(place.local_devices), "fingerprint": c.fingerprint,
                           "gradients": node_gradients, "resume": resume_dir or "-",
                           "knobs": {k: str(v.value) for k, v in c.selection.knobs.items()
                                     if k in NOT_IN_FINGERPRINT}}, rdv)
  training = build(c, place, node_gradients)
  if resume_dir is None and not source_of(c):  # a cold start: its initial state compiles
    training.prepare_init()  # in a thread while the plan compiles the steps
  progress.flops = [train_flops(s.graph, training.k) for s in c.stages]
  progress.peak = device_peak(place.first, training.precision, cache_dir())
  if any("tokens" in f for f in c.fields.values()):
    progress.counters["tokens"] = 0
  return training


def open_profile(c, o):
  """The run's Profile when --profile asked for one, else None."""
  if o.profile is None:
    return None
  return Profile(*o.profile, o.profile_dir or default_dir(c.slug, o.metrics))

"""The run's side of checkpoints: saving (Saver), resuming, and the checks of a resume.

What a checkpoint's meta holds is ckpt/meta.py's; this module fills it from the run. The
checkpoint modules are imported where a checkpoint is written or read: they load orbax.
"""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np


def identity(c) -> dict:
  """The experiment's identity in a checkpoint's meta (fingerprints, slug, knobs, sources)."""
  from sexpgpu.ckpt import meta as ckpt_meta
  return ckpt_meta.identity(c.fingerprint, c.graph_fingerprint, c.slug,
                            {k: v.value for k, v in c.selection.knobs.items()},
                            c.program.sources)


def check_same(c, place, meta_: dict, step_dir: str) -> None:
  """Refuses a checkpoint of another rank count (E-DP-002) or experiment (E-CKPT-002)."""
  from sexpgpu.ckpt import meta as ckpt_meta
  ckpt_meta.check_placement(meta_, step_dir, place.ranks, place.nodes)
  ckpt_meta.check_experiment(meta_, step_dir, c.fingerprint,
                             {k: v.value for k, v in c.selection.knobs.items()})


def resumed_plan(c, place, resume_dir: str | None, stacking: int | None) -> tuple[int, int | None]:
  """The stage to plan for and the stacking to keep: a resume's, checked to be of this
  experiment and placement, else stage 0 and `stacking` (SEXPGPU_STACKING or None).

  Raises:
    SxError: E-DP-002, E-CKPT-002 (check_same); E-CKPT-003 for an unreadable meta.
  """
  if resume_dir is None:
    return 0, stacking
  from sexpgpu.ckpt import read_meta
  meta_ = read_meta(resume_dir)
  check_same(c, place, meta_, resume_dir)
  if "stacking" in meta_:
    stacking = int(meta_["stacking"])  # a resume keeps its stacking: the same sums
  return int(meta_["stage"]), stacking


def resume(ctx, resume_dir: str):
  """The state of the checkpoint at `resume_dir`, placed as the run keeps it; the run's
  progress and loaders as they were at its step.

  Args:
    ctx: the RunContext (its experiment, Training, progress and metrics).
    resume_dir: the step folder.

  Returns:
    (the state, the step it is at).
  """
  from sexpgpu.run import reference
  c, training, progress, metrics = ctx.c, ctx.training, ctx.out.progress, ctx.out.metrics
  stage = progress.stage  # the checkpoint's (resumed_plan)
  # the reference model's copies are not in the checkpoint: read again, checked (E-REF-001)
  refs = reference.resumed(c, training, resume_dir)
  abstract_state = reference.without(training.abstract_state(stage))
  state, meta_, secs = restore(resume_dir, abstract_state, training.place,
                               lambda s: training.place_state(reference.with_values(s, refs),
                                                              stage),
                               training.place_abstract(abstract_state, stage),
                               training.sharding != "replicate")
  start = int(meta_["step"])
  progress.stage = int(meta_["stage"])
  progress.base["stage"] = progress.stage
  progress.counters = {n: int(v) for n, v in meta_["counters"].items()}
  progress.last_pass = dict(meta_.get("last_pass") or {})
  unfinished = meta_.get("passes_unfinished")
  progress.passes_unfinished = int(unfinished) if isinstance(unfinished, int) else None
  progress.train_loss = meta_.get("train_loss")
  for n, st in meta_["loaders"].items():
    c.loaders[n].set_state(st)
  progress.checkpointed(start, resume_dir)
  metrics.emit("checkpoint", step=start, action="restored", location=resume_dir, bytes=None,
               seconds=secs)
  return state, start


class Saver:
  """The run's checkpoints: when they are due, what their meta says, saving on one node or
  several, and the `checkpoint` events of what was saved. A context: the store is closed
  at the end (orbax's threads, a remote run's staging folder), quietly when an error is
  already on its way out.
  """

  def __init__(self, store, ctx, rdv):
    """Args: store: the CheckpointStore, or None (nothing is saved); ctx: the RunContext
    (the experiment and its Training; the progress and metrics that the meta and the events
    record); rdv: the rendezvous of several nodes, or None."""
    c = ctx.c
    self.store, self.c, self.training = store, c, ctx.training
    self.progress, self.metrics, self.rdv = ctx.out.progress, ctx.out.metrics, rdv
    self.every = int(c.exp.run["checkpoint-every"])
    self.reference_digest: str | None = None  # of the reference's copies, once computed

  def __enter__(self) -> "Saver":
    return self

  def __exit__(self, kind, value, tb) -> None:
    if self.store is None:
      return
    if kind is None:
      self.store.close()
    else:
      with contextlib.suppress(Exception):  # the error in flight is the one to report
        self.store.close()

  def due(self, step: int) -> bool:
    """Whether `:checkpoint-every` falls on `step`."""
    return bool(self.every) and step % self.every == 0

  def meta(self, step: int, stacking: int, loader_states: dict) -> dict:
    """The meta of a checkpoint at `step` (loaders as of `step`, not as drawn ahead)."""
    from sexpgpu.ckpt import meta as ckpt_meta
    p, place, training = self.progress, self.training.place, self.training
    out = ckpt_meta.build(identity(self.c), step, p.stage, counters=p.counters,
                          last_pass=p.last_pass, train_loss=p.train_loss, loaders=loader_states,
                          ranks=place.ranks, nodes=place.nodes,
                          node_gradients=training.node_gradients, stacking=stacking,
                          sharding=training.sharding,
                          mesh=dict(place.mesh.shape) if place.mesh is not None else {})
    if p.passes_unfinished == step:  # a stop cut this step's passes short: resume redoes them
      out["passes_unfinished"] = step
    if place.first.platform != "cpu":
      from sexpgpu.run.backend import autotune_results
      tuned = autotune_results()  # under SEXPGPU_DETERMINISTIC: a resume picks the same kernels
      if tuned is not None:
        out["xla_autotune"] = tuned
    return out

  def save(self, step: int, state: dict, stacking: int, loader_states: dict,
           wait: bool) -> None:
    """Saves `state` as step `step` (nothing without a store); `wait`: until committed."""
    if self.store is None:
      return
    self.progress.set_status("checkpointing", step)
    meta_ = self.meta(step, stacking, loader_states)
    from sexpgpu.run import reference  # its copies are read again at a resume, not saved
    if self.reference_digest is None:
      self.reference_digest = reference.state_digest(state, self.training.place) or ""
    if self.reference_digest:
      meta_[reference.META_KEY] = self.reference_digest
    state = reference.without(state)
    place = self.training.place
    if place.multiprocess:
      if self.training.sharding == "replicate":
        save_nodes(self.store, state, meta_, step, place, self.rdv)
      else:
        save_sharded_nodes(self.store, state, meta_, step, self.rdv)
      self.saved()
      if place.node != 0:  # node 0 wrote it, and every node waited until it was committed
        self.progress.last_ckpt = self.store.step_dir(step)
      return
    self.saved()  # the previous save completes first
    self.store.save(step, state, meta_, wait=wait)
    if wait:
      self.saved()

  def saved(self) -> None:
    """Waits for the save in flight; its `checkpoint` event once it is committed."""
    info = self.store.wait()
    if info is not None and info.location != self.progress.last_ckpt:
      self.progress.checkpointed(info.step, info.location)
      self.metrics.emit("checkpoint", step=info.step, action="saved", location=info.location,
                        bytes=info.bytes, seconds=info.seconds)

  def finish(self, step: int, state: dict, stacking: int, loader_states: dict,
             new_steps: bool) -> None:
    """The last checkpoint: after the last step or a stop, when this session trained a
    step or did not resume (a resume at its checkpoint's step writes nothing new)."""
    if self.store is None:
      return
    if new_steps:
      self.save(step, state, stacking, loader_states, wait=True)
    self.saved()


def restore(step_dir: str, abstract_state: dict, place, put=None,
            placed: dict | None = None, sharded: bool = False) -> tuple[dict, dict, float]:
  """The state and meta of a checkpoint, placed on the run's devices.

  Args:
    step_dir: the step folder.
    abstract_state: the state's ShapeDtypeStructs.
    place: the run's Placement.
    put: puts the restored state where the run keeps it (default: replicated).
    placed: abstract_state with the run's shardings: a checkpoint whose processes each
      wrote their shards is read straight into them.
    sharded: whether the run shards its state (`put` then places the carries too).

  Returns:
    (state, meta, seconds it took).
  """
  from sexpgpu.ckpt import read_meta, restore_checkpoint
  t = time.perf_counter()
  here = abstract_state.get("carry")
  rows = None
  if here is not None:  # the bf16 carries: one row a device replicated, a node sharded
    there = read_meta(step_dir)
    rows = (there.get("ranks", 1) if there.get("sharding", "replicate") == "replicate"
            else there.get("nodes", 1))
    if rows != _rows(here):  # written under another :sharding: read as it was saved
      saved = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype), here)
      abstract_state = dict(abstract_state, carry=saved)
      if placed is not None:
        placed = dict(placed, carry=saved)
  state, meta_ = restore_checkpoint(step_dir, abstract_state, placed)
  carry = state.pop("carry", None)
  if carry is not None and rows != _rows(here):
    carry = _carry_rows(carry, _rows(here), place)
  if carry is not None and sharded:  # placed as the run keeps it, or read straight into it
    state = (put or place.replicate)(dict(state, carry=carry))
  else:
    state = (put or place.replicate)(state)
  if carry is not None and not sharded:  # each node takes its own devices' carries
    share = place.local_share(place.ranks)
    state["carry"] = jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(
            place._shard, np.asarray(x)[share.start:share.stop], x.shape), carry)
  return state, meta_, time.perf_counter() - t


def _rows(carry) -> int:
  return int(jax.tree_util.tree_leaves(carry)[0].shape[0])


def _carry_rows(carry, rows: int, place):
  """Carries saved under another :sharding, as this run keeps them: a node's devices all
  carry that node's one rounding error, so a device's row is its node's and back."""
  gpus = place.ranks // place.nodes

  def one(x):
    x = place.host(x) if isinstance(x, jax.Array) else np.asarray(x)
    return x[::gpus] if rows == place.nodes else np.repeat(x, gpus, axis=0)
  return jax.tree_util.tree_map(one, carry)


def host_state(state: dict, place) -> dict:
  """The state on the host; per-device carries gathered from every node (a collective)."""
  from jax.experimental import multihost_utils
  out = {}
  for k, v in state.items():
    if k == "carry":
      out[k] = jax.tree_util.tree_map(
          lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), v)
    else:
      out[k] = jax.tree_util.tree_map(place.host, v)
  return out


def save_nodes(store, state: dict, meta_: dict, step: int, place, rdv) -> None:
  """Every node checks that the ranks agree (E-DP-004); node 0 writes; all wait for it."""
  from sexpgpu.devices.nodes import agree_at_checkpoint, params_hash
  host = host_state(state, place)
  agree_at_checkpoint(step, params_hash({"params": host["params"], "opt": host["opt"]}), rdv)
  if place.node == 0:
    store.save(step, host, meta_, wait=True)
  rdv.barrier(f"saved-{step}")


def save_sharded_nodes(store, state: dict, meta_: dict, step: int, rdv) -> None:
  """Every node writes the shards it holds (fsdp, hsdp over nodes); none gathers the state.

  The ranks cannot disagree on a copy that none of them holds twice, so E-DP-004's check
  of the replicated path has nothing to compare here (hsdp's copies over nodes are
  written once, by one holder each).
  """
  store.save_sharded(step, state, meta_, rdv)
  rdv.barrier(f"saved-{step}")

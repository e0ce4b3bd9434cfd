"""The run's side of checkpoints: what a checkpoint's meta holds, saving, restoring, checking."""

from __future__ import annotations

import platform
import time
from typing import Any

import jax
import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.lang.select import NOT_IN_FINGERPRINT, format_value


def jsonable(v: Any) -> Any:
  """A knob value as JSON: numbers and booleans as they are, anything else as text."""
  if isinstance(v, (bool, int, float)) or v is None:
    return v
  return str(v)


def versions() -> dict:
  """The versions a checkpoint and the config event record."""
  import jaxlib
  from importlib.metadata import version
  return {"sexpgpu": version("sexpgpu"), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": platform.python_version()}


def meta(c, progress, step: int, place, node_gradients: str, stacking: int,
         loader_states: dict, sharding: str = "replicate") -> dict:
  """The meta written beside the state: everything a resume needs besides the arrays.

  Args:
    c: the Compiled experiment.
    progress: the run's Progress (stage, counters, last pass, train loss).
    step: the step the state is at.
    place: the run's Placement.
    node_gradients, stacking: how the run sums its gradients (a resume keeps both).
    loader_states: loader name → state as of `step` (not as of batches drawn ahead).
    sharding: the run's :sharding (a resume may choose another on the same devices).
  """
  out = {"fingerprint": c.fingerprint, "graph_fingerprint": c.graph_fingerprint,
         "slug": c.slug, "step": step, "stage": progress.stage, "ranks": place.ranks,
         "nodes": place.nodes, "node_gradients": node_gradients, "stacking": stacking,
         "sharding": sharding,
         "mesh": dict(place.mesh.shape) if place.mesh is not None else {},
         "counters": dict(progress.counters), "last_pass": dict(progress.last_pass),
         "train_loss": progress.train_loss, "loaders": dict(loader_states),
         "knobs": {k: jsonable(v.value) for k, v in c.selection.knobs.items()},
         "versions": versions(), "sources": dict(c.program.sources)}
  if place.first.platform != "cpu":
    from sexpgpu.run.devices import autotune_results
    tuned = autotune_results()  # under SEXPGPU_DETERMINISTIC: a resume picks the same kernels
    if tuned is not None:
      out["xla_autotune"] = tuned
  return out


def check_same(c, place, meta_: dict, step_dir: str) -> None:
  """Refuses a checkpoint of another rank count (E-DP-002) or experiment (E-CKPT-002)."""
  ranks, nodes = place.ranks, place.nodes
  if meta_.get("ranks", 1) != ranks or meta_.get("nodes", 1) != nodes:
    raise SxError("E-DP-002", f"the checkpoint was written by {meta_.get('ranks')} ranks on "
                  f"{meta_.get('nodes')} nodes; this run has {ranks} rank"
                  f"{'s' if ranks != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''}",
                  where=step_dir, fix="resume with the checkpoint's nodes and devices")
  if meta_.get("fingerprint") == c.fingerprint:
    return
  theirs = meta_.get("knobs", {})
  ours = {k: v.value for k, v in c.selection.knobs.items()}
  diffs = [f"{k} {format_value(theirs.get(k))} → {format_value(ours.get(k))}"
           for k in sorted(set(theirs) | set(ours)) if k not in NOT_IN_FINGERPRINT
           and str(theirs.get(k)) != str(ours.get(k))]
  what = ("knobs differ: " + ", ".join(diffs)) if diffs else "the model's IR differs"
  raise SxError("E-CKPT-002", f"the checkpoint is of another experiment ({what})",
                where=step_dir, fix="resume with the selection that wrote it, or start afresh "
                "without --resume")


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

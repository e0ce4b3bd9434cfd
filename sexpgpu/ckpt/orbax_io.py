"""The orbax calls, in one place: a quiet manager, Composite args, restore."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import warnings
from typing import Any

import jax
import numpy as np


def quiet() -> None:
  """Keeps orbax's and absl's logging (and fsspec's) off standard error."""
  for name in ("absl", "orbax", "s3fs", "fsspec", "botocore", "aiobotocore",
               "urllib3", "gcsfs", "asyncio", "aiohttp"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  try:
    from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
    absl_logging.set_stderrthreshold("fatal")
  except ImportError:  # absl is a dependency of orbax; be safe anyway
    pass


quiet()
import orbax.checkpoint as ocp  # pylint: disable=wrong-import-position


def _alone() -> ocp.options.MultiprocessingOptions:
  """Orbax working for this process alone: with several nodes, node 0 writes by itself
  (from host copies of the state) and every node reads by itself, so no orbax call waits
  on a collective that the other nodes never join."""
  me = jax.process_index()
  if jax.process_count() == 1:
    return ocp.options.MultiprocessingOptions()
  return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                            barrier_sync_key_prefix=f"sexpgpu-node{me}")


def manager(root: str, keep: int | None, asynchronous: bool) -> ocp.CheckpointManager:
  """A CheckpointManager writing `<root>/<step>/{state,meta}` atomically.

  Args:
    root: a local folder (created if missing).
    keep: how many newest steps to keep, or None for all.
    asynchronous: whether `save` returns before the files are written.

  Returns:
    The manager.
  """
  alone = jax.process_count() > 1
  if alone:  # orbax creates the folder only when every process takes part
    import os
    os.makedirs(root, exist_ok=True)
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=not alone, cleanup_tmp_directories=True,
      enable_async_checkpointing=asynchronous, multiprocessing_options=_alone())
  return ocp.CheckpointManager(root, options=options, item_names=("state", "meta"))


# where orbax's JsonSave puts the meta item inside a step folder
META_FILE = "meta/metadata"
# orbax writes step N into `N.orbax-checkpoint-tmp` (and, before 0.11, with a timestamp
# after it) and renames it to N when complete: a save that fails leaves it behind
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def save_args(state: Any, meta: dict) -> ocp.args.Composite:
  """The Composite args for one checkpoint: the state pytree and the meta JSON."""
  return ocp.args.Composite(state=ocp.args.StandardSave(state),
                            meta=ocp.args.JsonSave(meta))


def abstract(tree: Any) -> Any:
  """`tree` with every array leaf as a ShapeDtypeStruct (kept if already one)."""
  def leaf(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    arr = x if hasattr(x, "dtype") and hasattr(x, "shape") else np.asarray(x)
    return jax.ShapeDtypeStruct(tuple(arr.shape), arr.dtype)
  return jax.tree.map(leaf, tree)


def _checkpointer() -> ocp.Checkpointer:
  opts = _alone()
  handler = ocp.CompositeCheckpointHandler(
      composite_options=ocp.CompositeOptions(multiprocessing_options=opts))
  return ocp.Checkpointer(handler, multiprocessing_options=opts)


def restore(step_dir: str, abstract_state: Any) -> tuple[Any, dict]:
  """Restores state and meta from a complete local step folder."""
  with _checkpointer() as ckptr:
    out = ckptr.restore(step_dir, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract(abstract_state)),
        meta=ocp.args.JsonRestore()))
  return out.state, out.meta


def drop_leftovers() -> None:
  """Collects what a failed orbax call left behind (unawaited coroutines,
  closed event loops) now and silently, so no warning reaches standard error."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda _: None
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      gc.collect()
  finally:
    sys.unraisablehook = hook


def cancel_stuck_threads(grace_s: float = 2.0) -> int:
  """Lets orbax's waiting threads of a save that failed go, so the process can exit.

  When a save fails part-way (its folder removed, the disk full), orbax 0.12.8 leaves
  non-daemon threads waiting up to its coordination timeout (10 minutes) for signals
  that the failed phase will never send, and the interpreter waits for them at exit.
  Each such thread is marked cancelled and its awaited signals are set, so it returns
  at once without running its part. Only for a run that is ending with an error.

  orbax offers no public way to let those threads go: the attributes read and set here are
  its `_SignalingThread`'s (orbax/checkpoint/_src/futures/future.py), found by duck
  typing, so another orbax is left to its own timeout; tests/test_imports.py's
  test_private_handles_are_where_they_were fails when an orbax release moves them.

  Returns:
    How many threads were let go.
  """
  stuck = [t for t in threading.enumerate() if t.is_alive() and not t.daemon
           and hasattr(t, "_receive_signals") and hasattr(t, "_cancelled")]
  for t in stuck:
    try:
      t._cancelled = True  # pylint: disable=protected-access
      mod = sys.modules[type(t).__module__]
      client = mod.signaling_client.get_signaling_client()
      for signal in t._receive_signals:  # pylint: disable=protected-access
        key = mod.AwaitableSignalsContract.get_unique_awaitable_singal_key(
            signal, t._operation_id)  # pylint: disable=protected-access
        client.key_value_set(key, "cancelled", allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      continue  # another orbax: nothing to do but wait for its own timeout
  for t in stuck:
    t.join(grace_s)
  return len(stuck)

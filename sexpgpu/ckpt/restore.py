"""Reading checkpoints back: --resume resolution, the meta alone, the full state."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from sexpgpu.ckpt import manifest, orbax_io, remote, shards
from sexpgpu.ckpt.store import latest_step_dir
from sexpgpu.ckpt.where import LOCAL_DONE, is_remote, join, reason, remote_fs, scrub
from sexpgpu.errors import SxError
from sexpgpu.retrying import bounded

_FIX = ("pass --resume a complete step folder (such as <location>/<slug>/<step>) "
        "or --resume latest with --checkpoint-dir")
_FIX_DAMAGED = ("resume an earlier step folder, or --resume latest, which skips checkpoints "
                "that do not verify")
# step folder → a local folder whose files verified against its manifest (a remote step's
# downloaded copy, or the local step itself), so a resume reads and checks each once
_VERIFIED: dict[str, str] = {}
_COPIES: list[str] = []


@atexit.register
def _drop_copies() -> None:
  for tmp in _COPIES:
    shutil.rmtree(tmp, ignore_errors=True)


def resolve_resume(value: str, checkpoint_location: str | None,
                   slug: str) -> tuple[str | None, str]:
  """Turns a --resume value into a step folder and the config line's text.

  Args:
    value: "latest", a step folder, or a run folder (local or remote). A run
      folder (one holding complete step folders) resolves to its newest step.
    checkpoint_location: the --checkpoint-dir location, or None.
    slug: the run's slug.

  Returns:
    (step folder or None, text): for "latest", the text is "latest=<dir>" or
    "latest=none" (None: start from the beginning); otherwise both are the
    resolved step folder.

  Raises:
    SxError: E-CKPT-001 for "latest" without a location; E-CKPT-003 for a
      folder that is neither a complete step folder nor a run folder with one.
  """
  if value == "latest":
    if not checkpoint_location:
      raise SxError("E-CKPT-001", "--resume latest needs a checkpoint location, and none "
                    "was given", where="--resume latest",
                    fix="pass --checkpoint-dir DIR (or set SEXPGPU_CHECKPOINT_DIR), "
                    "or --resume a step folder")
    run_dir = join(_normal(checkpoint_location), slug)
    found = newest_verified(run_dir, "--resume latest")
    return found, f"latest={scrub(found) if found else 'none'}"
  step_dir = _step_dir_of(_normal(value))
  return step_dir, scrub(step_dir)


def _normal(location: str) -> str:
  if is_remote(location):
    return location.rstrip("/")
  return os.path.abspath(os.path.expanduser(location))


def _step_dir_of(path: str) -> str:
  """`path` if it is a complete step folder, else a run folder's newest step."""
  if _is_complete(path, "--resume"):
    return path
  newest = newest_verified(path, "--resume")
  if newest is None:
    raise _unreadable(path, "no complete checkpoint there", where="--resume")
  return newest


def _step_folders(run_dir: str, where: str) -> list[tuple[int, str | None]]:
  """Every step folder under run_dir, ascending: (step, None) for one whose save finished
  (orbax's commit_success.txt locally, the COMMIT marker remotely), else (step, why not).

  A save in progress locally writes into orbax's tmp folder, never into `<step>` itself, so
  an integer-named folder without commit_success.txt is one that lost it.
  """
  if is_remote(run_dir):
    latest_step_dir(run_dir, where)  # E-CKPT-003 when the location cannot be listed
    done, partial = bounded(f"the listing of {scrub(run_dir)}", remote.steps,
                            remote_fs(run_dir, where), run_dir)
    return sorted([(s, None) for s in done] + [
        (s, "it has no COMMIT marker (its upload never finished)") for s in partial])
  try:
    names = os.listdir(run_dir)
  except OSError:
    return []
  found = []
  for name in names:
    folder = os.path.join(run_dir, name)
    if name.isdigit() and os.path.isdir(folder):
      done = os.path.isfile(os.path.join(folder, LOCAL_DONE))
      found.append((int(name), None if done else
                    f"it has no {LOCAL_DONE} (orbax never finished writing it)"))
  return sorted(found)


def newest_verified(run_dir: str, where: str) -> str | None:
  """The newest step folder under run_dir whose files match its manifest, or None when there
  is no step folder at all. Each newer one that cannot be verified (its save unfinished, a
  file missing, changed or cut short) is skipped with a line naming it and why.

  Raises:
    SxError: E-CKPT-003 when step folders exist but none verifies (each named with what
      it lacks), or the location cannot be listed.
  """
  skipped = []
  for step, unfinished in reversed(_step_folders(run_dir, where)):
    step_dir = join(run_dir, step)
    why = unfinished or problem(step_dir)
    if why is None:
      return step_dir
    skipped.append(f"{scrub(step_dir)}: {why}")
    print(f"checkpoint: skipped {scrub(step_dir)}: {why}", file=sys.stderr, flush=True)
  if skipped:
    raise SxError("E-CKPT-003", f"no checkpoint under {scrub(run_dir)} verifies, so there "
                  "is nothing to resume: " + "; ".join(skipped), where=where,
                  fix="restore the files named from a copy, or move those step folders away "
                  "and start afresh without --resume")
  return None


def problem(step_dir: str) -> str | None:
  """What keeps a complete step folder from verifying against its manifest, or None.

  A remote step is downloaded (once) to be checked; its verified copy is what a restore
  reads afterwards.
  """
  step_dir = _normal(step_dir)
  if step_dir in _VERIFIED:
    return None
  if not is_remote(step_dir):  # checked each time: a local folder may change under us
    return manifest.problem(step_dir)
  tmp = tempfile.mkdtemp(prefix="sexpgpu-ckpt-restore-")
  _COPIES.append(tmp)
  try:
    remote.download(remote_fs(step_dir, step_dir), step_dir, tmp)
  except Exception as e:  # pylint: disable=broad-except
    shutil.rmtree(tmp, ignore_errors=True)
    return f"it cannot be downloaded ({reason(e)})"
  why = manifest.problem(tmp)
  if why is None:
    _VERIFIED[step_dir] = tmp
  else:
    shutil.rmtree(tmp, ignore_errors=True)
  return why


def _is_complete(step_dir: str, where: str) -> bool:
  if not is_remote(step_dir):
    return os.path.isfile(os.path.join(step_dir, LOCAL_DONE))
  fs = remote_fs(step_dir, where)
  try:
    return bounded(f"the look-up of {scrub(step_dir)}", remote.is_committed, fs, step_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise _unreadable(step_dir, reason(e), where=where) from e


def _unreadable(step_dir: str, why: str, where: str | None = None) -> SxError:
  return SxError("E-CKPT-003", f"cannot read checkpoint {scrub(step_dir)}: {why}",
                 where=where or scrub(step_dir), fix=_FIX)


def read_meta(step_dir: str) -> dict:
  """The meta dict of a complete step folder, without its arrays.

  Raises:
    SxError: E-CKPT-003 when missing, incomplete or unreadable.
  """
  return read_verified(step_dir, meta_of, only="meta")


def meta_of(local_dir: str) -> dict:
  """The meta JSON of a local step folder (orbax's JsonSave wrote it as plain JSON)."""
  with open(os.path.join(local_dir, *orbax_io.META_FILE.split("/"))) as f:
    return json.load(f)


def peek_meta(step_dir: str) -> dict | None:
  """The meta dict read as plain JSON, without orbax (nothing starts a JAX backend), or
  None when it cannot be read: for settings that must be known before the device opens.
  The restore proper reports a bad checkpoint later, with its error code."""
  path = join(step_dir, orbax_io.META_FILE)
  try:
    if is_remote(step_dir):
      return bounded(f"the read of {scrub(path)}", lambda: json.loads(
          remote_fs(step_dir, "--resume").cat_file(path.split("://", 1)[1])))
    with open(path) as f:
      return json.load(f)
  except Exception:  # pylint: disable=broad-except
    return None


def restore_checkpoint(step_dir: str, abstract_state: Any,
                       placed: Any = None) -> tuple[Any, dict]:
  """Restores (state, meta) from a complete step folder.

  Args:
    step_dir: a local or remote step folder.
    abstract_state: a pytree of jax.ShapeDtypeStruct (or arrays) shaped like
      the saved state; the result has its pytree types (optax NamedTuples).
      Leaves come back as jax arrays where jax arrays were saved, numpy
      arrays otherwise (Python scalars come back as 0-d numpy arrays).
    placed: abstract_state with the shardings the run keeps it in: a state
      that every process wrote for its own shards (ckpt/shards.py) is read
      straight into them, each process reading only its devices' slices.

  Returns:
    (state, meta).

  Raises:
    SxError: E-CKPT-003 when missing, incomplete, unreadable, or when its
      structure, shapes or dtypes differ from abstract_state.
  """
  def reader(local_dir: str):
    if shards.is_sharded(local_dir):
      try:
        state = shards.read(local_dir, placed if placed is not None else abstract_state)
      except shards.LayoutError as e:
        raise _unreadable(step_dir, str(e)) from e
      return state, meta_of(local_dir)
    return orbax_io.restore(local_dir, abstract_state)
  state, meta = read_verified(step_dir, reader)
  _check_like(step_dir, state, abstract_state)
  return state, meta


def read_verified(step_dir: str, reader: Callable[[str], Any], only: str | None = None) -> Any:
  """reader(a local verified copy of step_dir): a complete step folder that verifies, read
  by the caller's reader; `only` is None for the last read of it (its copy is removed)."""
  step_dir = _normal(step_dir)
  if not _is_complete(step_dir, scrub(step_dir)):
    why = "no such folder" if _missing(step_dir) else "not a complete checkpoint"
    raise _unreadable(step_dir, why)
  why = problem(step_dir)
  if why is not None:
    raise SxError("E-CKPT-003", f"checkpoint {scrub(step_dir)} does not verify: {why}",
                  where=scrub(step_dir), fix=_FIX_DAMAGED)
  local = _VERIFIED.get(step_dir, step_dir)
  try:
    return _guarded(step_dir, reader, local)
  finally:
    if only is None and local != step_dir:  # the restore proper: the copy is done with
      _VERIFIED.pop(step_dir, None)
      shutil.rmtree(local, ignore_errors=True)


def _missing(step_dir: str) -> bool:
  if is_remote(step_dir):
    return False
  return not os.path.exists(step_dir)


def _guarded(step_dir: str, reader: Callable[[str], Any], local_dir: str) -> Any:
  try:
    return reader(local_dir)
  except SxError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    orbax_io.drop_leftovers()
    raise _unreadable(step_dir, _plain(e)) from e


def _plain(e: BaseException) -> str:
  """An orbax or tensorstore error without the library's internals (specs, bound methods)."""
  text = reason(e)
  for cut in (" <", " {", "[source locations", " with spec", " tensorstore_spec"):
    at = text.find(cut)
    if at > 0:
      text = text[:at].rstrip(" :,(")
  return text


def _check_like(step_dir: str, state: Any, abstract_state: Any) -> None:
  want = orbax_io.abstract(abstract_state)
  got_leaves, got_tree = jax.tree.flatten(state)
  want_leaves, want_tree = jax.tree.flatten(want)
  if got_tree != want_tree:
    raise _unreadable(step_dir, "its state's structure differs from this run's")
  for path_leaf, got, exp in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                                 got_leaves, want_leaves):
    if tuple(np.shape(got)) != tuple(exp.shape) or np.dtype(got.dtype) != np.dtype(exp.dtype):
      name = jax.tree_util.keystr(path_leaf[0])
      raise _unreadable(step_dir, f"{name} is {got.dtype}{list(np.shape(got))} there, "
                        f"{exp.dtype}{list(exp.shape)} here")



"""CheckpointStore: a run's checkpoints, saved asynchronously, complete or not at all."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from sexpgpu.ckpt import lock, manifest, orbax_io, remote, shards
from sexpgpu.ckpt.where import (LOCAL_DONE, is_remote, join, reason, remote_fs, scrub,
                                strip_scheme)
from sexpgpu.errors import SxError
from sexpgpu.lang.select import is_slug_component
from sexpgpu.retrying import bounded, call as retried, deadline_s


# A remote run stages each save in a local folder named for its process, then uploads it.
STAGING_PREFIX = "sexpgpu-ckpt-staging-"
# A sharded save's folder while its processes write into it (renamed to the step when done)
PARTIAL = ".partial"


def _remove_stale_staging() -> None:
  """Removes the staging folders of processes that no longer run (killed mid-upload).

  What a killed process staged was never a checkpoint: only the uploaded step is.
  """
  tmp = tempfile.gettempdir()
  try:
    names = os.listdir(tmp)
  except OSError:
    return
  for name in names:
    if not name.startswith(STAGING_PREFIX):
      continue
    pid = name[len(STAGING_PREFIX):].split("-", 1)[0]
    if not pid.isdigit():  # not named for a process
      continue
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    except OSError:  # alive, as another user
      pass


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """One completed save: its step, step folder, total bytes and wall seconds."""

  step: int
  location: str
  bytes: int
  seconds: float


local_steps = manifest.local_steps


def latest_step_dir(run_dir: str, where: str) -> str | None:
  """The newest complete step folder under a run folder (local or remote), or None."""
  done = step_numbers(run_dir, where)
  return join(run_dir, done[-1]) if done else None


def step_numbers(run_dir: str, where: str) -> list[int]:
  """The complete steps under a run folder (local or remote), ascending."""
  if is_remote(run_dir):
    fs = remote_fs(run_dir, where)
    try:
      done, _ = bounded(f"the listing of {scrub(run_dir)}", remote.steps, fs, run_dir)
    except Exception as e:  # pylint: disable=broad-except
      raise SxError("E-CKPT-003", f"cannot list checkpoints at {scrub(run_dir)}: {reason(e)}",
                    where=where, fix="check the location and its credentials (AWS_* variables, "
                    "GOOGLE_APPLICATION_CREDENTIALS)") from e
    return done
  return local_steps(run_dir)


def _dir_bytes(path: str) -> int:
  return sum(f[2] for f in remote.local_files(path))


def _is_full(error: BaseException) -> bool:
  """Whether a write failed because the device or the quota is full."""
  text = f"{type(error).__name__} {error}"
  if any(w in text for w in ("No space left", "ENOSPC", "Disk quota", "EDQUOT",
                             "QuotaExceeded")):
    return True
  # tensorstore's word for a failed file write; host memory running out says "memory"
  return "RESOURCE_EXHAUSTED" in text and "memory" not in text.lower()


class NotShared(OSError):
  """A local checkpoint folder that the nodes do not share (each sees its own disk)."""


def _retain_local(run_dir: str, keep: int) -> None:
  """Deletes all but the `keep` newest complete steps of a local run folder, and the
  partial folders of sharded saves older than the newest (a killed run's).

  Only what a checkpoint store wrote is ever deleted: a step folder whose manifest names
  its own step, and a `<step>.partial` folder holding nothing but a save's own files. A
  folder the user keeps beside them, even one named like a step, stays.
  """
  done = [s for s in local_steps(run_dir)
          if manifest.step_of(os.path.join(run_dir, str(s))) == s]
  for step in done[:-keep] if keep > 0 else []:
    shutil.rmtree(os.path.join(run_dir, str(step)), ignore_errors=True)
  try:
    names = os.listdir(run_dir)
  except OSError:
    return
  for name in names:
    head = name[:-len(PARTIAL)] if name.endswith(PARTIAL) else ""
    if (head.isdigit() and done and int(head) < done[-1]
        and _only_save_files(os.path.join(run_dir, name))):
      shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


_only_save_files = manifest.only_save_files
is_own_step = manifest.is_own_step


class CheckpointStore:
  """The checkpoints of one run under `<location>/<slug>/<step>/`.

  Locally, orbax writes each step into a tmp folder and renames it into place,
  so only complete steps exist. On `s3://` and `gs://`, orbax writes into a
  local staging folder, which is uploaded with fsspec; the step's COMMIT
  marker goes last, and only steps with a marker count. Saving with
  `wait=False` returns once the arrays are copied off the device; the rest
  (writing, uploading, pruning to `keep`) runs in a background thread.
  """

  def __init__(self, location: str, slug: str, keep: int,
               where: str = "--checkpoint-dir"):
    """Opens (without writing) the checkpoint store of run `slug`.

    Args:
      location: a local folder, `s3://bucket/prefix` or `gs://bucket/prefix`.
      slug: the run's slug; its checkpoints live in `<location>/<slug>/`.
      keep: how many newest complete checkpoints to keep (at least 1).
      where: the flag or variable that gave the location, named in errors.
    """
    if not is_slug_component(slug):  # the run folder must lie inside the location
      raise SxError("E-CKPT-004", f"the run slug {ascii(slug)} is not one folder name, so "
                    "its checkpoints would not lie inside their location", where=where,
                    fix="set SEXPGPU_RUN_SLUG to one folder name of letters, digits, `.`, `_`, "
                    "`=` and `-`, or unset it")
    self.location = location
    self.slug = slug
    self.keep = max(1, int(keep))
    self.where = where
    self.remote = is_remote(location)
    if self.remote:
      self.run_dir = join(location, slug)
    else:
      self.run_dir = join(os.path.abspath(os.path.expanduser(location)), slug)
    self._fs = remote_fs(location, where) if self.remote else None
    self._staging: str | None = None
    self._manager = None
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._failed_step: int | None = None
    self._last: CheckpointInfo | None = None
    self._saved: set[int] = set()
    self._failed: set[int] = set()  # steps whose save failed: their leftovers go at close
    self._lock: str | None = None

  # -- checks -------------------------------------------------------------

  def check_writable(self) -> None:
    """Writes and deletes a probe file under the run folder.

    Raises:
      SxError: E-CKPT-004 when the location cannot be written.
    """
    probe = f".sexpgpu-probe-{uuid.uuid4().hex}"
    try:
      if self.remote:
        key = join(strip_scheme(self.run_dir), probe)
        self._fs.pipe_file(key, b"probe")
        self._fs.rm_file(key)
      else:
        os.makedirs(self.run_dir, exist_ok=True)
        path = os.path.join(self.run_dir, probe)
        with open(path, "wb") as f:
          f.write(b"probe")
        os.remove(path)
    except Exception as e:  # pylint: disable=broad-except
      raise SxError("E-CKPT-004", f"cannot write to the checkpoint location "
                    f"{scrub(self.run_dir)}: {reason(e)}", where=self.where,
                    fix=self._write_fix()) from e
    self.hold_lock()

  def hold_lock(self) -> None:
    """Takes the lock of the run folder for this store (once), so no other run writes there.

    Raises:
      SxError: E-CKPT-005 while another live run holds it.
    """
    if self._lock is None:
      self._lock = lock.acquire(self.run_dir, self._fs, self.where)

  def _write_fix(self) -> str:
    if self.remote:
      return ("check that the bucket exists, the credentials (AWS_* variables or "
              "files) allow writing, and AWS_ENDPOINT_URL for S3-compatible stores")
    return "pass a --checkpoint-dir that is a writable folder"

  # -- saving -------------------------------------------------------------

  def save(self, step: int, state: Any, meta: dict, *, wait: bool) -> None:
    """Saves `state` and `meta` as step `step`.

    A save first waits for the previous one. With `wait=False` it returns once
    the arrays are copied off the device; `wait()` blocks until it is durable.
    Saving a step this store already saved is a no-op; a step folder left by
    an earlier run at the same step is replaced.

    Args:
      step: the training step (the folder name).
      state: a pytree of arrays and scalars.
      meta: a JSON-able dict.
      wait: whether to block until the checkpoint is complete.

    Raises:
      SxError: E-CKPT-004 when this save (or the previous one) cannot be written.
    """
    self.wait()
    step = int(step)
    if step in self._saved:
      return
    started = time.monotonic()
    manager = self._get_manager()
    try:
      if step in manager.all_steps():
        self._replace_own(step, manager)
      manager.save(step, args=orbax_io.save_args(state, meta), force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._failed.add(step)
      raise self._save_error(step, e) from e
    self._saved.add(step)
    self._thread = threading.Thread(target=self._finish, args=(step, started),
                                    name=f"sexpgpu-ckpt-{step}", daemon=True)
    self._thread.start()
    if wait:
      self.wait()

  def save_sharded(self, step: int, state: Any, meta: dict, nodes) -> None:
    """Saves a state sharded over several processes: each writes only the shards it holds.

    Every process calls this at the same step. Into a folder every node sees, the
    processes write into `<step>.partial`, which node 0 renames into place once all
    have written. On `s3://` and `gs://`, each process stages its shards locally and
    uploads them; node 0 writes the manifest and then the COMMIT marker only after
    every process has reported its files through the coordinator's key-value store,
    so a process lost mid-upload leaves a step without COMMIT, which never counts.
    Blocks until the step is complete on every node.

    Args:
      step: the training step.
      state: a pytree of jax.Arrays sharded over the processes' devices.
      meta: the JSON-able meta (node 0 writes it).
      nodes: the run's Rendezvous (`exchange`, `cfg.rank`).

    Raises:
      SxError: E-CKPT-004 on every node when any node's part cannot be written.
    """
    self.wait()
    step, started, node = int(step), time.monotonic(), nodes.cfg.rank
    if self.remote:
      folder = os.path.join(self._staging_dir(), str(step))
    else:
      folder = os.path.join(self.run_dir, str(step)) + PARTIAL

    def prepare():
      if self.remote:
        shutil.rmtree(folder, ignore_errors=True)
      if node == 0:
        if self.remote:
          remote.remove(self._fs, self.step_dir(step))
        else:
          shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(os.path.join(folder, "state"))
        os.makedirs(os.path.join(folder, os.path.dirname(orbax_io.META_FILE)))
        with open(os.path.join(folder, orbax_io.META_FILE), "w") as f:
          json.dump(meta, f)
        shards.create(folder, state)

    def write():
      mine = shards.write_mine(folder, state)
      if not self.remote:  # what node 0 must see of this node's part in the shared folder
        return {rel: os.path.getsize(os.path.join(folder, rel)) for rel in mine}
      files = manifest.entries(folder)
      remote.put(self._fs, folder, self.step_dir(step))
      return files

    self._failed.add(step)  # until it is committed: a failure leaves its .partial to remove
    self._together(nodes, step, "prepared", prepare)
    parts = self._together(nodes, step, "written", write)

    def commit():
      if node != 0:
        return {}
      final = os.path.join(self.run_dir, str(step))
      if self.remote:
        files = {rel: e for part in parts.values() for rel, e in part.items()}
        key = strip_scheme(self.step_dir(step))
        retried(f"manifest of {self.step_dir(step)}", self._fs.pipe_file,
                f"{key}/{manifest.MANIFEST}",
                json.dumps(manifest.compose(step, files), indent=1).encode(), describe=reason)
        size = sum(e["bytes"] for e in files.values())
        remote.commit(self._fs, self.step_dir(step), step, size,
                      list(files) + [manifest.MANIFEST])
        remote.retain(self._fs, self.run_dir, self.keep)
      else:
        for n, part in sorted(parts.items()):
          unseen = [rel for rel, size in sorted(part.items())
                    if not os.path.isfile(os.path.join(folder, rel))
                    or os.path.getsize(os.path.join(folder, rel)) != size]
          if unseen:
            raise NotShared(f"node {n} wrote {len(unseen)} of its {len(part)} shard files "
                            f"where node 0 does not see them (such as {unseen[0]}): "
                            f"{scrub(self.run_dir)} is not one folder that every node sees")
        with open(os.path.join(folder, LOCAL_DONE), "w") as f:
          f.write("sexpgpu: every process wrote its shards")
        if os.path.isdir(final) and not is_own_step(final):
          raise OSError(f"{scrub(final)} holds files no save wrote: move it away")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(folder, final)
        manifest.write(final, step)  # the step counts from here on
        size = _dir_bytes(final)
        _retain_local(self.run_dir, self.keep)
      self._last = CheckpointInfo(step, self.step_dir(step), size, time.monotonic() - started)
      return {}

    self._together(nodes, step, "committed", commit)
    self._failed.discard(step)
    if self.remote:
      shutil.rmtree(folder, ignore_errors=True)

  def _together(self, nodes, step: int, phase: str, work) -> dict[int, Any]:
    """Runs one phase of a sharded save on every node; any node's failure fails all.

    Returns:
      On node 0, every node's result of `work`; on the others, their own.
    """
    try:
      value = {"result": work(), "error": None}
    except Exception as e:  # pylint: disable=broad-except
      err = self._save_error(step, e)
      value = {"result": None, "error": {"code": err.code, "message": err.message,
                                         "where": err.where, "fix": err.fix}}

    def judge(mine, values):
      for n, v in sorted(values.items()):
        if v["error"] is not None:
          return dict(v["error"], message=f"node {n}: {v['error']['message']}")
      return None

    # the others may still be writing (and uploading, with its retries) their parts
    extra = deadline_s() if self.remote else 0.0
    values = nodes.exchange(f"ckpt-{step}-{phase}", value, judge, extra_s=extra)
    return {n: v["result"] for n, v in values.items()}

  def _staging_dir(self) -> str:
    if self._staging is None:
      _remove_stale_staging()
      self._staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-")
    return self._staging

  def _get_manager(self):
    if self._manager is None:
      if self.remote:
        root, keep = os.path.join(self._staging_dir(), self.slug), None
      else:
        self.check_writable()  # a clean E-CKPT-004 before orbax tries
        # orbax would prune any integer-named folder it finds; _retain_local prunes only
        # the step folders a save wrote
        root, keep = self.run_dir, None
      try:
        self._manager = orbax_io.manager(root, keep, asynchronous=True)
      except Exception as e:  # pylint: disable=broad-except
        orbax_io.drop_leftovers()
        raise SxError("E-CKPT-004", f"cannot write to the checkpoint location "
                      f"{scrub(self.run_dir)}: {reason(e)}", where=self.where,
                      fix=self._write_fix()) from e
    return self._manager

  def _replace_own(self, step: int, manager) -> None:
    """Deletes an earlier run's folder of `step` before this save writes it again.

    Raises:
      SxError: E-CKPT-004 when that folder is not a save's (the user's files are in it).
    """
    folder = self.step_dir(step)
    if not self.remote and os.path.isdir(folder) and not is_own_step(folder):
      raise SxError("E-CKPT-004", f"cannot write checkpoint {scrub(folder)}: a folder of "
                    "that name is there and holds files no save wrote", where=self.where,
                    fix=f"move {scrub(folder)} away, or pass another --checkpoint-dir")
    manager.delete(step)

  def _finish(self, step: int, started: float) -> None:
    """Background: waits for orbax, uploads when remote, prunes, records info."""
    try:
      self._manager.wait_until_finished()
      if self.remote:
        size = self._upload(step)
      else:
        local = os.path.join(self.run_dir, str(step))
        manifest.write(local, step)  # the step counts from here on
        size = _dir_bytes(local)
        _retain_local(self.run_dir, self.keep)
      self._last = CheckpointInfo(step, self.step_dir(step), size,
                                  time.monotonic() - started)
    except BaseException as e:  # pylint: disable=broad-except
      self._error, self._failed_step = e, step

  def _upload(self, step: int) -> int:
    local = os.path.join(self._staging, self.slug, str(step))
    try:
      manifest.write(local, step)
      size = remote.upload(self._fs, local, self.step_dir(step), step)
      remote.retain(self._fs, self.run_dir, self.keep)
    finally:
      self._manager.delete(step)
    return size

  def wait(self) -> CheckpointInfo | None:
    """Blocks until the in-flight save is durable.

    Returns:
      The CheckpointInfo of the last completed save, or None if none completed.

    Raises:
      SxError: E-CKPT-004 when the in-flight save failed; the previous
        complete checkpoint is untouched.
    """
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      error, step = self._error, self._failed_step
      self._error = self._failed_step = None
      self._saved.discard(step)
      self._failed.add(step)
      raise self._save_error(step, error) from error
    return self._last

  def _save_error(self, step: int, error: BaseException) -> SxError:
    if isinstance(error, NotShared):
      return SxError("E-CKPT-004", f"cannot write checkpoint {scrub(self.step_dir(step))}: "
                     f"{error}", where=self.where,
                     notes=[("previous", self.intact(exclude=step))],
                     fix="pass every node the same --checkpoint-dir on storage they all "
                     "mount (NFS, Lustre, a cloud file system), or an s3:// or gs:// "
                     "location, then resume with --resume latest")
    if _is_full(error):  # the one cause worth naming plainly: no library's wording
      return SxError("E-CKPT-004", f"cannot write checkpoint {scrub(self.step_dir(step))}: "
                     "the device is full (no space left, or the quota is used up)",
                     where=self.where, notes=[("previous", self.intact(exclude=step))],
                     fix=f"free space where {scrub(self.run_dir)} lies (step folders older "
                     "than the intact one named above, other runs' folders), or lower :keep, "
                     "then resume with --resume latest")
    return SxError("E-CKPT-004", f"cannot write checkpoint {scrub(self.step_dir(step))}: "
                   f"{reason(error)}", where=self.where,
                   notes=[("previous", self.intact(exclude=step))], fix=self._write_fix())

  def intact(self, exclude: int | None = None) -> str:
    """The newest checkpoint of this run that still verifies, checked now, as a sentence.

    Args:
      exclude: a step to leave out (the one whose save failed).
    """
    try:
      if self.remote:
        done, _ = remote.steps(self._fs, self.run_dir)
      else:
        done = local_steps(self.run_dir)
    except Exception as e:  # pylint: disable=broad-except
      known = (f"step {self._last.step} ({scrub(self._last.location)}) was the last "
               "checkpoint this run completed" if self._last else "this run completed none")
      return f"{known}; it could not be checked now ({reason(e)})"
    bad = []
    for step in reversed([d for d in done if d != exclude]):
      why = self._problem(step)
      if why is None:
        skipped = f" (newer ones do not verify: {'; '.join(bad)})" if bad else ""
        return (f"the last good checkpoint is step {step} at {scrub(self.step_dir(step))}, "
                f"checked against its manifest; resume it with --resume latest{skipped}")
      bad.append(f"step {step}: {why}")
      if len(bad) >= 3:
        break
    if bad:
      return "no checkpoint of this run verifies: " + "; ".join(bad)
    return f"no complete checkpoint is left under {scrub(self.run_dir)}"

  def _problem(self, step: int) -> str | None:
    if not self.remote:
      return manifest.problem(os.path.join(self.run_dir, str(step)))
    import json  # pylint: disable=import-outside-toplevel
    key = strip_scheme(self.step_dir(step))
    try:  # sizes against the manifest: no download on the way out of a failed run
      want = json.loads(self._fs.cat_file(f"{key}/{manifest.MANIFEST}"))["files"]
      got = {p[len(key) + 1:]: int(i.get("size", -1))
             for p, i in self._fs.find(key, detail=True).items()}
    except Exception as e:  # pylint: disable=broad-except
      return f"its manifest cannot be read ({reason(e)})"
    for rel, entry in sorted(want.items()):
      if got.get(rel) != entry["bytes"]:
        return f"{rel} is missing or has another size"
    return None

  # -- reading ------------------------------------------------------------

  def step_dir(self, step: int) -> str:
    """The folder of step `step`: `<run_dir>/<step>`."""
    return join(self.run_dir, int(step))

  def latest(self) -> str | None:
    """The newest complete step folder under run_dir, or None."""
    return latest_step_dir(self.run_dir, self.where)

  def steps(self) -> list[int]:
    """The complete steps under run_dir now (an earlier run's, before this one saves)."""
    return step_numbers(self.run_dir, self.where)

  def close(self) -> None:
    """Waits for the in-flight save, then releases orbax, the staging folder and the lock.

    Called while an error is being handled (from an `except` block), it waits for a
    save in flight a few seconds at most and leaves orbax's threads behind: the error
    on its way out must not wait on a save that cannot finish.
    """
    failing = sys.exc_info()[0] is not None
    try:
      if failing:
        self._abandon()
      else:
        self.wait()
    finally:
      try:
        if failing:  # orbax's threads of a failed save would keep the process alive
          orbax_io.cancel_stuck_threads()
        elif self._manager is not None:
          self._manager.close()
        self._manager = None
      finally:
        if self._staging and self._thread is None:
          shutil.rmtree(self._staging, ignore_errors=True)
          self._staging = None
        if self._thread is None:  # no save of ours still writes into the run folder
          for step in sorted(self._failed):
            self._drop_partial(step)
          self._failed.clear()
        if self._lock is not None:
          lock.release(self._lock)
          self._lock = None

  def _abandon(self, grace_s: float = 5.0) -> None:
    if self._thread is not None:
      self._thread.join(grace_s)
      if not self._thread.is_alive():
        self._thread = None
    if self._failed_step is not None:
      self._failed.add(self._failed_step)
    self._error = self._failed_step = None

  def _drop_partial(self, step: int) -> None:
    """Removes what a failed save of `step` left in a local run folder (a full disk's);
    a remote step without its COMMIT marker never counts (manifest.drop_partial)."""
    if not self.remote:
      manifest.drop_partial(self.run_dir, step, (orbax_io.TMP_SUFFIX,), (PARTIAL,))

  def __enter__(self) -> "CheckpointStore":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

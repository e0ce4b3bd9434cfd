"""Remote step folders on an fsspec filesystem: upload, commit marker, listing."""

from __future__ import annotations

import json
import os
import posixpath

from sexpgpu.ckpt.manifest import MANIFEST, SAVE_FILES
from sexpgpu.ckpt.where import COMMIT, LOCAL_DONE, join, reason, strip_scheme
from sexpgpu.retrying import call as retried


def local_files(step_dir: str) -> list[tuple[str, str, int]]:
  """(absolute path, path relative to step_dir, size) of every file, sorted."""
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir).replace(os.sep, "/")
      out.append((path, rel, os.path.getsize(path)))
  return sorted(out, key=lambda f: f[1])


def upload(fs, local_step: str, remote_step: str, step: int) -> int:
  """Uploads a complete local step folder (with its manifest), then its COMMIT marker last.

  Any leftover of an earlier, interrupted upload of the same step is removed
  first (marker first), so the marker only ever vouches for this upload. Each
  remote call is retried while it fails for a passing reason (retrying.call).

  Returns:
    The bytes uploaded.
  """
  retried(f"removing a leftover of {remote_step}", remove, fs, remote_step, describe=reason)
  files = put(fs, local_step, remote_step)
  total = sum(f[2] for f in files)
  commit(fs, remote_step, step, total, [f[1] for f in files])
  return total


def put(fs, local_dir: str, remote_step: str) -> list[tuple[str, str, int]]:
  """Uploads every file of a local folder into a remote step folder, with retries.

  orbax's own top-level marker and the manifest go after the data, so no partial copy
  has them. Returns the files as `local_files` lists them.
  """
  key = strip_scheme(remote_step)
  files = local_files(local_dir)
  last = (LOCAL_DONE, MANIFEST)
  data = [f for f in files if f[1] not in last]
  ends = sorted((f for f in files if f[1] in last), key=lambda f: last.index(f[1]))
  for batch in [data] + [[f] for f in ends]:
    if batch:
      retried(f"upload of {remote_step}", fs.put, [f[0] for f in batch],
              [f"{key}/{f[1]}" for f in batch], describe=reason)
  return files


def commit(fs, remote_step: str, step: int, total: int, names: list[str]) -> None:
  """Writes a remote step's COMMIT marker, last of all: from here on the step counts."""
  marker = {"step": step, "bytes": total, "files": sorted(names)}
  retried(f"commit marker of {remote_step}", fs.pipe_file,
          f"{strip_scheme(remote_step)}/{COMMIT}", json.dumps(marker).encode(),
          describe=reason)


def remove(fs, remote_step: str) -> None:
  """Deletes a remote step folder: its marker first, so it stops counting at once."""
  key = strip_scheme(remote_step)
  fs.invalidate_cache(key)
  if fs.exists(f"{key}/{COMMIT}"):
    fs.rm_file(f"{key}/{COMMIT}")
  if fs.find(key):
    fs.rm(key, recursive=True)
  fs.invalidate_cache(key)


def steps(fs, run_dir: str) -> tuple[list[int], list[int]]:
  """(committed steps, uncommitted step folders) under a remote run folder, ascending."""
  key = strip_scheme(run_dir)
  fs.invalidate_cache(key)
  try:
    paths = fs.find(key)
  except FileNotFoundError:
    return [], []
  seen: set[int] = set()
  done: set[int] = set()
  for path in paths:
    rel = posixpath.relpath(path, key)
    head, _, rest = rel.partition("/")
    if head.isdigit() and rest:
      seen.add(int(head))
      if rest == COMMIT:
        done.add(int(head))
  return sorted(done), sorted(seen - done)


def is_committed(fs, remote_step: str) -> bool:
  """Whether a remote step folder has its COMMIT marker."""
  key = strip_scheme(remote_step)
  fs.invalidate_cache(key)
  return fs.exists(f"{key}/{COMMIT}")


def download(fs, remote_step: str, local_dir: str, only: str | None = None) -> None:
  """Copies a remote step folder (or its `only` subfolder) into local_dir, with retries."""
  key = strip_scheme(remote_step)
  base = f"{key}/{only}" if only else key

  def listing():
    fs.invalidate_cache(key)
    return [p for p in fs.find(base) if posixpath.basename(p) != COMMIT]
  files = retried(f"listing of {remote_step}", listing, describe=reason)
  if not files:
    raise FileNotFoundError(remote_step)
  targets = [os.path.join(local_dir, *posixpath.relpath(p, key).split("/")) for p in files]
  for target in targets:
    os.makedirs(os.path.dirname(target), exist_ok=True)
  retried(f"download of {remote_step}", fs.get, files, targets, describe=reason)


def only_save_files(fs, remote_step: str) -> bool:
  """Whether every top-level entry of a remote step folder is one a save writes."""
  key = strip_scheme(remote_step)
  names = {posixpath.relpath(p, key).split("/", 1)[0] for p in fs.find(key)}
  return bool(names) and names <= SAVE_FILES


def retain(fs, run_dir: str, keep: int) -> None:
  """Deletes all but the `keep` newest committed steps, and stale uncommitted ones that
  hold only a save's files (a killed upload's): nothing else under the run folder."""
  done, partial = retried(f"listing of {run_dir}", steps, fs, run_dir, describe=reason)
  newest = done[-1] if done else None
  old = done[:-keep] if keep > 0 else []
  stale = [s for s in partial if newest is not None and s < newest
           and retried(f"listing of {join(run_dir, s)}", only_save_files, fs, join(run_dir, s),
                       describe=reason)]
  for step in old + stale:
    retried(f"removal of {join(run_dir, step)}", remove, fs, join(run_dir, step),
            describe=reason)

"""A step folder's manifest: every file's size and SHA-256, checked before a resume trusts it.

The manifest is written after orbax has finished the step (locally: after its
rename; remotely: uploaded after the data and before the COMMIT marker), so a
step counts only when its manifest is there, and a step whose files were
changed, cut short or lost afterwards is refused by name instead of restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from sexpgpu.ckpt.where import COMMIT, LOCAL_DONE
from sexpgpu.paths import write_atomic

MANIFEST = "MANIFEST.json"
# The top-level names a save writes into a step folder (orbax's, the shards', ours): a
# folder holding anything else is not a save's, and no pruning or replacing deletes it.
SAVE_FILES = frozenset({"state", "meta", LOCAL_DONE, MANIFEST, "_CHECKPOINT_METADATA", COMMIT})
FORMAT = 1
# files never listed: the manifest itself and the remote commit marker written after it
UNLISTED = (MANIFEST, COMMIT)


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)
  return h.hexdigest()


def _files(step_dir: str) -> list[tuple[str, str]]:
  """(absolute path, path relative to step_dir with `/`) of each listed file, sorted."""
  out = []
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir).replace(os.sep, "/")
      if rel not in UNLISTED and not name.startswith(f".{MANIFEST}.tmp"):
        out.append((path, rel))
  return sorted(out, key=lambda f: f[1])


def _digest(body: dict) -> str:
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def build(step_dir: str, step: int) -> dict:
  """The manifest of a complete local step folder.

  Returns:
    {"format", "step", "files": {relative path: {"bytes", "sha256"}}, "digest"}, the
    digest being the SHA-256 of the rest, so a changed manifest is told from a changed file.
  """
  return compose(step, entries(step_dir))


def entries(folder: str) -> dict:
  """{relative path: {"bytes", "sha256"}} of every listed file under a local folder."""
  return {rel: {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
          for path, rel in _files(folder)}


def compose(step: int, files: dict) -> dict:
  """The manifest of a step whose files' entries are known (several processes' parts)."""
  body = {"format": FORMAT, "step": int(step), "files": dict(sorted(files.items()))}
  return dict(body, digest=_digest(body))


def write(step_dir: str, step: int) -> dict:
  """Builds the manifest of a local step folder and writes it there (atomically, synced)."""
  manifest = build(step_dir, step)
  write_atomic(os.path.join(step_dir, MANIFEST), json.dumps(manifest, indent=1), sync=True)
  return manifest


def step_of(step_dir: str) -> int | None:
  """The step a local step folder's manifest names, or None when it has none that parses."""
  try:
    with open(os.path.join(step_dir, MANIFEST), "rb") as f:
      step = json.loads(f.read().decode("utf-8"))["step"]
  except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
    return None
  return step if isinstance(step, int) and not isinstance(step, bool) else None


def problem(step_dir: str) -> str | None:
  """What is wrong with a local step folder against its manifest, or None when it verifies.

  Returns:
    A sentence that names the file at fault (the manifest or a listed file), or None.
  """
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.isfile(path):
    return f"it has no {MANIFEST} (its save never finished, or an older sexpgpu wrote it)"
  try:
    with open(path, "rb") as f:
      manifest = json.loads(f.read().decode("utf-8"))
    body = {k: manifest[k] for k in ("format", "step", "files")}
    digest = manifest["digest"]
    files = dict(body["files"])
  except (ValueError, KeyError, TypeError, UnicodeDecodeError):
    return f"{MANIFEST} is damaged (it does not parse)"
  if _digest(body) != digest:
    return f"{MANIFEST} does not match its own checksum (it was changed after it was written)"
  for rel, want in sorted(files.items()):
    local = os.path.join(step_dir, *rel.split("/"))
    if not os.path.isfile(local):
      return f"{rel} is missing"
    size = os.path.getsize(local)
    if size != want["bytes"]:
      return f"{rel} has {size} bytes, its manifest says {want['bytes']}"
    if _sha256(local) != want["sha256"]:
      return f"{rel} does not match its checksum (it was changed after it was written)"
  return None


def only_save_files(folder: str) -> bool:
  """Whether every entry of a local folder is one a save writes (so deleting it loses
  nothing of the user's)."""
  try:
    return all(name in SAVE_FILES for name in os.listdir(folder))
  except OSError:
    return False


def is_own_step(step_dir: str) -> bool:
  """Whether a local step folder is one a save wrote: orbax's commit_success.txt is there
  and nothing but a save's own files, so replacing it loses nothing of the user's."""
  return os.path.isfile(os.path.join(step_dir, LOCAL_DONE)) and only_save_files(step_dir)


def drop_partial(run_dir: str, step: int, tmp_suffixes: tuple[str, ...],
                 partial_suffixes: tuple[str, ...]) -> list[str]:
  """Removes what a failed save of `step` left in a local run folder: the writer's tmp
  folders of the step (`<step><tmp suffix>...`, a name only a save writes), a folder
  `<step><partial suffix>` or `<step>` that no manifest made count and that holds nothing
  but a save's files. A complete step, another step's folder and a folder holding anything
  a save does not write are never touched.

  Returns:
    The names removed.
  """
  try:
    names = os.listdir(run_dir)
  except OSError:
    return []
  removed = []
  for name in sorted(names):
    path = os.path.join(run_dir, name)
    if any(name.startswith(f"{step}{t}") for t in tmp_suffixes):
      ours = os.path.isdir(path)
    elif name in (str(step),) + tuple(f"{step}{p}" for p in partial_suffixes):
      ours = not os.path.isfile(os.path.join(path, MANIFEST)) and only_save_files(path)
    else:
      continue
    if ours:
      shutil.rmtree(path, ignore_errors=True)
      removed.append(name)
  return removed


def local_steps(run_dir: str) -> list[int]:
  """The complete step folders of a local run folder, ascending.

  A step counts only when its integer-named folder holds orbax's
  commit_success.txt, which orbax writes before renaming its tmp folder into
  place, and the manifest written after that rename, so a save killed at any
  point never shows up here.
  """
  try:
    names = os.listdir(run_dir)
  except OSError:
    return []
  return sorted(int(n) for n in names if n.isdigit()
                and os.path.isfile(os.path.join(run_dir, n, LOCAL_DONE))
                and os.path.isfile(os.path.join(run_dir, n, MANIFEST)))

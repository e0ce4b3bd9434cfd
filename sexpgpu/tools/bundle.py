"""`sexpgpu bundle`: one zip archive (`.sxb`) holding an experiment, its requires and a manifest.

Members keep their layout relative to the common folder of every bundled file, so the `.sx`
file's relative requires and loader paths still resolve after extraction. `std/` files come
with sexpgpu and are not bundled; the manifest records their hashes. `manifest.json` holds:

  format, version        "sexpgpu-bundle", 1
  experiment             the member that is the experiment file
  variant, sets          the selection ([[knob, text], ...], as `--set` gave them)
  slug, fingerprint      as the selection compiles here
  versions               sexpgpu, jax, jaxlib, python
  files                  {member: {sha256, bytes, kind: source | data}}
  std                    {std/NAME.sx: sha256}
  data_not_bundled       local loader files left out (no --with-data, or absolute paths)
  remote_data            s3:// and gs:// loader files, read from the store at run time

Opening one (`open_bundle`) reads nothing it has not bounded first: `bundle_manifest` checks
the archive's members, validates the manifest field by field, and extracts each member only
up to the byte count its manifest gives, into a folder removed on any failure.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import zipfile
from typing import Iterator

from sexpgpu import record
from sexpgpu.errors import SxError
from sexpgpu.run.output import err
from sexpgpu.paths import replacing, without_credentials
from sexpgpu.tools import bundle_manifest as bm
from sexpgpu.tools.bundle_manifest import FORMAT, MANIFEST


def sha256_file(path: str) -> str:
  """The hex sha256 of a file's bytes."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _loader_files(loaders) -> list[tuple[str, str, str]]:
  """(loader name, path as written, base dir) of every file loader, mix components included."""
  out = []
  for decl in loaders:
    args = decl.args
    if "path" in args:
      out.append((decl.name, str(args["path"]), decl.base_dir))
    for _, sub in args.get("components", ()):
      out.extend(_loader_files([sub]))
  return out


def _data_files(path: str) -> list[str]:
  """A loader's local data as files: the file itself, or every file under a folder (a text
  loader's token cache: its manifest, tokenizer and shards), sorted."""
  if not os.path.isdir(path):
    return [path]
  found = []
  for root, dirs, names in os.walk(path):
    dirs.sort()
    found.extend(os.path.join(root, n) for n in sorted(names)
                 if os.path.isfile(os.path.join(root, n)))
  return found


def make_bundle(path: str, out: str, variant: str | None = None,
                sets: list[tuple[str, str]] = (), with_data: bool = False) -> dict:
  """Compiles the selection (to check it and take its fingerprint) and writes the archive.

  Args:
    path: the `.sx` experiment.
    out: the archive to write (`run.sxb`).
    variant, sets: the selection, recorded in the manifest; `sets` as (knob, text).
    with_data: also bundle the loaders' local files.

  Returns:
    The manifest (with a `notes` list of what was left out, not written to the archive).

  Raises:
    SxError: any compile error of the selection.
  """
  from sexpgpu.data.remote import is_remote
  from sexpgpu.lang.program import STD_DIR
  from sexpgpu.run.compile import compile_file
  refuse_bundle(path, "bundle", f"a bundle is made once, from its experiment; copy {path} "
                "as it is to run it elsewhere")
  c = compile_file(path, variant, list(sets))
  std_dir = os.path.realpath(STD_DIR)
  sources, std = [], {}
  for display, abspath in c.program.files.items():
    if os.path.realpath(abspath).startswith(std_dir + os.sep):
      std[display] = sha256_file(abspath)
    else:
      sources.append(os.path.abspath(abspath))
  data, remote, left_out, notes = [], [], [], []
  for name, p, base in _loader_files(c.exp.loaders.values()):
    if is_remote(p):
      remote.append(p)
      notes.append(f"loader {name}: {p} stays remote; the run fetches it")
    elif os.path.isabs(p):
      left_out.append(p)
      notes.append(f"loader {name}: {p} is an absolute path, not bundled; the run reads it there")
    elif with_data:
      data.extend(_data_files(os.path.abspath(os.path.join(base, p))))
    else:
      left_out.append(p)
      notes.append(f"loader {name}: {p} not bundled (add --with-data)")
  exp_abs = os.path.abspath(path)
  files = list(dict.fromkeys([exp_abs] + sources + data))
  root = os.path.commonpath([os.path.dirname(f) for f in files])
  members = {f: os.path.relpath(f, root).replace(os.sep, "/") for f in files}
  manifest = {
      "format": FORMAT, "version": 1, "experiment": members[exp_abs],
      "variant": variant, "sets": [[k, without_credentials(v)] for k, v in sets], "slug": c.slug,
      "fingerprint": c.fingerprint, "versions": record.versions(), "created_at": time.time(),
      "files": {members[f]: {"sha256": sha256_file(f), "bytes": os.path.getsize(f),
                             "kind": "data" if f in data and f not in sources else "source"}
                for f in files},
      "std": std, "data_not_bundled": sorted(set(left_out)), "remote_data": sorted(set(remote)),
  }
  text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
  _within_bounds(out, manifest, text)
  with replacing(out) as tmp, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
    z.writestr(MANIFEST, text)
    for f in files:
      z.write(f, members[f])
  return {**manifest, "notes": notes}


def _within_bounds(out: str, manifest: dict, text: str) -> None:
  """The manifest about to be written, as `open_bundle` will check it: a bundle this makes
  is one that opens (at most MAX_MEMBERS files and MAX_TOTAL_BYTES, a manifest within its
  bounds)."""
  files = manifest["files"]
  total = sum(f["bytes"] for f in files.values())
  if len(files) > bm.MAX_MEMBERS or total > bm.MAX_TOTAL_BYTES:
    raise SxError("E-BUNDLE-004", f"{out}: {len(files)} files of {total} bytes; a bundle holds "
                  f"at most {bm.MAX_MEMBERS} files and {bm.MAX_TOTAL_BYTES} bytes", where=out,
                  fix="make the bundle without --with-data and put the loaders' data beside "
                  "the archive where it runs")
  bm.parse_manifest(text.encode("utf-8"), out)


# --- opening ----------------------------------------------------------------------------------

def _bundle(path: str) -> tuple[bm.Archive, bm.Manifest]:
  """The bundle opened, its members checked for safety, its manifest read and validated and
  its members checked against it; nothing written, and no member read but the manifest."""
  archive = bm.Archive(bm.open_regular(path), path)
  try:
    manifest = archive.read_manifest()
    archive.check_against(manifest)
  except BaseException:
    archive.close()
    raise
  return archive, manifest


def _cache_full(folder: str, e: OSError) -> SxError:
  why = e.strerror or str(e)
  full = e.errno in (errno.ENOSPC, errno.EDQUOT)
  return SxError("E-BUNDLE-005", f"the bundle cannot be extracted into {folder}: {why}",
                 where=folder, fix=("free space in that folder's file system, or point "
                                    "SEXPGPU_CACHE_DIR at a disk with room" if full else
                                    "make SEXPGPU_CACHE_DIR a folder this user can write"))


def _copy_member(archive: bm.Archive, member: bm.Member, target: str, cache: str) -> None:
  """Writes one member to `target`, never past its manifest size + 1 byte, checking its
  sha256 as it goes."""
  h, written = hashlib.sha256(), 0
  try:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    dst = open(target, "xb")  # pylint: disable=consider-using-with
  except OSError as e:
    raise _cache_full(cache, e) from None
  with dst:
    try:
      src = archive.open_member(member.name)
    except (OSError, *bm.DAMAGED) as e:
      raise bm.damaged(archive.path, f"{member.name[:200]}: {type(e).__name__}: {e}") from None
    with src:  # a read's error is the archive's; a write's, the cache folder's
      while written <= member.size:
        try:
          block = src.read(min(1 << 20, member.size + 1 - written))
        except (OSError, *bm.DAMAGED) as e:
          raise bm.damaged(archive.path, f"{member.name[:200]}: {e}") from None
        if not block:
          break
        written += len(block)
        if written > member.size:
          raise SxError("E-BUNDLE-004", f"{archive.path}: member {member.name[:200]} holds more "
                        f"than the {member.size} bytes its manifest lists; extraction stopped "
                        "there", where=archive.path, fix="the archive's member was replaced "
                        "after sexpgpu bundle made it (a zip bomb?); do not run it")
        h.update(block)
        try:
          dst.write(block)
        except OSError as e:
          raise _cache_full(cache, e) from None
    try:
      dst.flush()
    except OSError as e:
      raise _cache_full(cache, e) from None
  if written != member.size or h.hexdigest() != member.sha256:
    got = "missing" if written == 0 and member.size else h.hexdigest()[:12] + "…"
    raise SxError("E-BUNDLE-002", f"{archive.path}: {member.name[:200]} does not match its "
                  f"manifest hash (sha256 {member.sha256[:12]}…, found {got}, "
                  f"{written} of {member.size} bytes)", where=archive.path,
                  fix="the archive was changed or damaged after sexpgpu bundle made it; "
                  "make it again from the experiment")


def extract(archive: bm.Archive, manifest: bm.Manifest, dest: str) -> None:
  """Extracts every member into the new folder `dest`, checked as it is written.

  Nothing is left behind on failure (or on a signal): `dest` is removed.

  Raises:
    SxError: E-BUNDLE-005 naming the folder when the disk lacks room for the manifest's
      bytes or a write fails; E-BUNDLE-004 for a member past its size; E-BUNDLE-002 for a
      damaged member or one whose sha256 differs.
  """
  cache = os.path.dirname(dest)
  try:
    os.makedirs(cache, exist_ok=True)
    free = shutil.disk_usage(cache).free
  except OSError as e:
    raise _cache_full(cache, e) from None
  need = manifest.total_bytes()
  if need > free:
    raise SxError("E-BUNDLE-005", f"the bundle needs {need} bytes in {cache}; "
                  f"{free} are free", where=cache,
                  fix=f"free {need - free} bytes there, or point SEXPGPU_CACHE_DIR at a disk "
                  "with room")
  try:
    shutil.rmtree(dest, ignore_errors=True)
    try:
      os.makedirs(dest)
    except OSError as e:
      raise _cache_full(cache, e) from None
    for name in sorted(manifest.files):
      _copy_member(archive, manifest.files[name], os.path.join(dest, *name.split("/")), cache)
  except BaseException:
    shutil.rmtree(dest, ignore_errors=True)
    raise


def _extracted_intact(manifest: bm.Manifest, dest: str) -> bool:
  """Whether an earlier extraction in `dest` still holds every member as listed."""
  for name, member in manifest.files.items():
    target = os.path.join(dest, *name.split("/"))
    try:
      if os.path.islink(target) or os.path.getsize(target) != member.size:
        return False
      if sha256_file(target) != member.sha256:
        return False
    except OSError:
      return False
  return True


def open_bundle(path: str) -> tuple[str, str | None, list[tuple[str, str]]]:
  """Extracts and verifies a bundle; returns what `sexpgpu run` needs to run it.

  The archive is extracted once under `<SEXPGPU_CACHE_DIR>/bundles/<sha256 of the archive>/`
  (reused, and re-verified, on later opens). Before a byte is written the archive must be a
  regular file of at most MAX_MEMBERS safe members, each listed in a manifest that
  `bundle_manifest.validate` accepts, at the size the manifest gives; each member is then
  written only up to that size and checked against its sha256.

  Args:
    path: the `.sxb` file.

  Returns:
    (path of the extracted experiment file, variant or None, [(knob, text), ...] sets).

  Raises:
    SxError: E-BUNDLE-001 for a member (or a manifest path) that is absolute, has `..`, or
      is a link or device; E-BUNDLE-002 for an archive that is no bundle or is damaged, or a
      member missing, unlisted or whose sha256 differs; E-BUNDLE-003 for a manifest field
      of the wrong type or value; E-BUNDLE-004 past a bound; E-BUNDLE-005 when the cache
      folder has no room or cannot be written.
  """
  from sexpgpu.run.compile import cache_dir
  archive, manifest = _bundle(path)
  try:
    dest = os.path.join(cache_dir(), "bundles", archive.digest()[:32])
    if os.path.isdir(dest) and not _extracted_intact(manifest, dest):
      shutil.rmtree(dest, ignore_errors=True)  # changed since it was extracted and verified
    if not os.path.isdir(dest):
      _sweep_abandoned(dest)
      tmp = f"{dest}.{os.getpid()}.tmp"
      extract(archive, manifest, tmp)
      try:
        os.replace(tmp, dest)
      except OSError:  # another process extracted it first
        shutil.rmtree(tmp, ignore_errors=True)
  finally:
    archive.close()
  experiment = os.path.join(dest, *manifest.experiment.split("/"))
  _link_data_beside(path, os.path.dirname(experiment), manifest)
  for line in std_changes(manifest):
    err(f"bundle: {line}")
  return experiment, manifest.variant, list(manifest.sets)


def _sweep_abandoned(dest: str) -> None:
  """Removes `<dest>.<pid>.tmp` folders whose process is gone (an extraction killed with
  SIGKILL or a power cut, which no `finally` cleans); a living process's is left alone."""
  folder, name = os.path.split(dest)
  try:
    entries = os.listdir(folder)
  except OSError:
    return
  for entry in entries:
    pid = entry[len(name) + 1:-len(".tmp")]
    if not (entry.startswith(name + ".") and entry.endswith(".tmp") and pid.isdigit()):
      continue
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
    except (OSError, OverflowError):
      pass  # another user's process, or no such pid to ask about: left as it is


def std_changes(manifest: bm.Manifest) -> list[str]:
  """Each standard-library file the bundle was made with that this installation holds
  differently, or not at all (the run compiles this installation's: its graph, and so its
  fingerprint, may differ from the manifest's)."""
  from sexpgpu.lang.program import STD_DIR
  made_with = (manifest.raw.get("versions") or {}).get("sexpgpu", "another version")
  out = []
  for display, digest in sorted((manifest.raw.get("std") or {}).items()):
    name = display[len("std/"):] if display.startswith("std/") else ""
    if not name.endswith(".sx") or os.sep in name or "/" in name or name.startswith("."):
      continue  # no file of the standard library's: nothing here to compare it with
    here = os.path.join(STD_DIR, name)
    try:
      same = sha256_file(here) == digest
    except OSError:
      out.append(f"{display} of sexpgpu {made_with} is not in this installation")
      continue
    if not same:
      out.append(f"{display} differs from the one the bundle was made with (sexpgpu "
                 f"{made_with}); this run compiles this installation's, so its results may "
                 "differ from the bundle's")
  return out


def bundle_selection(given: str, variant: str | None, sets: list[tuple[str, str]]
                     ) -> tuple[str, str | None, list[tuple[str, str]]]:
  """What a command given a bundle compiles: its extracted experiment and its selection.

  Args:
    given: the `.sxb` file.
    variant: the command's --variant (None when not given): it must be the bundle's own.
    sets: the command's --set pairs; they come after (so win over) the bundle's.

  Returns:
    (experiment path, variant, sets).

  Raises:
    SxError: as `open_bundle`; E-VARIANT-001 for a --variant other than the bundle's.
  """
  path, bundled_variant, bundled_sets = open_bundle(given)
  if variant is not None and variant != bundled_variant:
    made = f"--variant {bundled_variant}" if bundled_variant else "no --variant"
    raise SxError("E-VARIANT-001", f"the bundle was made with {made}; "
                  f"--variant {variant} cannot replace it", where="--variant",
                  fix="drop --variant; a bundle runs its own selection")
  return path, bundled_variant, bundled_sets + list(sets)


@contextlib.contextmanager
def bundle_hints(given: str) -> Iterator[None]:
  """Around compiling what a command was given: when it is a bundle made without
  --with-data, an E-LOAD-001 for a file it left out says where to put that file."""
  try:
    yield
  except SxError as e:
    hint = missing_data_hint(given) if e.code == "E-LOAD-001" and given.endswith(
        ".sxb") else None
    if hint:
      e.fix = hint
      e.args = (e.render(),)
    raise


def refuse_bundle(given: str, command: str, instead: str) -> None:
  """Refuses a bundle given to a command that takes an experiment file.

  Raises:
    SxError: E-FORM-001 when `given` names a `.sxb` file, with `instead` as the fix.
  """
  if given.endswith(".sxb"):
    raise SxError("E-FORM-001", f"sexpgpu {command} takes an experiment file (.sx); "
                  f"`{given}` is a bundle", where=given, fix=instead)


def _link_data_beside(archive: str, exp_dir: str, manifest: bm.Manifest) -> None:
  """Links each loader file left out of the bundle to a copy found beside the `.sxb`.

  A bundle made without --with-data names its loaders' files relative to the experiment;
  on another machine the user puts them beside the archive (at the same relative path, or
  just the file), and the extracted experiment finds them there.
  """
  here = os.path.dirname(os.path.abspath(archive))
  for rel in manifest.data_not_bundled:
    if os.path.isabs(rel) or bm.unsafe_name(rel):
      continue
    target = os.path.join(exp_dir, *rel.split("/"))
    if os.path.isfile(target) and not os.path.islink(target):
      continue
    found = next((c for c in (os.path.join(here, *rel.split("/")),
                              os.path.join(here, os.path.basename(rel))) if os.path.isfile(c)),
                 None)
    if found is None:
      continue
    try:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if os.path.islink(target):
        os.remove(target)
      os.symlink(found, target)
    except OSError:
      continue  # the loader's own E-LOAD-001 says what is missing


def missing_data_hint(archive: str) -> str | None:
  """The fix for an E-LOAD-001 from a bundle made without --with-data, or None."""
  try:
    left = [p for p in manifest_of(archive).data_not_bundled if not os.path.isabs(p)]
  except SxError:
    return None
  if not left:
    return None
  here = os.path.dirname(os.path.abspath(archive)) or "."
  return (f"this bundle was made without --with-data: put {', '.join(left)} beside "
          f"{os.path.basename(archive)} (in {here}), or make the bundle again with --with-data")


def manifest_of(path: str) -> bm.Manifest:
  """The checked manifest of a bundle, without extracting it.

  Raises:
    SxError: as `open_bundle`, for everything found before extraction.
  """
  archive = bm.Archive(bm.open_regular(path), path)
  try:
    return archive.read_manifest()
  finally:
    archive.close()


def read_manifest(path: str) -> dict:
  """The manifest of a bundle as its JSON object, checked, without extracting it."""
  return manifest_of(path).raw

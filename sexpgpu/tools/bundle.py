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
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tarfile
import time
import zipfile

from sexpgpu.errors import SxError
from sexpgpu.paths import replacing

MANIFEST = "manifest.json"
FORMAT = "sexpgpu-bundle"


def sha256_file(path: str) -> str:
  """The hex sha256 of a file's bytes."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _versions() -> dict:
  from importlib.metadata import version
  import jax
  import jaxlib
  return {"sexpgpu": version("sexpgpu"), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": platform.python_version()}


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
      "variant": variant, "sets": [[k, v] for k, v in sets], "slug": c.slug,
      "fingerprint": c.fingerprint, "versions": _versions(), "created_at": time.time(),
      "files": {members[f]: {"sha256": sha256_file(f), "bytes": os.path.getsize(f),
                             "kind": "data" if f in data and f not in sources else "source"}
                for f in files},
      "std": std, "data_not_bundled": sorted(set(left_out)), "remote_data": sorted(set(remote)),
  }
  with replacing(out) as tmp, zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
    z.writestr(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for f in files:
      z.write(f, members[f])
  return {**manifest, "notes": notes}


# --- opening ----------------------------------------------------------------------------------

def _bad_member(name: str) -> bool:
  n = name.replace("\\", "/")
  return (n.startswith("/") or (len(n) > 1 and n[1] == ":") or ".." in n.split("/")
          or n in ("", "."))


def _members(archive: str) -> tuple[str, list[tuple[str, bool]]]:
  """('zip' | 'tar', [(member name, is a plain file or folder)])."""
  if zipfile.is_zipfile(archive):
    with zipfile.ZipFile(archive) as z:
      return "zip", [(i.filename, True) for i in z.infolist()]
  try:
    with tarfile.open(archive) as t:
      return "tar", [(m.name, m.isfile() or m.isdir()) for m in t.getmembers()]
  except (tarfile.TarError, OSError):
    raise SxError("E-BUNDLE-002", f"{archive} is not a sexpgpu bundle (neither zip nor tar)",
                  where=archive, fix="make it with sexpgpu bundle FILE -o run.sxb") from None


def _extract(archive: str, kind: str, dest: str) -> None:
  if kind == "zip":
    with zipfile.ZipFile(archive) as z:
      for info in z.infolist():
        if info.is_dir():
          continue
        target = os.path.join(dest, *info.filename.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(info) as src, open(target, "wb") as dst:
          shutil.copyfileobj(src, dst)
  else:
    with tarfile.open(archive) as t:
      for m in t.getmembers():
        if m.isfile():
          target = os.path.join(dest, *m.name.split("/"))
          os.makedirs(os.path.dirname(target), exist_ok=True)
          with t.extractfile(m) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)


def _verify(archive: str, dest: str, names: set[str]) -> dict:
  """Checks the extracted files against the manifest; returns the manifest."""
  try:
    with open(os.path.join(dest, MANIFEST), encoding="utf-8") as f:
      manifest = json.load(f)
    files = manifest["files"]
    manifest["experiment"]
  except (OSError, ValueError, KeyError, TypeError):
    raise SxError("E-BUNDLE-002", f"{archive} has no readable manifest.json",
                  where=archive) from None
  listed = set(files) | {MANIFEST}
  extra = sorted(n for n in names - listed if not n.endswith("/"))
  if extra:
    raise SxError("E-BUNDLE-002", f"{archive}: member {extra[0]} is not in the manifest",
                  where=archive, fix="the archive was changed after sexpgpu bundle made it; "
                  "make it again")
  for name, info in sorted(files.items()):
    if _bad_member(name):
      raise SxError("E-BUNDLE-001", f"{archive}: manifest names `{name}`, a path outside the "
                    "bundle", where=archive, fix="bundle members are relative paths without ..")
    target = os.path.join(dest, *name.split("/"))
    got = sha256_file(target) if os.path.isfile(target) else "missing"
    if got != info.get("sha256"):
      raise SxError("E-BUNDLE-002", f"{archive}: {name} does not match its manifest hash "
                    f"(sha256 {info.get('sha256', '?')[:12]}…, found "
                    f"{got if got == 'missing' else got[:12] + '…'})", where=archive,
                    fix="the archive was changed or damaged after sexpgpu bundle made it; "
                    "make it again from the experiment")
  return manifest


def open_bundle(path: str) -> tuple[str, str | None, list[tuple[str, str]]]:
  """Extracts and verifies a bundle; returns what `sexpgpu run` needs to run it.

  The archive is extracted once under `<SEXPGPU_CACHE_DIR>/bundles/<sha256 of the archive>/`
  (reused, and re-verified, on later opens).

  Args:
    path: the `.sxb` file.

  Returns:
    (path of the extracted experiment file, variant or None, [(knob, text), ...] sets).

  Raises:
    SxError: E-BUNDLE-001 for a member with an absolute path, `..`, or a link;
      E-BUNDLE-002 for a member whose sha256 differs from the manifest, a missing or
      unlisted member, or an archive that is no bundle.
  """
  from sexpgpu.run.compile import cache_dir
  if not os.path.isfile(path):
    raise SxError("E-REQ-001", f"bundle `{path}` not found", where=path,
                  fix="check the path (relative to the current directory), or make the bundle "
                  "with sexpgpu bundle FILE -o run.sxb")
  kind, members = _members(path)
  for name, plain in members:
    if _bad_member(name) or not plain:
      raise SxError("E-BUNDLE-001", f"{path}: member `{name}` "
                    + ("is a link or device" if plain else "has an absolute path or `..`")
                    + "; it could write outside the extraction folder",
                    where=path, fix="a bundle holds plain files at relative paths; make it "
                    "with sexpgpu bundle")
  names = {n.rstrip("/") if n.endswith("/") else n for n, _ in members}
  digest = sha256_file(path)
  dest = os.path.join(cache_dir(), "bundles", digest[:32])
  if os.path.isdir(dest):
    try:
      manifest = _verify(path, dest, names)
    except SxError:  # the archive verified once; its extracted copy was changed since
      shutil.rmtree(dest, ignore_errors=True)
  if not os.path.isdir(dest):
    tmp = f"{dest}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _extract(path, kind, tmp)
    try:
      manifest = _verify(path, tmp, names)
    except SxError:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    try:
      os.replace(tmp, dest)
    except OSError:  # another process extracted it first
      shutil.rmtree(tmp, ignore_errors=True)
  variant = manifest.get("variant")
  sets = [(str(k), str(v)) for k, v in manifest.get("sets") or []]
  experiment = os.path.join(dest, *manifest["experiment"].split("/"))
  _link_data_beside(path, os.path.dirname(experiment), manifest)
  return experiment, variant, sets


def _link_data_beside(archive: str, exp_dir: str, manifest: dict) -> None:
  """Links each loader file left out of the bundle to a copy found beside the `.sxb`.

  A bundle made without --with-data names its loaders' files relative to the experiment;
  on another machine the user puts them beside the archive (at the same relative path, or
  just the file), and the extracted experiment finds them there.
  """
  here = os.path.dirname(os.path.abspath(archive))
  for rel in manifest.get("data_not_bundled") or []:
    if os.path.isabs(rel) or _bad_member(rel):
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
    left = [p for p in read_manifest(archive).get("data_not_bundled") or []
            if not os.path.isabs(p)]
  except (OSError, ValueError, KeyError, zipfile.BadZipFile):
    return None
  if not left:
    return None
  here = os.path.dirname(os.path.abspath(archive)) or "."
  return (f"this bundle was made without --with-data: put {', '.join(left)} beside "
          f"{os.path.basename(archive)} (in {here}), or make the bundle again with --with-data")


def read_manifest(path: str) -> dict:
  """The manifest of a bundle, without extracting or verifying it."""
  with zipfile.ZipFile(path) as z:
    return json.loads(z.read(MANIFEST))

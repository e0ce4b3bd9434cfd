"""A bundle's manifest checked field by field, and its archive listed and extracted in bounds.

Every reader of a bundle goes through here: `open_regular` takes only a regular file (a
FIFO, a folder or a device is refused before it is read); `Archive` reads the zip's end
record first, lists at most MAX_MEMBERS members and refuses links, devices, absolute paths,
`..` and codecs without a bound; `Archive.read_manifest` reads `manifest.json` up to
MAX_MANIFEST_BYTES and MAX_DEPTH levels of nesting; `validate` (the one check of a manifest)
turns the parsed JSON into a checked `Manifest` or names the field that is wrong; members are
then read only up to the byte count the manifest gives (`sexpgpu.tools.bundle.extract`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import math
import os
import re
import stat
import struct
import zipfile
import zlib

from sexpgpu.errors import SxError

MANIFEST = "manifest.json"
FORMAT = "sexpgpu-bundle"
VERSION = 1
# Bounds on what a bundle may hold; `sexpgpu bundle` refuses to make one past them.
MAX_MANIFEST_BYTES = 1 << 20
MAX_DEPTH = 16  # a real manifest nests 3 deep: {"files": {member: {"sha256": ...}}}
MAX_MEMBERS = 10_000
MAX_TOTAL_BYTES = 64 << 30
MAX_DIRECTORY = 64 << 20  # bytes of the zip's central directory (10,000 long names fit)
MAX_PATH = 1024  # characters of a member's name; each part at most 255 bytes
MAX_TEXT = 4096  # characters of a variant, a --set pair's side, a left-out path
MAX_SETS = 1000
_CHUNK = 1 << 20
_NOT_RELATIVE = "is not a plain relative path (absolute, `..`, or an empty or `.` part)"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
# What reading a damaged archive raises, besides OSError (zipfile and its codecs: an unknown
# compression method is NotImplementedError, an encrypted member RuntimeError).
DAMAGED = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError,
           NotImplementedError, RuntimeError, struct.error, zlib.error,
           KeyError, IndexError, OverflowError)


@dataclasses.dataclass(frozen=True)
class Member:
  """One file of a bundle as its manifest lists it."""

  name: str
  sha256: str
  size: int
  kind: str  # "source" or "data"


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A bundle's `manifest.json`, every field checked (see `validate`).

  Attributes:
    experiment: the member that is the experiment file (one of `files`, a source).
    variant, sets: the selection the bundle was made with.
    files: member name → Member.
    data_not_bundled, remote_data: loader files left out, and those read from a store.
    raw: the JSON object itself (its other fields: slug, fingerprint, versions, std, ...).
  """

  experiment: str
  variant: str | None
  sets: tuple[tuple[str, str], ...]
  files: dict
  data_not_bundled: tuple[str, ...]
  remote_data: tuple[str, ...]
  raw: dict

  def total_bytes(self) -> int:
    """The bytes of every member together."""
    return sum(m.size for m in self.files.values())


# --- the manifest ---------------------------------------------------------------------------

def _what(value) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return f"the boolean {str(value).lower()}"
  if isinstance(value, (int, float)):
    return f"the number {value!r}"[:60]
  if isinstance(value, str):
    return "the string " + (json.dumps(value) if len(value) <= 40 else
                            json.dumps(value[:40]) + f"... ({len(value)} characters)")
  if isinstance(value, list):
    return f"a list of {len(value)}"
  if isinstance(value, dict):
    return f"an object of {len(value)} keys"
  return type(value).__name__


def _field_error(archive: str, field: str, expected: str, value) -> SxError:
  return SxError("E-BUNDLE-003", f"{archive}: manifest.json field `{field}` is {_what(value)}; "
                 f"it must be {expected}", where=f"{archive}: manifest.json `{field}`",
                 fix=f"a bundle's `{field}` is written by `sexpgpu bundle`: make the bundle "
                 "again from the experiment rather than editing its manifest.json")


def unsafe_name(name: str) -> bool:
  """Whether a member name could reach outside the extraction folder: an absolute path, a
  drive, `..`, an empty or `.` part."""
  n = name.replace("\\", "/")
  parts = n.split("/")
  return (n.startswith("/") or (len(n) > 1 and n[1] == ":") or ".." in parts
          or any(p in ("", ".") for p in parts))


def _text(archive: str, field: str, value, limit: int = MAX_TEXT, empty: bool = True) -> str:
  if (not isinstance(value, str) or len(value) > limit or "\0" in value
          or (not empty and not value)):
    raise _field_error(archive, field, f"a{'' if empty else ' non-empty'} string of at most "
                       f"{limit} characters without NUL", value)
  try:
    value.encode("utf-8")
  except UnicodeError:  # a lone surrogate (`"\udcff"` in the JSON)
    raise _field_error(archive, field, "a string of UTF-8 text", value) from None
  return value


def _member_name(archive: str, field: str, name) -> str:
  _text(archive, field, name, MAX_PATH, empty=False)
  if unsafe_name(name):
    raise SxError("E-BUNDLE-001", f"{archive}: manifest.json `{field}` names `{name[:200]}`, a "
                  "path outside the bundle", where=f"{archive}: manifest.json `{field}`",
                  fix="a manifest names its members by relative paths inside the archive, "
                  "without `..`; make the bundle again with sexpgpu bundle")
  if any(len(p.encode("utf-8")) > 255 or any(ord(c) < 32 for c in p) for p in name.split("/")):
    raise _field_error(archive, field, "a path whose parts are at most 255 bytes, without "
                       "control characters", name)
  return name


def _member(archive: str, name, entry) -> Member:
  _member_name(archive, "files (a member's name)", name)
  field = f"files[{json.dumps(name)[:80]}]"
  if not isinstance(entry, dict):
    raise _field_error(archive, field, "an object {sha256, bytes, kind}", entry)
  sha, size, kind = entry.get("sha256"), entry.get("bytes"), entry.get("kind")
  if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
    raise _field_error(archive, field + ".sha256", "64 lowercase hex digits", sha)
  if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_TOTAL_BYTES:
    raise _field_error(archive, field + ".bytes", f"an integer from 0 to {MAX_TOTAL_BYTES}",
                       size)
  if kind not in ("source", "data"):
    raise _field_error(archive, field + ".kind", '"source" or "data"', kind)
  return Member(name, sha, size, kind)


def _files(archive: str, files) -> dict:
  if not isinstance(files, dict) or not files:
    raise _field_error(archive, "files", "a non-empty object {member: {sha256, bytes, kind}}",
                       files)
  if len(files) > MAX_MEMBERS:
    raise SxError("E-BUNDLE-004", f"{archive}: manifest.json lists {len(files)} files; a bundle "
                  f"holds at most {MAX_MEMBERS}", where=f"{archive}: manifest.json `files`",
                  fix=f"bundle fewer files (at most {MAX_MEMBERS}): keep large data folders "
                  "out of the bundle and beside it")
  out = {name: _member(archive, name, entry) for name, entry in files.items()}
  folders = {"/".join(n.split("/")[:i]) for n in out for i in range(1, n.count("/") + 1)}
  clash = sorted((set(out) & folders) | ({MANIFEST} & set(out)))
  if clash:
    raise _field_error(archive, "files", "members that are neither manifest.json nor a folder "
                       f"of another member (`{clash[0][:200]}` is)", clash[0])
  total = sum(m.size for m in out.values())
  if total > MAX_TOTAL_BYTES:
    raise SxError("E-BUNDLE-004", f"{archive}: manifest.json lists {total} bytes; a bundle "
                  f"holds at most {MAX_TOTAL_BYTES}", where=f"{archive}: manifest.json `files`",
                  fix="leave the large data out of the bundle (no --with-data) and put it "
                  "beside the archive")
  return out


def _text_list(archive: str, field: str, value) -> tuple[str, ...]:
  if value is None:
    return ()
  if not isinstance(value, list) or len(value) > MAX_MEMBERS:
    raise _field_error(archive, field, f"a list of at most {MAX_MEMBERS} strings", value)
  return tuple(_text(archive, f"{field}[{i}]", v) for i, v in enumerate(value))


def _sets(archive: str, sets) -> tuple[tuple[str, str], ...]:
  if sets is None:
    return ()
  if not isinstance(sets, list) or len(sets) > MAX_SETS:
    raise _field_error(archive, "sets", f"a list of at most {MAX_SETS} [knob, value] pairs "
                       "of strings", sets)
  out = []
  for i, pair in enumerate(sets):
    if not isinstance(pair, list) or len(pair) != 2:
      raise _field_error(archive, f"sets[{i}]", 'a [knob, value] pair of strings, such as '
                         '["lr", "0.01"]', pair)
    out.append((_text(archive, f"sets[{i}][0]", pair[0], empty=False),
                _text(archive, f"sets[{i}][1]", pair[1])))
  return tuple(out)


def _optional(archive: str, raw: dict) -> None:
  """The fields a run does not use, checked for their types all the same."""
  for field in ("slug", "fingerprint"):
    if raw.get(field) is not None:
      _text(archive, field, raw[field])
  for field in ("versions", "std"):
    value = raw.get(field)
    if value is None:
      continue
    if not isinstance(value, dict) or len(value) > MAX_MEMBERS:
      raise _field_error(archive, field, "an object of strings", value)
    for k, v in value.items():
      _text(archive, f"{field}[{json.dumps(k)[:80]}]", v)
  when = raw.get("created_at")
  if when is not None and (isinstance(when, bool) or not isinstance(when, (int, float))
                           or not math.isfinite(when)):
    raise _field_error(archive, "created_at", "a finite number (seconds since 1970)", when)


def validate(raw, archive: str) -> Manifest:
  """The one check of a bundle's manifest: the parsed JSON to a typed, checked record.

  Args:
    raw: what `json.loads` gave for `manifest.json`.
    archive: the bundle, as named in errors.

  Returns:
    The Manifest.

  Raises:
    SxError: E-BUNDLE-003 naming the field that is missing or of the wrong type or value
      and what it must be; E-BUNDLE-001 for a member path outside the archive;
      E-BUNDLE-004 for more files or bytes than a bundle may hold.
  """
  if not isinstance(raw, dict):
    raise _field_error(archive, "(the whole file)", "a JSON object", raw)
  if raw.get("format") != FORMAT:
    raise _field_error(archive, "format", json.dumps(FORMAT), raw.get("format"))
  version = raw.get("version")
  if isinstance(version, bool) or version != VERSION:
    raise _field_error(archive, "version", f"{VERSION} (the bundle version this sexpgpu reads)",
                       version)
  files = _files(archive, raw.get("files"))
  experiment = _member_name(archive, "experiment", raw.get("experiment"))
  if experiment not in files or files[experiment].kind != "source":
    raise _field_error(archive, "experiment", "the name of a source member listed in `files`",
                       experiment)
  variant = raw.get("variant")
  if variant is not None:
    _text(archive, "variant", variant, 200)
  _optional(archive, raw)
  return Manifest(experiment, variant, _sets(archive, raw.get("sets")), files,
                  _text_list(archive, "data_not_bundled", raw.get("data_not_bundled")),
                  _text_list(archive, "remote_data", raw.get("remote_data")), raw)


def json_depth(text: str) -> int:
  """How deeply JSON `text` nests its lists and objects (strings skipped)."""
  brackets = re.sub(r"[^\[\]{}]", "", _STRING.sub("", text))
  steps = (1 if c in "[{" else -1 for c in brackets)
  return max(itertools.accumulate(steps, initial=0))


def parse_manifest(data: bytes, archive: str) -> Manifest:
  """`manifest.json`'s bytes (at most MAX_MANIFEST_BYTES + 1 of them) to a checked Manifest.

  Raises:
    SxError: E-BUNDLE-004 when too large or too deeply nested; E-BUNDLE-003 when not UTF-8
      JSON, or as `validate`.
  """
  where = f"{archive}: manifest.json"
  if len(data) > MAX_MANIFEST_BYTES:
    raise SxError("E-BUNDLE-004", f"{archive}: manifest.json is larger than "
                  f"{MAX_MANIFEST_BYTES} bytes", where=where,
                  fix="the manifest sexpgpu writes is a few kilobytes; make the bundle again "
                  "with sexpgpu bundle")
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise SxError("E-BUNDLE-003", f"{archive}: manifest.json is not UTF-8 text (byte "
                  f"0x{data[e.start]:02x} at offset {e.start})", where=where,
                  fix="the archive's manifest.json was replaced or damaged; make the bundle "
                  "again with sexpgpu bundle FILE -o run.sxb") from None
  depth = json_depth(text)
  if depth > MAX_DEPTH:
    raise SxError("E-BUNDLE-004", f"{archive}: manifest.json nests {depth} levels; a manifest "
                  f"nests at most {MAX_DEPTH}", where=where,
                  fix="a sexpgpu manifest nests three levels deep; make the bundle again")
  try:
    raw = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise SxError("E-BUNDLE-003", f"{archive}: manifest.json is not JSON ({str(e)[:120]})",
                  where=where, fix="restore the archive's manifest.json as sexpgpu bundle "
                  "wrote it, or make the bundle again") from None
  return validate(raw, archive)


# --- the archive ----------------------------------------------------------------------------

def damaged(archive: str, why: str) -> SxError:
  """E-BUNDLE-002 for an archive that cannot be read as a bundle."""
  return SxError("E-BUNDLE-002", f"{archive} cannot be read as a bundle: {why[:200]}",
                 where=archive, fix="the archive is damaged or cut short (copy it again), or "
                 "is no bundle; make one with sexpgpu bundle FILE -o run.sxb")


def open_regular(path: str) -> io.BufferedReader:
  """Opens a bundle for reading, refusing what is not a regular file before reading a byte
  (a FIFO would block, a device never end).

  Raises:
    SxError: E-REQ-001 when missing or unreadable; E-BUNDLE-002 when no regular file.
  """
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
  except (OSError, ValueError) as e:
    why = getattr(e, "strerror", None) or str(e)
    raise SxError("E-REQ-001", f"bundle `{path}` cannot be opened: {why}", where=path,
                  fix="check the path (relative to the current directory), or make the bundle "
                  "with sexpgpu bundle FILE -o run.sxb") from None
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    os.close(fd)
    what = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")
    raise SxError("E-BUNDLE-002", f"`{path}` is {what}, not a bundle file", where=path,
                  fix="give the .sxb file that sexpgpu bundle wrote (a regular file)")
  os.set_blocking(fd, True)
  return os.fdopen(fd, "rb")


def _end_record(f: io.BufferedReader, path: str) -> tuple[int, int]:
  """(entries, bytes) of the zip's central directory, read from its end record (and the
  zip64 one it points at) before zipfile reads the directory whole.

  Raises:
    SxError: E-BUNDLE-002 when there is no end record (no zip: a tar is named as such);
      E-BUNDLE-004 when the directory is past MAX_MEMBERS entries or MAX_DIRECTORY bytes.
  """
  size = os.fstat(f.fileno()).st_size
  f.seek(max(0, size - (22 + 65535 + 20)))
  tail = f.read()
  at = tail.rfind(b"PK\x05\x06")
  if at < 0 or len(tail) - at < 22:
    f.seek(257)
    raise damaged(path, "a tar archive; a bundle is the zip archive sexpgpu bundle writes"
                  if f.read(5) == b"ustar" else "not a zip archive")
  entries, directory = struct.unpack("<HL", tail[at + 10:at + 16])
  if (entries == 0xFFFF or directory == 0xFFFFFFFF) and at >= 20 and (
      tail[at - 20:at - 16] == b"PK\x06\x07"):
    f.seek(struct.unpack("<Q", tail[at - 12:at - 4])[0])  # the zip64 end record
    record = f.read(56)
    if len(record) == 56 and record[:4] == b"PK\x06\x06":
      entries, directory = struct.unpack("<QQ", record[32:48])
  if entries > MAX_MEMBERS + 1 or directory > MAX_DIRECTORY:
    raise SxError("E-BUNDLE-004", f"{path}: its directory lists {entries} members in "
                  f"{directory} bytes; a bundle holds at most {MAX_MEMBERS} files",
                  where=path, fix=f"a bundle holds at most {MAX_MEMBERS} files; this "
                  "archive was not made by sexpgpu bundle")
  f.seek(0)
  return entries, directory


class Archive:
  """A zip bundle, listed within MAX_MEMBERS and checked for unsafe members (absolute,
  `..`, links, devices, a codec without a bound) before anything is read from it.

  A tar is refused: tarfile reads a pax or long-name header whole into memory, whatever
  size it declares.
  """

  def __init__(self, f: io.BufferedReader, path: str):
    self.path, self.f, self.infos = path, f, {}
    try:
      _end_record(f, path)
      if not zipfile.is_zipfile(f):
        raise damaged(path, "not a zip archive")
      self.zip = zipfile.ZipFile(f)
      infos = self.zip.infolist()
      if len(infos) > MAX_MEMBERS + 1:  # the manifest besides at most MAX_MEMBERS files
        raise SxError("E-BUNDLE-004", f"{path} holds {len(infos)} members", where=path,
                      fix=f"bundle at most {MAX_MEMBERS} files; this archive was not made "
                      "by sexpgpu bundle")
      for info in infos:
        self._check_member(info)
    except SxError:
      self.f.close()
      raise
    except (OSError, *DAMAGED) as e:
      self.f.close()
      raise damaged(path, f"{type(e).__name__}: {e}") from None

  def _refuse(self, name: str, why: str) -> SxError:
    return SxError("E-BUNDLE-001", f"{self.path}: member `{name[:200]}` {why}; it could write "
                   "outside the extraction folder", where=self.path,
                   fix="a bundle holds plain files at relative paths; make it with sexpgpu bundle")

  def _check_member(self, info: zipfile.ZipInfo) -> None:
    name = info.filename
    mode = info.external_attr >> 16
    if unsafe_name(name.rstrip("/") if info.is_dir() else name):
      raise self._refuse(name, _NOT_RELATIVE)
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):  # 0: no Unix type given
      raise self._refuse(name, "is a link or device")
    if not info.is_dir() and info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
      # bzip2 and lzma inflate a read's bytes without a bound on what comes out
      raise SxError("E-BUNDLE-002", f"{self.path}: member `{name[:200]}` is compressed with "
                    f"zip method {info.compress_type}; a bundle's members are stored or "
                    "deflated", where=self.path, fix="make the bundle with sexpgpu bundle, which "
                    "deflates; other zip tools may choose bzip2 or lzma")
    # what a member's bytes take at most once compressed (deflate's stored blocks add 5
    # bytes a 64 KiB): more is data the reader would walk through for nothing
    most = info.file_size + info.file_size // 1000 + 1024
    if not info.is_dir() and info.compress_size > most:
      raise SxError("E-BUNDLE-004", f"{self.path}: member `{name[:200]}` takes "
                    f"{info.compress_size} bytes to hold {info.file_size}", where=self.path,
                    fix="the archive's members were padded after sexpgpu bundle made it; do "
                    "not run it")
    if not info.is_dir():
      self.infos.setdefault(name, []).append(info)

  def open_member(self, name: str):
    """A binary stream of member `name` (the first of that name)."""
    return self.zip.open(self.infos[name][0])

  def read_manifest(self) -> Manifest:
    """`manifest.json` read within MAX_MANIFEST_BYTES and checked (`parse_manifest`)."""
    if MANIFEST not in self.infos:
      raise SxError("E-BUNDLE-002", f"{self.path} has no manifest.json: it is an archive but "
                    "no sexpgpu bundle", where=self.path,
                    fix="make the bundle with sexpgpu bundle FILE -o run.sxb; a bundle's first "
                    "member is its manifest.json")
    try:
      with self.open_member(MANIFEST) as src:
        data = src.read(MAX_MANIFEST_BYTES + 1)
    except (OSError, *DAMAGED) as e:
      raise damaged(self.path, f"manifest.json: {type(e).__name__}: {e}") from None
    return parse_manifest(data, self.path)

  def check_against(self, manifest: Manifest) -> None:
    """Each file member listed once in the manifest, at the size it gives; every listed
    member present.

    Raises:
      SxError: E-BUNDLE-002 for an unlisted, repeated or missing member; E-BUNDLE-004 for
        a member whose declared size differs from the manifest's.
    """
    for name, infos in sorted(self.infos.items()):
      if name != MANIFEST and name not in manifest.files:
        raise SxError("E-BUNDLE-002", f"{self.path}: member {name[:200]} is not in the "
                      "manifest", where=self.path, fix="the archive was changed after sexpgpu "
                      "bundle made it; make it again")
      if len(infos) > 1:
        raise SxError("E-BUNDLE-002", f"{self.path}: member {name[:200]} appears "
                      f"{len(infos)} times", where=self.path,
                      fix="a bundle holds each member once; members were appended to this "
                      "archive after sexpgpu bundle made it")
      member = manifest.files.get(name)
      if member is not None and infos[0].file_size != member.size:
        raise SxError("E-BUNDLE-004", f"{self.path}: member {name[:200]} declares "
                      f"{infos[0].file_size} bytes; the manifest lists {member.size}",
                      where=self.path,
                      fix="the archive's members were replaced after sexpgpu bundle made it; "
                      "make it again from the experiment")
    missing = sorted(set(manifest.files) - set(self.infos))
    if missing:
      raise SxError("E-BUNDLE-002", f"{self.path}: {missing[0][:200]} does not match its "
                    "manifest hash (sha256 "
                    f"{manifest.files[missing[0]].sha256[:12]}…, found missing)",
                    where=self.path, fix="the manifest lists a member the archive lacks; copy "
                    "the whole archive again, or make it again with sexpgpu bundle")

  def digest(self) -> str:
    """The sha256 of the archive's bytes, once `check_against` has passed: an archive that
    holds more than its members, their headers and its directory is refused unread.

    Raises:
      SxError: E-BUNDLE-004 for bytes besides the members; E-BUNDLE-002 when unreadable.
    """
    size = os.fstat(self.f.fileno()).st_size
    most = sum(2 * (100 + len(i.filename.encode("utf-8", "replace")) + len(i.extra))
               + len(i.comment) + i.compress_size for i in self.zip.infolist()) + (1 << 17)
    if size > most:
      raise SxError("E-BUNDLE-004", f"{self.path} holds {size} bytes, {size - most} more than "
                    "its members and their headers take", where=self.path,
                    fix="data was put before or between the archive's members; make the "
                    "bundle again with sexpgpu bundle")
    h = hashlib.sha256()
    try:
      self.f.seek(0)
      for block in iter(lambda: self.f.read(_CHUNK), b""):
        h.update(block)
    except OSError as e:
      raise damaged(self.path, e.strerror or str(e)) from None
    return h.hexdigest()

  def close(self) -> None:
    """Closes the archive and its file."""
    self.zip.close()
    self.f.close()

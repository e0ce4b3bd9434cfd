"""Fuzzes bundles: hostile `.sxb` archives fed to `sexpgpu run X.sxb --steps 1` and `check X.sxb`.

`hostile_bundles(folder)` writes the named hostile archives (paths that leave the archive,
links and devices, zip bombs, member-count bombs, a manifest of each wrong type, not JSON,
binary, deep, huge, a cut or damaged zip, no zip at all, an empty file, a folder, a FIFO,
/dev/zero); `mutated(rng, base, folder, i)` makes randomized ones from a real bundle (its
manifest's values replaced by values of other types, its paths, sizes and bytes changed).
`fuzz` feeds them to `sexpgpu.cli.main.main` in this process. A finding is, as in
benchmarks/fuzz.py: an exception other than SxError escaping, a traceback on standard error,
an exit status other than 0 or 1, an exit 1 without an `error[E-...]` line, an input that
runs past 60 s, an exit 0 for an input known to be bad, or a `.tmp` folder left in the cache.

    python benchmarks/fuzz_bundles.py --count 500 --seed 1

prints the outcomes, the time and each finding (exit 1 when there is one).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import signal
import stat
import struct
import sys
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_S = 60
# Values a manifest field is replaced with; the types each field allows are in TYPES.
POOL = [None, True, False, 0, -1, 1, 1.5, 10**30, float("nan"), "", "x", "smoke", "../x.sx",
        "/etc/passwd", "a\u0000b", "\udcff", "é/ü.sx", "x" * 5000, [], [1], ["a", "b"],
        [["a", "b"]], [["a"]], [[1, 2]], {}, {"a": 1}, {"x.sx": {}}]
# JSON types each field may hold ("null" where it may be absent); others are known bad.
TYPES = {"format": {"str"}, "version": {"int"}, "experiment": {"str"}, "files": {"dict"},
         "variant": {"str", "null"}, "sets": {"list", "null"}, "slug": {"str", "null"},
         "fingerprint": {"str", "null"}, "versions": {"dict", "null"}, "std": {"dict", "null"},
         "created_at": {"int", "float", "null"}, "data_not_bundled": {"list", "null"},
         "remote_data": {"list", "null"}}
PATHS = ["../x.sx", "/tmp/x.sx", "a/../../x.sx", "", ".", "./a", "a//b", "C:/x", "a\\..\\..\\x",
         "x" * 300, "a\u0001b", "manifest.json", "data", "é.sx"]


def _type(v) -> str:
  return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "list",
          dict: "dict"}[type(v)]


# --- writing archives -------------------------------------------------------------------------

def base_bundle(folder: str) -> str:
  """A real bundle (configs/char-lm.sx, variant smoke, with its data) in `folder`."""
  from sexpgpu.tools.bundle import make_bundle
  out = os.path.join(folder, "base.sxb")
  if not os.path.exists(out):
    make_bundle(os.path.join(ROOT, "configs", "char-lm.sx"), out, "smoke", [("steps", "2")],
                with_data=True)
  return out


def _parts(base: str) -> tuple[dict, dict[str, bytes]]:
  with zipfile.ZipFile(base) as z:
    members = {n: z.read(n) for n in z.namelist()}
  return json.loads(members.pop("manifest.json")), members


def _zip(path: str, manifest, members: dict[str, bytes], infos=()) -> str:
  """A zip of manifest.json (a dict, or bytes as they are) and the members."""
  data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
    z.writestr("manifest.json", data)
    for name, blob in members.items():
      z.writestr(name, blob)
    for info, blob in infos:
      z.writestr(info, blob)
  return path


def _patch_zip(path: str, member: str, *, size: int | None = None, flags: int | None = None,
               method: int | None = None, crc: int | None = None,
               compressed: int | None = None) -> None:
  """Rewrites one member's uncompressed size, flag bits, method or CRC in both of its zip
  headers (what a hostile archive declares, whatever its data)."""
  with zipfile.ZipFile(path) as z:
    info, start = z.getinfo(member), z.start_dir
  with open(path, "r+b") as f:
    blob = bytearray(f.read())
  offsets = [(info.header_offset, 6, 8, 14, 22)]  # local: flags, method, crc, size
  pos = start
  while blob[pos:pos + 4] == b"PK\x01\x02":
    n, e, c = struct.unpack("<HHH", blob[pos + 28:pos + 34])
    if blob[pos + 46:pos + 46 + n].decode("utf-8", "replace") == member:
      offsets.append((pos, 8, 10, 16, 24))
    pos += 46 + n + e + c
  for at, f_off, m_off, c_off, s_off in offsets:
    if flags is not None:
      struct.pack_into("<H", blob, at + f_off, flags)
    if method is not None:
      struct.pack_into("<H", blob, at + m_off, method)
    if crc is not None:
      struct.pack_into("<I", blob, at + c_off, crc)
    if size is not None:
      struct.pack_into("<I", blob, at + s_off, size)
    if compressed is not None:  # just before the size in both headers
      struct.pack_into("<I", blob, at + s_off - 4, compressed)
  with open(path, "wb") as f:
    f.write(blob)


def _tar(path: str, manifest: dict, members: dict[str, bytes], special=(), mode="w") -> str:
  with tarfile.open(path, mode) as t:
    for name, blob in [("manifest.json", json.dumps(manifest).encode())] + list(members.items()):
      info = tarfile.TarInfo(name)
      info.size = len(blob)
      t.addfile(info, io.BytesIO(blob))
    for info in special:
      t.addfile(info)
  return path


def _special(name: str, kind: bytes, target: str = "") -> tarfile.TarInfo:
  info = tarfile.TarInfo(name)
  info.type, info.linkname = kind, target
  return info


def _manifest_cases(manifest: dict) -> list[tuple[str, dict]]:
  """The manifest with each field missing or of a wrong type, and each file entry's."""
  member = "data/corpus.txt"
  out = []
  for field, allowed in TYPES.items():
    for value in (None, True, 1, "x", [["a"]], {"a": 1}):
      if _type(value) not in allowed:
        m = copy.deepcopy(manifest)
        m[field] = value
        out.append((f"manifest-{field}-{_type(value)}", m))
  for field in ("format", "version", "experiment", "files"):
    m = copy.deepcopy(manifest)
    del m[field]
    out.append((f"manifest-{field}-missing", m))
  for field, value in [("sha256", "AB" * 32), ("sha256", 7), ("bytes", -1), ("bytes", True),
                       ("bytes", 1.5), ("bytes", "10"), ("kind", "weird"), ("kind", None)]:
    m = copy.deepcopy(manifest)
    m["files"][member][field] = value
    out.append((f"manifest-files-{field}-{_type(value)}", m))
  for name, m_change in [("sets-string", ("sets", "lr=1")),
                         ("sets-triple", ("sets", [["a", "b", "c"]])),
                         ("sets-nested", ("sets", [[["lr"], "1"]])),
                         ("variant-list", ("variant", ["smoke"])),
                         ("version-2", ("version", 2)), ("format-other", ("format", "zip")),
                         ("created-nan", ("created_at", float("nan"))),
                         ("experiment-unlisted", ("experiment", "other.sx")),
                         ("experiment-data", ("experiment", member)),
                         ("experiment-surrogate", ("experiment", "\udcff.sx")),
                         ("std-list", ("std", ["std/nn.sx"])),
                         ("versions-int", ("versions", {"jax": 1}))]:
    m = copy.deepcopy(manifest)
    m[m_change[0]] = m_change[1]
    out.append((f"manifest-{name}", m))
  for name, key in [("nul", "a\u0000b"), ("control", "a\u0001b"), ("long", "x" * 300),
                    ("self", "manifest.json"), ("folder", "data"), ("dot", "./x"),
                    ("backslash", "a\\..\\..\\x")]:
    m = copy.deepcopy(manifest)
    m["files"][key] = dict(m["files"][member])
    out.append((f"manifest-files-key-{name}", m))
  return out


def hostile_bundles(folder: str) -> list[tuple[str, str]]:
  """Writes the named hostile archives into `folder`; every one must be refused.

  Returns:
    [(name, path)], each archive a bundle that `run` and `check` must refuse with an
    E-code: no traceback, no hang, no exit 0.
  """
  os.makedirs(folder, exist_ok=True)
  base = base_bundle(folder)
  manifest, members = _parts(base)
  data = "data/corpus.txt"
  cases: list[tuple[str, str]] = []

  def add(name: str, path: str) -> None:
    cases.append((name, path))

  def p(name: str) -> str:
    return os.path.join(folder, name + ".sxb")

  # paths that leave the archive
  outside = os.path.join(folder, "elsewhere", "outside.sx")
  os.makedirs(os.path.dirname(outside), exist_ok=True)
  with open(os.path.join(ROOT, "configs", "tiny-lm.sx"), "rb") as f:
    open(outside, "wb").write(f.read())
  for name, exp in [("experiment-parent", "../../elsewhere/outside.sx"),
                    ("experiment-absolute", outside), ("experiment-dotdot-mid", "a/../../x.sx")]:
    add(name, _zip(p(name), {**manifest, "experiment": exp}, members))
  for name, member in [("member-parent", "../x.sx"), ("member-absolute", "/tmp/sexpgpu-x.sx"),
                       ("member-dotdot-mid", "a/../../x.sx")]:
    add(name, _zip(p(name), manifest, members, [(zipfile.ZipInfo(member), b"(defknob x 1)")]))
  link = zipfile.ZipInfo("link.sx")
  link.external_attr = (stat.S_IFLNK | 0o777) << 16
  add("member-zip-symlink", _zip(p("member-zip-symlink"), manifest, members,
                                 [(link, b"/etc/passwd")]))
  for name, kind, target in [("tar-symlink", tarfile.SYMTYPE, "/etc/passwd"),
                             ("tar-hardlink", tarfile.LNKTYPE, "char-lm.sx"),
                             ("tar-chardev", tarfile.CHRTYPE, ""),
                             ("tar-fifo", tarfile.FIFOTYPE, "")]:
    add(name, _tar(p(name), manifest, members, [_special("x.sx", kind, target)]))
  add("tar-gzip", _tar(p("tar-gzip"), manifest, members, mode="w:gz"))
  # bombs: a member declared larger than the manifest says; a member whose data runs past
  # what it declares; the manifest and the member agreeing on a size the data lacks
  big = b"\0" * (8 << 20)
  m = copy.deepcopy(manifest)
  m["files"][data]["bytes"] = len(members[data])
  path = _zip(p("zip-bomb-declared"), m, {**members, data: big})
  add("zip-bomb-declared", path)
  path = _zip(p("zip-bomb-real"), m, {**members, data: big})
  _patch_zip(path, data, size=len(members[data]))
  add("zip-bomb-real", path)
  m2 = copy.deepcopy(manifest)
  m2["files"][data]["bytes"] = 1 << 31
  path = _zip(p("zip-bomb-agreeing"), m2, members)
  _patch_zip(path, data, size=1 << 31)
  add("zip-bomb-agreeing", path)
  with zipfile.ZipFile(p("member-count-bomb"), "w") as z:
    z.writestr("manifest.json", json.dumps(manifest))
    for i in range(10_002):
      z.writestr(f"m/{i}", b"")
  add("member-count-bomb", p("member-count-bomb"))
  path = _zip(p("member-padded"), manifest, members)  # compressed bytes past any deflate's
  _patch_zip(path, data, compressed=50 << 20)
  add("member-padded", path)
  for name, field, value in [("directory-count-bomb", 10, 60_000),
                             ("directory-size-bomb", 12, 0xFFFFFFF0)]:
    blob = bytearray(open(base, "rb").read())
    end = blob.rfind(b"PK\x05\x06")
    struct.pack_into("<H" if field == 10 else "<L", blob, end + field, value)
    if field == 10:
      struct.pack_into("<H", blob, end + 8, value)
    with open(p(name), "wb") as f:
      f.write(blob)
    add(name, p(name))
  with open(p("prepended"), "wb") as f:  # zipfile reads past what comes before the archive
    f.write(b"\0" * (1 << 20) + open(base, "rb").read())
  add("prepended", p("prepended"))
  # the manifest: each field wrong, not JSON, binary, deep, huge, missing
  for name, m in _manifest_cases(manifest):
    add(name, _zip(p(name), m, members))
  for name, blob in [("manifest-not-json", b"{not json"), ("manifest-binary", bytes(range(256))),
                     ("manifest-deep", b"[" * 100_000 + b"]" * 100_000),
                     ("manifest-deep-object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
                     ("manifest-huge", json.dumps({**manifest, "pad": "x" * (2 << 20)}).encode()),
                     ("manifest-list", b"[]"), ("manifest-null", b"null"),
                     ("manifest-bigint", json.dumps(manifest).encode()[:-1] + b', "x": '
                      + b"9" * 5000 + b"}"),
                     ("manifest-empty", b"")]:
    add(name, _zip(p(name), blob, members))
  with zipfile.ZipFile(p("manifest-missing"), "w") as z:
    for n, blob in members.items():
      z.writestr(n, blob)
  add("manifest-missing", p("manifest-missing"))
  # members against the manifest
  add("member-unlisted", _zip(p("member-unlisted"), manifest, {**members, "extra.sx": b"x"}))
  add("member-missing", _zip(p("member-missing"), manifest,
                             {n: b for n, b in members.items() if n != data}))
  add("member-tampered", _zip(p("member-tampered"), manifest,
                              {**members, "char-lm.sx": members["char-lm.sx"].replace(
                                  b"defrun", b"defrun ")}))
  dup = zipfile.ZipInfo(data)
  with contextlib.redirect_stderr(io.StringIO()), warnings_off():
    add("member-duplicate", _zip(p("member-duplicate"), manifest, members, [(dup, b"x")]))
  for name, change in [("member-encrypted", {"flags": 1}), ("member-bzip2", {"method": 12}),
                       ("member-method-99", {"method": 99})]:
    path = _zip(p(name), manifest, members)
    _patch_zip(path, data, **change)
    add(name, path)
  # the file itself
  blob = open(base, "rb").read()
  for name, content in [("truncated", blob[:len(blob) // 2]), ("truncated-end", blob[:-1]),
                        ("corrupt", blob[:200] + bytes(b ^ 0x5A for b in blob[200:260])
                         + blob[260:]),
                        ("not-a-zip", b"(defrun :steps 1)\n"), ("empty", b""),
                        ("binary", bytes(range(256)) * 8)]:
    with open(p(name), "wb") as f:
      f.write(content)
    add(name, p(name))
  for name, make in [("a-folder", lambda q: os.makedirs(q, exist_ok=True)),
                     ("a-fifo", lambda q: os.path.exists(q) or os.mkfifo(q)),
                     ("dev-zero", lambda q: os.path.lexists(q) or os.symlink("/dev/zero", q)),
                     ("dangling-link", lambda q: os.path.lexists(q) or os.symlink(
                         os.path.join(folder, "no-such.sxb"), q))]:
    make(p(name))
    add(name, p(name))
  return cases


@contextlib.contextmanager
def warnings_off():
  """Silences zipfile's warning about a duplicate name (the duplicate is the point)."""
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    yield


# --- randomized --------------------------------------------------------------------------------

def _field_paths(m: dict) -> list[tuple]:
  paths = [(k,) for k in m]
  for name, entry in m.get("files", {}).items():
    paths.append(("files", name))
    paths += [("files", name, k) for k in entry]
  paths += [("sets", i) for i in range(len(m.get("sets") or []))]
  return paths


def _set_path(m: dict, path: tuple, value, delete: bool = False) -> None:
  node = m
  for k in path[:-1]:
    node = node[k]
  if delete:
    del node[path[-1]]
  else:
    node[path[-1]] = value


def mutated(rng: random.Random, base: str, folder: str, i: int) -> tuple[str, str, bool]:
  """A randomized hostile archive made from the real bundle `base`.

  Returns:
    (what was changed, its path, whether it is known to be bad: a run must not exit 0).
  """
  manifest, members = _parts(base)
  path = os.path.join(folder, f"mut{i % 40}.sxb")
  kind = rng.choice(["value", "value", "value", "delete", "name", "size", "bytes", "member",
                     "header"])
  bad = True
  if kind in ("value", "delete"):
    field = rng.choice(_field_paths(manifest))
    if kind == "delete":
      _set_path(manifest, field, None, delete=True)
      bad = field[0] == "files" or field[0] in ("format", "version", "experiment")
      what = f"delete {field}"
    else:
      value = copy.deepcopy(rng.choice(POOL))
      if rng.random() < 0.05:
        value = json.loads("[" * 20 + "]" * 20)
      _set_path(manifest, field, value)
      what = f"{field} = {str(value)[:40]!r}"
      if len(field) == 1 and field[0] in TYPES:
        bad = _type(value) not in TYPES[field[0]] or field[0] in ("format", "version",
                                                                  "experiment", "files")
      elif len(field) == 1:
        bad = False  # a field the manifest does not use
      elif field[0] == "sets":
        bad = not (isinstance(value, list) and len(value) == 2
                   and all(isinstance(v, str) for v in value) and value[0])
      elif len(field) == 3 and field[2] not in ("sha256", "bytes", "kind"):
        bad = False
    _zip(path, manifest, members)
  elif kind == "name":
    new = rng.choice(PATHS)
    old = rng.choice(list(members))
    where = rng.choice(["archive", "manifest", "both"] if new else ["manifest"])  # zip needs a name
    if where in ("archive", "both"):
      members[new] = members.pop(old)
    if where in ("manifest", "both"):
      manifest["files"][new] = manifest["files"].pop(old)
      if manifest["experiment"] == old:
        manifest["experiment"] = new
    what = f"rename {old} to {new!r} in the {where}"
    with warnings_off():
      _zip(path, manifest, members)
    bad = where != "both" or new in ("manifest.json", "data") or new in PATHS[:11]
  elif kind == "size":
    name = rng.choice(list(members))
    manifest["files"][name]["bytes"] = rng.choice([0, 1, len(members[name]) + 1, 1 << 33, -5])
    what = f"bytes of {name} = {manifest['files'][name]['bytes']}"
    _zip(path, manifest, members)
  elif kind == "member":
    name = rng.choice([q for q in PATHS if q] + ["new.sx", "data/more.txt"])
    what = f"an extra member {name!r}"
    with warnings_off():
      _zip(path, manifest, {**members, name: b"x" * rng.choice([0, 1, 1000])})
  elif kind == "header":
    name = rng.choice(["manifest.json"] + list(members))
    field = rng.choice(["size", "method", "crc", "flags", "compressed"])
    value = rng.choice([0, 1, 7, 8, 12, 99, 0x0800, 0xFFFF, 1 << 20, 0xFFFFFFFF]) if field in (
        "size", "crc", "compressed") else rng.choice([0, 1, 8, 9, 12, 14, 0x0800, 0xFFFF])
    _zip(path, manifest, members)
    with zipfile.ZipFile(path) as z:
      was = getattr(z.getinfo(name), {"size": "file_size", "method": "compress_type",
                                      "crc": "CRC", "flags": "flag_bits",
                                      "compressed": "compress_size"}[field])
    _patch_zip(path, name, **{field: value})
    what = f"{field} of {name} in its headers = {value}"
    # manifest.json's own size is listed nowhere: a larger one reads the same bytes
    bad = value != was and (field in ("method", "crc") or (
        field == "size" and name != "manifest.json"))
  else:
    blob = bytearray(open(base, "rb").read())
    op = rng.choice(["truncate", "flip", "append", "prepend"])
    if op == "truncate":
      blob = blob[:rng.randrange(len(blob))]
    elif op == "flip":
      for _ in range(rng.choice([1, 4, 64])):
        blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
      bad = False  # a flipped bit in a field zip ignores leaves a good bundle
    elif op == "append":
      blob += bytes(rng.randrange(256) for _ in range(rng.choice([1, 100, 5000])))
      bad = False
    else:  # zipfile reads past data put before the archive
      blob = bytes(rng.randrange(256) for _ in range(rng.choice([1, 100, 5000]))) + blob
      bad = False
    what = f"{op} the archive's bytes"
    with open(path, "wb") as f:
      f.write(blob)
  return what, path, bad


# --- feeding ----------------------------------------------------------------------------------

class _Hang(Exception):
  pass


def _alarm(signum, frame):
  raise _Hang()


def feed(argv: list[str], known_bad: bool) -> str | None:
  """Runs `sexpgpu ARGV` in this process; returns a finding, or None."""
  from sexpgpu.cli.main import main
  out, err = io.StringIO(), io.StringIO()
  old = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(HANG_S)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      code = main(argv)
  except _Hang:
    return f"a hang past {HANG_S} s"
  except BaseException as e:  # noqa: BLE001 - any escape is the finding
    return f"{type(e).__name__}: {e}"[:300]
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
  text = err.getvalue()
  if "Traceback" in text:
    return "a traceback on standard error: " + text[-300:]
  if code not in (0, 1):
    return f"exit {code}: " + text[-300:]
  if code == 1 and "error[E-" not in text:
    return "exit 1 without an error code: " + text[-300:]
  if code == 0 and known_bad:
    return "exit 0 for a bundle known to be bad"
  FED[(argv[0], code)] = FED.get((argv[0], code), 0) + 1
  return None


# (command, exit status) → how many inputs ended so.
FED: dict[tuple[str, int], int] = {}


def _left_behind() -> list[str]:
  from sexpgpu.paths import cache_dir
  folder = os.path.join(cache_dir(), "bundles")
  return sorted(n for n in os.listdir(folder) if n.endswith(".tmp")) if os.path.isdir(
      folder) else []


def fuzz(count: int, seed: int, folder: str, start: int = 0) -> tuple[int, list[str]]:
  """Feeds cases start..count-1: the named hostile bundles in turn, between randomized ones.

  Each case goes through `check X.sxb` and `run X.sxb --steps 1 --eval-every 0 --json`.

  Returns:
    (cases fed, findings as "case N (what): finding").
  """
  os.makedirs(folder, exist_ok=True)
  named = hostile_bundles(os.path.join(folder, "named"))
  base = base_bundle(os.path.join(folder, "named"))
  findings = []
  for i in range(start, count):
    rng = random.Random(seed * 1_000_003 + i)
    if i % 3 == 0:
      what, path = named[(i // 3) % len(named)]
      bad = True
    else:
      what, path, bad = mutated(rng, base, folder, i)
    for argv in (["check", path], ["run", path, "--steps", "1", "--eval-every", "0", "--json"]):
      found = feed(argv, bad)
      left = _left_behind()
      if found is None and left:
        found = f"a temporary folder left in the cache: {left[0]}"
      if found:
        findings.append(f"case {i} ({what}; {argv[0]}): {found}")
        break
  return count - start, findings


def main() -> int:
  """The command line: prints what was fed and found; exit 1 when anything was found."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--count", type=int, default=500)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--start", type=int, default=0)
  ap.add_argument("--keep", default=None, help="the folder of the cases (default: a temp one)")
  args = ap.parse_args()
  import tempfile
  folder = args.keep or tempfile.mkdtemp(prefix="fuzz-bundles-")
  t = time.perf_counter()
  fed, findings = fuzz(args.count, args.seed, folder, args.start)
  print(f"fuzz_bundles: {fed} cases in {time.perf_counter() - t:.1f}s, {len(findings)} "
        f"findings; outcomes {dict(sorted(FED.items()))}; cases in {folder}")
  for f in findings:
    print("  " + f)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())

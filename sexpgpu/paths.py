"""Where things are kept: the cache folder, remote locations, and files written atomically."""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from typing import Iterator, Mapping

from fsspec.core import split_protocol

from sexpgpu.errors import SxError
# The one credential scrubber lives in sexpgpu/errors.py (below every layer: SxError and the
# language's slug use it); this module is where the rest of the package takes it from.
from sexpgpu.errors import (credentials_in, known_secrets, may_teach, scrub,  # noqa: F401
                            without_credentials)

# The object stores we read and write, each with the fsspec package that serves it.
REMOTE_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_COUNTER = itertools.count()  # temporary names unique within the process, across threads


def cache_dir(environ: Mapping[str, str] | None = None, check: bool | None = None) -> str:
  """`SEXPGPU_CACHE_DIR`, or `~/.cache/sexpgpu`: choices, the XLA cache, fetched data, bundles.

  Args:
    environ: the environment to read; os.environ when None.
    check: whether to make sure it is a local folder this process can write (made if
      missing; see `usable_cache_dir`). By default, only for the process's own environment.

  Raises:
    SxError: E-ENV-001 naming SEXPGPU_CACHE_DIR, when checked and it cannot be the cache.
  """
  if check is None:
    check = environ is None
  environ = os.environ if environ is None else environ
  folder = environ.get("SEXPGPU_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "sexpgpu")
  return usable_cache_dir(folder) if check else folder


_USABLE: set[str] = set()  # cache folders already made and written to by this process
# The variables that name a cache folder, and the fix for each. JAX's own variable moves
# only the XLA cache; JAX reads a remote one itself (through etils), so only SEXPGPU_CACHE_DIR
# must be local.
_CACHE_FIXES = {
    "SEXPGPU_CACHE_DIR": "point SEXPGPU_CACHE_DIR at a local folder you can write (it is "
                         "made if missing), or unset it for ~/.cache/sexpgpu",
    "JAX_COMPILATION_CACHE_DIR": "point JAX_COMPILATION_CACHE_DIR at a folder you can write "
                                 "(it is made if missing), or unset it for the XLA cache "
                                 "under SEXPGPU_CACHE_DIR",
}


def cache_problem(folder: str) -> str | None:
  """Why `folder` cannot be the cache folder, found without touching the disk, or None.

  A remote location, a NUL, a name that is not UTF-8, a file, or a path under a file
  cannot be; a missing folder can (it is made on first use).
  """
  if "://" in folder or is_remote(folder):
    return ("is a remote location; the cache (compiled code, fetched data) is a local "
            "folder")
  if "\0" in folder:
    return "cannot be the cache folder: a NUL in the name"
  try:
    folder.encode("utf-8")  # XLA's cache and the libraries below take UTF-8 names only
  except UnicodeError:
    return "cannot be the cache folder: its name is not UTF-8"
  path = os.path.abspath(os.path.expanduser(folder))
  while not os.path.lexists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    under = ("" if path == os.path.abspath(os.path.expanduser(folder))
             else f" ({path} is a file)")
    return f"cannot be the cache folder: Not a directory{under}"
  return None


def _shown_location(folder: str) -> str:
  shown = scrub(folder)
  return ascii(shown)[1:-1] if len(shown) <= 120 else ascii(shown[:120])[1:-1] + "..."


def _jaxs_remote(folder: str, name: str) -> bool:
  return name == "JAX_COMPILATION_CACHE_DIR" and ("://" in folder or is_remote(folder))


def check_cache_value(folder: str | None, name: str = "SEXPGPU_CACHE_DIR") -> None:
  """A cache folder variable (`name`) checked as the variable checks do: nothing is made or
  written.

  Raises:
    SxError: E-ENV-001 naming the variable, for what `cache_problem` finds.
  """
  why = cache_problem(folder) if folder and not _jaxs_remote(folder, name) else None
  if why is not None:
    raise SxError("E-ENV-001", f"{name}={_shown_location(folder)} {why}", where=name,
                  fix=_CACHE_FIXES[name])


def usable_cache_dir(folder: str, name: str = "SEXPGPU_CACHE_DIR") -> str:
  """`folder`, once it is known to be a folder this process can write in.

  It is made if missing, and a probe file is written to it and removed (a folder such as
  /proc/self exists but takes no file, even for root), once per process and folder. A
  remote JAX_COMPILATION_CACHE_DIR is JAX's to reach, and is returned as it is.

  Raises:
    SxError: E-ENV-001 naming the variable (`name`) and why: a remote location (for
      SEXPGPU_CACHE_DIR), a NUL, a name that is not UTF-8, or a path that is a file, lies
      under a file, or cannot be made or written.
  """
  if folder in _USABLE or _jaxs_remote(folder, name):
    return folder
  check_cache_value(folder, name)
  try:
    os.makedirs(folder, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".sexpgpu-probe-")
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    why = e.strerror or str(e) or type(e).__name__
    raise SxError("E-ENV-001", f"{name}={_shown_location(folder)} cannot be the cache "
                  f"folder: {why}", where=name, fix=_CACHE_FIXES[name]) from None
  _USABLE.add(folder)
  return folder


_PLAIN = frozenset((int, float, bool, type(None)))  # nothing to scrub in these


def scrubbed(value):
  """`value` (strings, dicts, lists, tuples, sets) with every string in it scrubbed (`scrub`):
  what the status file, every metrics event, a checkpoint's meta and the --json summary
  hold. Sequences and sets come back as lists, as JSON writes them. The credential lists are
  read once for the whole value, again after a string that may teach scrub a new one (a
  step's event, scrubbed every step, reads them once)."""
  known = []

  def walk(v):
    if type(v) in _PLAIN:
      return v
    if isinstance(v, str):
      if may_teach(v):
        known.clear()
        return scrub(v)
      if not known:
        known.append(known_secrets())
      return scrub(v, known[0])
    if isinstance(v, dict):
      return {k: walk(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
      return [walk(x) for x in v]
    return v

  return walk(value)


def redact(uri: str) -> str:
  """A URI without its `user:secret@` and its query (signed-URL keys): the location alone,
  for messages and cache keys. Its credentials are remembered as `scrub` remembers them, so
  a library's error that repeats them is masked too."""
  return without_credentials(uri).split("?", 1)[0]


def scheme(location: str) -> str | None:
  """The location's protocol, lowercased ("s3", "gs", "file"), or None for a plain path."""
  protocol, _ = split_protocol(location)
  return protocol.lower() if protocol else None


def is_remote(location: str) -> bool:
  """True for an object store location: s3://, gs:// or gcs://."""
  return scheme(location) in REMOTE_PACKAGES


def endpoint() -> str | None:
  """The S3 endpoint every remote read and write uses: AWS_ENDPOINT_URL_S3, else
  AWS_ENDPOINT_URL (the order boto3 reads them in), else None for AWS itself."""
  return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def remote_filesystem(location: str, fresh: bool = True):
  """The fsspec filesystem and path of a remote location: the one place a store is opened.

  S3 is opened at `endpoint()`, with short connect and read timeouts and no retries of its
  own: `retrying` retries what may pass, with a line and SEXPGPU_REMOTE_TIMEOUT as its
  bound, and a dead server is reported at once.

  Args:
    location: an `s3://`, `gs://` or `gcs://` URI.
    fresh: a new instance, whose listings are read anew (a loader checking whether its
      object changed); False reuses fsspec's instance for these options in this thread,
      whose client is already made (a look-up that must answer within seconds).

  Returns:
    (filesystem, path inside it: `bucket/key`).

  Raises:
    ImportError: the store's package (s3fs, gcsfs) is missing.
    ValueError: the location is no URI fsspec knows.
  """
  import fsspec  # pylint: disable=import-outside-toplevel  (s3fs, gcsfs load with it)
  options: dict = {"skip_instance_cache": fresh}
  if scheme(location) == "s3":
    options["config_kwargs"] = {"connect_timeout": 5, "read_timeout": 60,
                                "retries": {"max_attempts": 1, "mode": "standard"}}
    if endpoint():
      options["client_kwargs"] = {"endpoint_url": endpoint()}
  fs, path = fsspec.core.url_to_fs(location, **options)
  if scheme(location) == "s3":
    fs.retries = 1  # s3fs's own retry loop around each call, beside botocore's
  return fs, path


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
  """A fresh temporary name beside `path`, renamed onto `path` when the block ends.

  A reader sees the old file or the new one, never part of one; when the block
  raises, the temporary file is removed and `path` is left as it was.

  Raises:
    OSError: the folder cannot be made, or the rename fails.
  """
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{next(_COUNTER)}")
  try:
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


def read_json_object(path: str) -> dict:
  """A local JSON file's object, or {} when the file is missing, unreadable or not an object
  (the caches a run remembers choices and rates in: a damaged one is measured again)."""
  import json
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}


def write_atomic(path: str, data: bytes | str, sync: bool = False) -> None:
  """Writes `data` (bytes, or text as UTF-8) to `path` through `replacing`.

  Args:
    path: the file to (re)place; its folder is made if missing.
    data: the contents.
    sync: fsync the file before the rename (for files that must survive a crash).

  Raises:
    OSError: the folder cannot be made or written.
  """
  with replacing(path) as tmp:
    with open(tmp, "xb") as f:
      f.write(data.encode("utf-8") if isinstance(data, str) else data)
      if sync:
        f.flush()
        os.fsync(f.fileno())

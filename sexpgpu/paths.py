"""Where things are kept: the cache folder, remote locations, and files written atomically."""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Iterator, Mapping

from fsspec.core import split_protocol

# The object stores we read and write, each with the fsspec package that serves it.
REMOTE_PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_COUNTER = itertools.count()  # temporary names unique within the process, across threads


def cache_dir(environ: Mapping[str, str] | None = None) -> str:
  """`SEXPGPU_CACHE_DIR`, or `~/.cache/sexpgpu`: choices, the XLA cache, fetched data, bundles."""
  environ = os.environ if environ is None else environ
  return environ.get("SEXPGPU_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "sexpgpu")


def scheme(location: str) -> str | None:
  """The location's protocol, lowercased ("s3", "gs", "file"), or None for a plain path."""
  protocol, _ = split_protocol(location)
  return protocol.lower() if protocol else None


def is_remote(location: str) -> bool:
  """True for an object store location: s3://, gs:// or gcs://."""
  return scheme(location) in REMOTE_PACKAGES


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

"""Checkpoint locations: local or fsspec (s3://, gs://), and credential-free text."""

from __future__ import annotations

from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.paths import is_remote, scrub  # noqa: F401  (ckpt/ imports them from here)
from sexpgpu.paths import remote_filesystem
from sexpgpu.retrying import bounded

# The marker written last into a remote step folder: a step counts only with it.
COMMIT = "COMMIT"
# What orbax writes just before it renames a local tmp folder into place.
LOCAL_DONE = "commit_success.txt"


def join(base: str, *parts: Any) -> str:
  """Joins path parts with `/`, keeping a remote scheme intact."""
  out = base.rstrip("/") if base not in ("/", "") else base
  for part in parts:
    out = f"{out}/{part}" if out not in ("", "/") else f"{out}{part}"
  return out


def reason(exc: BaseException) -> str:
  """A one-line, credential-free account of an exception."""
  text = scrub(" ".join(str(exc).split()) or type(exc).__name__)  # before it is cut
  if len(text) > 300:
    text = text[:300] + "..."
  return f"{type(exc).__name__}: {text}"


def remote_fs(location: str, where: str):
  """The fsspec filesystem for a remote location (paths.remote_filesystem's).

  Args:
    location: an `s3://` or `gs://` URI.
    where: the flag or place to name in an error.

  Returns:
    An fsspec filesystem.

  Raises:
    SxError: E-CKPT-004 when the filesystem's package is missing, or opening it (gcsfs
      looks for its credentials, a metadata server among them) passes
      SEXPGPU_REMOTE_TIMEOUT.
  """
  try:
    # fsspec's instance, as checkpoints always used: each bounded look-up would otherwise
    # pay for a new client, seconds on a loaded machine
    return bounded(f"opening {scrub(location)}",
                   lambda: remote_filesystem(location, fresh=False)[0])
  except TimeoutError as e:
    raise SxError("E-CKPT-004", f"cannot open checkpoint location {scrub(location)}: {e}",
                  where=where, fix="check the network and the credentials "
                  "(GOOGLE_APPLICATION_CREDENTIALS), or raise SEXPGPU_REMOTE_TIMEOUT") from e
  except ImportError as e:
    pkg = "s3fs" if location.startswith("s3://") else "gcsfs"
    raise SxError("E-CKPT-004", f"cannot open checkpoint location {scrub(location)}: "
                  f"the package {pkg} is not installed", where=where,
                  fix=f"pip install {pkg}") from e


def strip_scheme(uri: str) -> str:
  """`s3://bucket/key` → `bucket/key`, as fsspec filesystems want it."""
  return uri.split("://", 1)[1] if "://" in uri else uri

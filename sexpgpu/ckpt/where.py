"""Checkpoint locations: local or fsspec (s3://, gs://), and credential-free text."""

from __future__ import annotations

from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.paths import is_remote, scrub  # noqa: F401  (ckpt/ imports them from here)
from sexpgpu.paths import credentials_in, remote_filesystem
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


# The flags and variables that name where checkpoints are written (the rest name a resume).
WRITTEN_AT = ("--checkpoint-dir", "SEXPGPU_CHECKPOINT_DIR")


def check_location(location: str, where: str) -> None:
  """Refuses a remote checkpoint location that carries credentials or a query string.

  Neither s3fs nor gcsfs reads credentials from a URI: `s3://K:S@bucket/p` names a bucket
  `K:S@bucket`, and `s3://bucket/p?X-Amz-Security-Token=T` writes every object under a key
  holding the token. So both are refused before anything is written or read, naming the
  flag; the credentials belong in AWS_* variables or the store's own configuration.

  Args:
    location: an `s3://`, `gs://` or `gcs://` URI.
    where: the flag or variable that gave it (--checkpoint-dir, --resume, ...).

  Raises:
    SxError: E-CKPT-004 for a checkpoint location (`where` in WRITTEN_AT), E-CKPT-003 for
      a resume's.
  """
  found = credentials_in(location)
  rest = location.split("://", 1)[-1]
  if not found and "?" not in rest:
    return
  what = " and ".join(found) if found else "a query string"
  if where in WRITTEN_AT:
    raise SxError("E-CKPT-004", f"the checkpoint location {scrub(location)} carries {what}; "
                  "the store would write it into every object's key", where=where,
                  fix="put the credentials in AWS_* variables (or ~/.aws, "
                  "GOOGLE_APPLICATION_CREDENTIALS), not in the URI, and give "
                  "--checkpoint-dir (or SEXPGPU_CHECKPOINT_DIR) as s3://bucket/prefix alone")
  raise SxError("E-CKPT-003", f"the checkpoint to resume, {scrub(location)}, carries {what}; "
                "the store reads no credentials from a URI", where=where,
                fix="put the credentials in AWS_* variables (or ~/.aws, "
                "GOOGLE_APPLICATION_CREDENTIALS), not in the URI, and give --resume (or "
                "SEXPGPU_RESUME) as s3://bucket/prefix/slug/step alone")


def remote_fs(location: str, where: str):
  """The fsspec filesystem for a remote location (paths.remote_filesystem's): the one
  opener of checkpoint stores, so the one place a location is checked (check_location).

  Args:
    location: an `s3://` or `gs://` URI.
    where: the flag or place to name in an error.

  Returns:
    An fsspec filesystem.

  Raises:
    SxError: E-CKPT-004 when the filesystem's package is missing, or opening it (gcsfs
      looks for its credentials, a metadata server among them) passes
      SEXPGPU_REMOTE_TIMEOUT; E-CKPT-004 or 003 for a location with credentials or a
      query string (check_location).
  """
  check_location(location, where)
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

"""Where a loader's file lies: local paths, and s3:// or gs:// files fetched once into the cache."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from sexpgpu.data.spec import LoaderSpec, load_error, redact
from sexpgpu.paths import REMOTE_PACKAGES, is_remote, scheme  # noqa: F401  (is_remote: for data/)
from sexpgpu.paths import cache_dir as default_cache_dir
from sexpgpu.paths import endpoint, remote_filesystem, replacing, write_atomic
from sexpgpu.retrying import call as retried


def resolve(spec: LoaderSpec, path: str, cache_dir: str | None) -> str:
  """The local file a loader reads: relative to the `.sx` file, or fetched.

  Args:
    spec: the loader's declaration (for base_dir and errors).
    path: the loader's file: relative, absolute, s3://... or gs://...
    cache_dir: the cache root; remote files go to `<cache_dir>/data/`.

  Returns:
    The path of a local file that exists.

  Raises:
    SxError: E-LOAD-001 when the file does not exist, E-LOAD-004 when a
      remote store cannot be reached or refuses access.
  """
  if is_remote(path):
    return fetch(spec, path, cache_dir or default_cache_dir())
  local = path if os.path.isabs(path) else os.path.join(spec.base_dir, path)
  if not os.path.isfile(local):
    raise load_error("E-LOAD-001", spec, local, "no such file",
                     f"check the path; relative paths start at {spec.base_dir or '.'}")
  return local


def fetch(spec: LoaderSpec, uri: str, cache_dir: str) -> str:
  """Fetches a remote file once into the cache, checked by size and ETag.

  A cached copy is reused when one `info()` call reports the size and ETag
  recorded in its sidecar (`<file>.meta.json`).

  Args:
    spec: the loader's declaration, for errors.
    uri: s3://bucket/key or gs://bucket/key (credentials allowed, never shown).
    cache_dir: the cache root.

  Returns:
    The local copy's path.

  Raises:
    SxError: E-LOAD-001 when the object does not exist, E-LOAD-004 when the
      store cannot be reached, the bucket does not exist or access is refused.
  """
  fs, path = _filesystem(spec, uri)
  info = _call(spec, uri, fs, fs.info, path)
  stamp = {"uri": redact(uri), "size": int(info["size"]), "etag": _etag(info)}
  folder = os.path.join(cache_dir, "data", hashlib.sha256(redact(uri).encode()).hexdigest()[:32])
  local = os.path.join(folder, os.path.basename(path.rstrip("/")) or "object")
  sidecar = local + ".meta.json"
  if _cached(local, sidecar, stamp):
    return local
  with replacing(local) as partial:
    _call(spec, uri, fs, fs.get_file, path, partial)
  write_atomic(sidecar, json.dumps(stamp))
  return local


def _cached(local: str, sidecar: str, stamp: dict[str, Any]) -> bool:
  try:
    with open(sidecar, encoding="utf-8") as f:
      recorded = json.load(f)
  except (OSError, ValueError):
    return False
  return recorded == stamp and os.path.getsize(local) == stamp["size"]


def _etag(info: dict[str, Any]) -> str | None:
  for key in ("ETag", "etag", "md5Hash", "crc32c"):
    if info.get(key):
      return str(info[key]).strip('"')
  return None


def _filesystem(spec: LoaderSpec, uri: str):
  try:
    return remote_filesystem(uri)
  except ImportError:
    package = REMOTE_PACKAGES[scheme(uri)]
    raise load_error("E-LOAD-004", spec, uri, f"cannot read this store: {package} is not installed",
                     f"pip install {package}") from None
  except ValueError as e:
    raise load_error("E-LOAD-004", spec, uri, "not a valid remote URI",
                     "write s3://bucket/key or gs://bucket/key") from e


def _remote_errors() -> tuple[type[BaseException], ...]:
  errors: list[type[BaseException]] = [OSError, TimeoutError]
  try:
    import botocore.exceptions  # pylint: disable=import-outside-toplevel
    errors += [botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError]
  except ImportError:
    pass
  try:
    import aiohttp  # pylint: disable=import-outside-toplevel
    errors.append(aiohttp.ClientError)
  except ImportError:
    pass
  return tuple(errors)


def _call(spec: LoaderSpec, uri: str, fs, method, *args):
  """Calls a filesystem method, turning its failures into E-LOAD errors.

  A store that answered before in this process is retried with backoff while it fails for
  a passing reason (SEXPGPU_REMOTE_TIMEOUT); one that never answered is reported at once.
  """
  store = endpoint() or scheme(uri) or "remote"
  try:
    return retried(f"fetch of {redact(uri)}", method, *args, prefix="data", store=store,
                   describe=lambda e: type(e).__name__)
  except FileNotFoundError:
    bucket = args[0].split("/", 1)[0]
    if _bucket_exists(fs, bucket):
      raise load_error("E-LOAD-001", spec, uri, "no such object",
                       "check the key, or upload the file first") from None
    raise load_error("E-LOAD-004", spec, uri,
                     f"bucket `{bucket}` does not exist or is not visible",
                     "check the bucket name, the credentials and AWS_ENDPOINT_URL") from None
  except PermissionError:
    raise load_error("E-LOAD-004", spec, uri, "access refused",
                     "check the credentials (AWS_* variables, ~/.aws) and the bucket policy"
                     ) from None
  except _remote_errors() as e:
    raise load_error("E-LOAD-004", spec, uri, f"cannot reach the store ({type(e).__name__})",
                     "check the network, AWS_ENDPOINT_URL and the credentials") from None


def _bucket_exists(fs, bucket: str) -> bool:
  try:
    fs.info(bucket)
    return True
  except Exception:  # pylint: disable=broad-except
    return False

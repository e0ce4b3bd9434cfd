"""The token cache `sexpgpu tokenize` writes and the `text` loader reads: its layout and manifest.

A cache is a folder holding `manifest.json`, `tokenizer.json` and, for each
source file, `shard-NNNNN.bin` (the documents' tokens end to end, each
document followed by the end-of-document token; uint16 when the vocabulary
fits, else uint32) and `shard-NNNNN.idx` (int64 document start offsets into
the `.bin`, one more than documents). The manifest is the truth: a shard
counts only when the manifest lists it and its files have the sizes it says.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from sexpgpu import bounded, paths
from sexpgpu.errors import SxError

FORMAT = "sexpgpu-token-cache/1"
MANIFEST = "manifest.json"
MANIFEST_LIMIT = 256 * bounded.MiB  # a line a shard: millions of shards
TOKENIZER = "tokenizer.json"


def shard_name(index: int) -> str:
  """The stem of the index-th shard: `shard-00000`."""
  return f"shard-{index:05d}"


def token_dtype(vocab: int) -> np.dtype:
  """uint16 when every id fits in it, else uint32."""
  return np.dtype(np.uint16) if vocab <= 1 << 16 else np.dtype(np.uint32)


def dumps(manifest: dict[str, Any]) -> str:
  """The manifest's text: stable (sorted keys), so equal caches have equal bytes."""
  return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def write_atomic(path: str, data: bytes) -> None:
  """Writes a file under a temporary name in the same folder, then renames it into place."""
  paths.write_atomic(path, data)


def read_manifest(folder: str) -> dict[str, Any] | None:
  """The manifest of a cache folder, or None when there is none or it does not parse."""
  try:  # bounded: a manifest lists a shard a line, far below MANIFEST_LIMIT
    manifest = bounded.read_json(os.path.join(folder, MANIFEST), limit=MANIFEST_LIMIT,
                                 what="token cache manifest", code="E-LOAD-003")
  except SxError:
    return None
  if manifest.get("format") != FORMAT:
    return None
  return manifest


def shard_sizes(entry: dict[str, Any], dtype: np.dtype) -> dict[str, int]:
  """The byte sizes a whole shard's files have: {".bin": …, ".idx": …}."""
  return {".bin": int(entry["tokens"]) * np.dtype(dtype).itemsize,
          ".idx": (int(entry["documents"]) + 1) * 8}


def shard_problem(folder: str, entry: dict[str, Any], dtype: np.dtype) -> str | None:
  """Why a listed shard is not whole (a file missing or of another size), or None when it is."""
  for ext, want in shard_sizes(entry, dtype).items():
    path = os.path.join(folder, entry["shard"] + ext)
    try:
      have = os.path.getsize(path)
    except OSError:
      return f"{path}: missing"
    if have != want:
      return f"{path}: {have} bytes, the manifest says {want} (truncated or rewritten)"
  return None

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


EOS = "<|endoftext|>"


def char_vocabulary(texts) -> list[str]:
  """The distinct characters of some texts in sorted order (nanoGPT's shakespeare_char ids)."""
  seen: set[str] = set()
  for t in texts:
    seen.update(t)
  return sorted(seen)


def char_tokenizer(chars: list[str], eos: str = EOS):
  """A character-level `tokenizers.Tokenizer`: id i is chars[i], `eos` the last id.

  Built with the library's own parts, no regex over the text's alphabet: a BPE
  model holding each character and no merges, a pre-tokenizer that isolates
  every character (`[\\s\\S]`, newlines and non-ASCII included) and a Fuse
  decoder, so `decode(encode(text).ids) == text` for any text of these
  characters. A character outside them is dropped by `encode`
  (`char_unknown` finds them first).

  Args:
    chars: the distinct characters, in id order.
    eos: the end-of-document token (a special token, id len(chars)).

  Returns:
    The tokenizer; `to_str()` is its tokenizer.json.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  tok = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(eos, special=True, normalized=False)])
  return tok


def _byte_chars() -> dict[int, str]:
  """GPT-2's printable stand-in for each byte, the alphabet of `tokenizers`' ByteLevel."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
  rest = [b for b in range(256) if b not in keep]
  return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def byte_tokenizer():
  """The tokenizer of a `bytes` loader's model: id b is byte b, text encodes as its UTF-8
  bytes and ids decode as UTF-8 (a sequence cut inside a character decodes to U+FFFD).

  Built with the library's own parts (a BPE model of the 256 byte stand-ins and no merges,
  the ByteLevel pre-tokenizer and decoder), so `sample`, `eval` and a notebook take text
  prompts and print text for a model trained on a file's bytes.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  tok = Tokenizer(models.BPE({ch: b for b, ch in _byte_chars().items()}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def char_unknown(tok, text: str) -> list[str]:
  """The characters of `text` that a tokenizer drops (no token's offsets cover them).

  Whitespace counts only for a tokenizer whose vocabulary holds some whitespace character
  as a token of its own (a character-level one); WordPiece's, which drop spaces by design,
  are not faulted for it.
  """
  covered = [False] * len(text)
  for a, b in tok.encode(text, add_special_tokens=False).offsets:
    covered[a:b] = [True] * (b - a)
  spaces = any(t.isspace() and len(t) == 1 for t in tok.get_vocab())
  return sorted({ch for ch, c in zip(text, covered) if not c and (spaces or not ch.isspace())})

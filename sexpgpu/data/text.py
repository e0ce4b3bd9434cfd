"""The `text` loader: rows of a token cache, packed end to end or as whole documents, with masks."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from sexpgpu import bounded
from sexpgpu.data import base, remote, textcache
from sexpgpu.data.files import RecordOrder
from sexpgpu.data.spec import LoaderDef, LoaderSpec, form_error, key, load_error

# Keeps the text loader's shuffle apart from the other loaders' streams (base.TAG_*).
TAG_TEXT = 6
TAG_TEXT_OFFSETS = 7
_I32 = np.dtype(np.int32)
PACKS = ("concat", "docs")
OFFSETS = ("random", "fixed")
SPLIT_BY = ("tokens", "documents")
# The largest text file read whole and tokenized by characters (the tokenize command's bound).
TEXT_FILE_BYTES = bounded.GiB


class _Order(RecordOrder):
  """RecordOrder seeded by (run seed, `:seed`, stream, epoch)."""

  def __init__(self, count: int, shuffle: bool, seed: int, own_seed: int, stream: int):
    super().__init__(count, shuffle, seed, stream)
    self.own_seed = own_seed

  def permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._perms:
      if len(self._perms) >= 2:
        self._perms.pop(next(iter(self._perms)))
      g = base.rng(TAG_TEXT, self.seed, self.own_seed, self.stream, epoch)
      self._perms[epoch] = g.permutation(self.count)
    return self._perms[epoch]


class TextLoader(base.Loader):
  """`(text "cache/" :seq N :batch B [:pack concat|docs] [:offsets random|fixed] [:split [a b]] ...)`.

  The cache is what `sexpgpu tokenize` writes (a folder, or s3:// / gs://
  fetched shard by shard into the data cache). A local text file instead of a
  folder is read as one document of characters, tokenized as `sexpgpu tokenize
  FILE --chars` would (ids in sorted order of its characters, the
  end-of-document id last; `sample` decodes with that tokenizer).
  `:split [a b]` under `:split-by "documents"` keeps documents floor(a·D) …
  floor(b·D)−1 of the cache's D; under `:split-by "tokens"` it keeps tokens
  floor(a·T) … floor(b·T)−1 of the cache's T, end to end (a document cut at an
  edge keeps its part inside: one book splits 90/10 as nanoGPT's prepare.py
  does). The default is tokens for a cache of one document, documents for
  more. `:pack concat` lays those
  documents end to end and cuts rows of N (the last row padded); `:pack docs`
  places whole documents (a longer one cut into pieces of N) into rows first-fit
  in order, the rest of a row padding. The row layout is fixed by the cache and
  the arguments; `:offsets random` (the default for training) moves where each
  epoch's rows cut the text: under `:pack docs` each document longer than a row
  is read from a random offset in 0 … N−1 each epoch (its head, wrapped round
  to its end, is a segment of its own), under `:pack concat` the whole stream
  is; `:offsets fixed` (the default for passes) cuts at offset 0 every epoch.
  `:shuffle` permutes the rows each epoch by (run seed, `:seed`, stream, epoch);
  the offsets are drawn from the same seeds, so record p is a pure function of
  those and p (`:shuffle`, `:stream`, `:seed S`). `:vocab V` checks that the cache's tokenizer fits a model of V
  tokens. Each record has
  `:tokens` (padding is the end-of-document id), `:segments` (1, 2, 3 … per
  document in the row, 0 for padding) and `:positions` (inside the document's
  piece in the row, from 0), all int32[N].
  """

  kind = "text"

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.uri = args["path"]
    if not isinstance(self.uri, str) or not self.uri:
      raise form_error(spec, f"the cache is {self.uri!r}, expected a folder",
                       '(text "cache/" :seq 1024 :batch 8)')
    # every keyword is as TEXT declares it (bind_args checked ranges and names)
    self.seq, self.batch_size, self.pack = args["seq"], args["batch"], str(args["pack"])
    self.offsets = ("random" if ctx.shuffle_default else "fixed") if args["offsets"] is None \
        else str(args["offsets"])
    split = args["split"]
    shuffle = ctx.shuffle_default if args["shuffle"] is None else args["shuffle"]
    stream, own_seed = args["stream"], args["seed"]
    # a text file's character tokenizer (tokenizer.json's text), read by `sample`
    self.tokenizer_json: str | None = None
    local = None if remote.is_remote(self.uri) else _local(spec, self.uri)
    if local is not None and os.path.isfile(local):
      self.manifest, files = self._open_text(local)
    else:
      self.manifest, files = _open_cache(spec, self.uri, ctx.cache_dir)
    # the cache's local folder (its tokenizer.json beside the shards), None when remote
    self.folder = None if self.tokenizer_json is not None else local
    self.eos = int(self.manifest["tokenizer"]["eos_id"])
    self.vocab = int(self.manifest["tokenizer"]["vocab"])
    if args["vocab"] and args["vocab"] < self.vocab:
      raise load_error("E-LOAD-003", spec, self.uri,
                       f"the cache's tokenizer has {self.vocab} tokens, more than :vocab "
                       f"{args['vocab']}",
                       f"raise :vocab (and the model's) to at least {self.vocab}")
    self._shards, starts, ends = (files if self.tokenizer_json is not None
                                  else self._read_shards(files))
    self.split_by = str(args["split-by"] or ("tokens" if len(starts) == 1 else "documents"))
    if self.split_by == "tokens":
      self._split_tokens(split, starts, ends)
    else:
      self._split_documents(split, starts, ends)
    if self.pack == "concat":
      self.records = -(-self.tokens // self.seq)
    else:
      self._rows = first_fit(np.diff(self._bounds), self.seq)
      self.records = len(self._rows[0]) - 1
    if self.records < self.batch_size:
      raise load_error("E-LOAD-002", spec, self.uri,
                       f"{self.records} rows of {self.seq} tokens is fewer than one microbatch "
                       f"of {self.batch_size}", "tokenize more text, or lower :seq or :batch")
    self.order = _Order(self.records, shuffle, ctx.seed, own_seed, stream)
    self._seeds = (ctx.seed, own_seed, stream)
    self._shifts: dict[int, np.ndarray] = {}
    shape = (self.batch_size, self.seq)
    self.fields = {"tokens": (shape, _I32), "segments": (shape, _I32),
                   "positions": (shape, _I32)}

  def _split_documents(self, split, starts: np.ndarray, ends: np.ndarray) -> None:
    """Keeps documents floor(a·D) … floor(b·D)−1, whole."""
    total = len(starts)
    d0, d1 = math.floor(split[0] * total), math.floor(split[1] * total)
    self.documents = d1 - d0
    if self.documents == 0:
      raise load_error(
          "E-LOAD-002", self.spec, self.uri,
          f"the split {list(split)} holds no document of the cache's {total}: under "
          ':split-by "documents" it counts whole documents, and '
          f"floor({split[0]:g}·{total}) = floor({split[1]:g}·{total}) = {d0}",
          f'write :split-by "tokens" to split by tokens within the documents ({total} '
          f"document{'s' if total != 1 else ''} cut {split[0]:g}…{split[1]:g} by tokens), or "
          "widen :split, or tokenize more documents")
    self._base = int(starts[d0])
    self.tokens = int(ends[d1 - 1]) - self._base
    self._bounds = np.append(starts[d0:d1] - self._base, self.tokens)  # document starts, then T

  def _split_tokens(self, split, starts: np.ndarray, ends: np.ndarray) -> None:
    """Keeps tokens floor(a·T) … floor(b·T)−1 end to end; a document cut at an edge is its
    part inside (nanoGPT's `data[:int(n*0.9)]`, `data[int(n*0.9):]`)."""
    total = int(ends[-1])
    t0, t1 = math.floor(split[0] * total), math.floor(split[1] * total)
    if t1 <= t0:
      raise load_error(
          "E-LOAD-002", self.spec, self.uri,
          f"the split {list(split)} holds no token of the cache's {total} "
          f'(:split-by "tokens")', f"widen :split to hold at least one of the {total} tokens "
          "(such as [0.9 1]), or tokenize more text")
    inside = np.flatnonzero((starts < t1) & (ends > t0))
    self.documents = len(inside)
    self._base = t0
    self.tokens = t1 - t0
    self._bounds = np.append(np.maximum(starts[inside], t0) - t0, self.tokens)

  def _open_text(self, path: str):
    """A text file as a one-document cache in memory: its manifest, and (shards, starts, ends).

    Raises:
      SxError: E-TOK-001 for a file that is not UTF-8 text or larger than TEXT_FILE_BYTES.
    """
    text = bounded.read_text(path, limit=TEXT_FILE_BYTES, what="text file", code="E-TOK-001",
                             where=path, fix="give the text loader a UTF-8 text file of at most "
                             f"{bounded.size_text(TEXT_FILE_BYTES)} (tokenized by characters), "
                             "or a token cache folder that `sexpgpu tokenize` wrote")
    if not text:
      raise load_error("E-LOAD-002", self.spec, path, "the text file is empty",
                       "write the text into the file (one book, UTF-8)")
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)  # a code point a character
    alphabet = np.unique(points)  # sorted, as char_vocabulary sorts them
    chars = [chr(int(p)) for p in alphabet]
    self.tokenizer_json = textcache.char_tokenizer(chars).to_str()
    tokens = np.append(np.searchsorted(alphabet, points).astype(np.int32),
                       np.int32(len(chars)))  # the end-of-document token, as a cache
    manifest = {"tokenizer": {"eos_id": len(chars), "vocab": len(chars) + 1, "eos": textcache.EOS}}
    return manifest, ([(0, tokens)], np.array([0], np.int64), np.array([len(tokens)], np.int64))

  def _read_shards(self, files: dict[str, str]):
    """Memory-maps each whole shard; the global start and end of every document."""
    dtype = np.dtype(self.manifest["dtype"])
    maps, starts, ends, offset = [], [], [], 0
    for entry in self.manifest["shards"]:
      idx_file, bin_file = files[entry["shard"] + ".idx"], files[entry["shard"] + ".bin"]
      for path, want in ((bin_file, entry["tokens"] * dtype.itemsize),
                         (idx_file, (entry["documents"] + 1) * 8)):
        have = os.path.getsize(path)
        if have != want:
          raise load_error("E-LOAD-003", self.spec, path,
                           f"{have} bytes, the manifest says {want}: the shard is truncated "
                           "or was rewritten", "run the same `sexpgpu tokenize` command again; "
                           "it rebuilds the shards that are not whole")
      idx = np.fromfile(idx_file, np.int64)
      if idx[0] != 0 or idx[-1] != entry["tokens"] or (np.diff(idx) <= 0).any():
        raise load_error("E-LOAD-003", self.spec, idx_file, "the document offsets are not "
                         "increasing from 0 to the shard's tokens",
                         "run the same `sexpgpu tokenize` command again")
      maps.append((offset, np.memmap(bin_file, dtype=dtype, mode="r")))
      starts.append(idx[:-1] + offset)
      ends.append(idx[1:] + offset)
      offset += int(entry["tokens"])
    return maps, np.concatenate(starts), np.concatenate(ends)

  def _read(self, start: int, length: int) -> np.ndarray:
    """Tokens [start, start+length) of the split's stream, across shard boundaries."""
    g0, g1 = self._base + start, self._base + start + length
    parts = []
    for offset, m in self._shards:
      lo, hi = max(g0, offset), min(g1, offset + len(m))
      if lo < hi:
        parts.append(m[lo - offset:hi - offset])
    return np.concatenate(parts).astype(_I32) if parts else np.empty(0, _I32)

  def shifts(self, epoch: int) -> np.ndarray:
    """Where each document, and the stream, is read from in one epoch (cached, two epochs).

    Returns:
      One offset a document of the split (0 for a document that fits in a
      row, else 0 … seq−1), then one for the stream (used by `:pack concat`);
      all zero under `:offsets fixed`.
    """
    if epoch not in self._shifts:
      if len(self._shifts) >= 2:
        self._shifts.pop(next(iter(self._shifts)))
      if self.offsets == "fixed":
        shift = np.zeros(self.documents + 1, np.int64)
      else:
        g = base.rng(TAG_TEXT_OFFSETS, *self._seeds, epoch)
        shift = g.integers(0, self.seq, self.documents + 1)
        shift[:-1][np.diff(self._bounds) <= self.seq] = 0
      self._shifts[epoch] = shift
    return self._shifts[epoch]

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of rows, a pure function of (cache, args, seed, i)."""
    first = i * self.batch_size
    rows = self.order.indices(first, self.batch_size)
    out = {k: np.zeros((self.batch_size, self.seq), _I32) for k in self.fields}
    out["tokens"].fill(self.eos)
    for j, r in enumerate(rows):
      shift = self.shifts((first + j) // self.records)
      pieces = self._concat_row(int(r), shift) if self.pack == "concat" else self._docs_row(int(r))
      self._fill(pieces, shift, out["tokens"][j], out["segments"][j], out["positions"][j])
    return out

  def _concat_row(self, r: int, shift: np.ndarray) -> list[np.ndarray]:
    """Row r as one piece: stream places, the stream read from its epoch's offset."""
    start = r * self.seq
    n = min(self.seq, self.tokens - start)
    return [(np.arange(start, start + n) + shift[-1]) % self.tokens]

  def _docs_row(self, r: int) -> list[np.ndarray]:
    """Row r's pieces, each the stream places of one document's piece."""
    ptr, piece_start, piece_len = self._rows
    return [np.arange(piece_start[q], piece_start[q] + piece_len[q])
            for q in range(ptr[r], ptr[r + 1])]

  def _fill(self, pieces: list[np.ndarray], shift: np.ndarray, tokens, segments,
            positions) -> None:
    """Writes a row's pieces, each document read from its offset with its head wrapped round.

    A segment starts at each piece and wherever the text read is not one
    document's consecutive tokens (a document boundary, or a document's end
    followed by its wrapped head); positions count from 0 in each segment.
    """
    at, seg = 0, 0
    for places in pieces:
      doc = np.searchsorted(self._bounds, places, side="right") - 1
      d0 = self._bounds[doc]
      read = d0 + (places - d0 + shift[doc]) % (self._bounds[doc + 1] - d0)
      cut = np.ones(len(read), bool)
      cut[1:] = (np.diff(read) != 1) | (np.diff(doc) != 0)
      starts = np.flatnonzero(cut)
      for a, b in zip(starts, np.append(starts[1:], len(read))):
        seg += 1
        tokens[at + a:at + b] = self._read(int(read[a]), int(b - a))
        segments[at + a:at + b] = seg
        positions[at + a:at + b] = np.arange(b - a)
      at += len(read)

  def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
    """The non-padding tokens of a batch (what `counter tokens` counts)."""
    return int(np.count_nonzero(batch["segments"]))

  def padding(self) -> float:
    """The fraction of row positions that are padding."""
    return 1.0 - self.tokens / (self.records * self.seq)

  def describe(self) -> dict[str, Any]:
    """Kind, field types, rows, the cache, its documents, tokens, vocabulary and padding."""
    return {**super().describe(), "file": remote.redact(self.uri), "documents": self.documents,
            "tokens": self.tokens, "vocab": self.vocab, "padding": self.padding(),
            "offsets": self.offsets, "split_by": self.split_by,
            "summary": f"{self.documents} document{'s' if self.documents != 1 else ''}, "
                       f"{self.tokens} tokens, vocabulary "
                       f"{self.vocab}, padding {100 * self.padding():.1f}%, "
                       f"offsets {self.offsets}, split by {self.split_by}"}


def first_fit(lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Packs documents into rows of n, first-fit in order, longer ones cut into pieces of n.

  Args:
    lengths: each document's length, in order.
    n: the row length.

  Returns:
    (row pointers, piece starts, piece lengths): the pieces of row r are
    ptr[r] … ptr[r+1]−1, in placement order; starts are stream offsets.
  """
  doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
  pieces = [(int(s) + k, min(n, int(length) - k))
            for s, length in zip(doc_starts, lengths) for k in range(0, int(length), n)]
  size = 1
  while size < len(pieces):
    size *= 2
  tree = [n] * (2 * size)  # the most free room under each node; the leaves are rows
  row_of = [0] * len(pieces)
  for q, (_, length) in enumerate(pieces):
    node = 1
    while node < size:  # the leftmost row with room for the piece
      node = 2 * node if tree[2 * node] >= length else 2 * node + 1
    row_of[q] = node - size
    tree[node] -= length
    node //= 2
    while node:
      tree[node] = max(tree[2 * node], tree[2 * node + 1])
      node //= 2
  row_of = np.array(row_of, np.int64)
  order = np.argsort(row_of, kind="stable")
  rows = int(row_of.max()) + 1
  ptr = np.zeros(rows + 1, np.int64)
  np.cumsum(np.bincount(row_of, minlength=rows), out=ptr[1:])
  starts = np.array([p[0] for p in pieces], np.int64)[order]
  lens = np.array([p[1] for p in pieces], np.int64)[order]
  return ptr, starts, lens


def _local(spec: LoaderSpec, uri: str) -> str:
  """A local cache's folder: relative paths are the .sx file's."""
  return uri if os.path.isabs(uri) else os.path.join(spec.base_dir, uri)


def _open_cache(spec: LoaderSpec, uri: str, cache_dir: str | None):
  """The manifest and the local path of each file of a cache (remote ones fetched)."""
  if remote.is_remote(uri):
    root = uri.rstrip("/")
    folder = cache_dir or remote.default_cache_dir()
    manifest_file = remote.fetch(spec, f"{root}/{textcache.MANIFEST}", folder)
    manifest = _manifest(spec, uri, os.path.dirname(manifest_file))
    files = {}
    for entry in manifest["shards"]:
      for ext in (".idx", ".bin"):
        files[entry["shard"] + ext] = remote.fetch(spec, f"{root}/{entry['shard']}{ext}", folder)
    return manifest, files
  local = _local(spec, uri)
  if not os.path.isdir(local):
    raise load_error("E-LOAD-001", spec, local, "no such token cache folder or text file",
                     f"build it with `sexpgpu tokenize TEXT... -o {os.path.relpath(local)} "
                     f"--train-bpe 2048`, or name a text file (read by characters; the "
                     "Shakespeare of configs/shakespeare-char.sx and char-speedrun.sx: "
                     f"`python benchmarks/prepare_shakespeare.py {os.path.dirname(local) or '.'}`"
                     "); the path is relative to the .sx file")
  manifest = _manifest(spec, uri, local)
  files = {entry["shard"] + ext: os.path.join(local, entry["shard"] + ext)
           for entry in manifest["shards"] for ext in (".idx", ".bin")}
  for path in files.values():
    if not os.path.isfile(path):
      raise load_error("E-LOAD-001", spec, path, "a shard the manifest lists is missing",
                       "run the same `sexpgpu tokenize` command again")
  return manifest, files


def _manifest(spec: LoaderSpec, uri: str, folder: str) -> dict[str, Any]:
  manifest = textcache.read_manifest(folder)
  if manifest is None:
    raise load_error("E-LOAD-001", spec, os.path.join(uri, textcache.MANIFEST),
                     "no readable token cache manifest here",
                     f"build the cache with `sexpgpu tokenize TEXT... -o {uri} --train-bpe 2048`")
  if not manifest["shards"]:
    raise load_error("E-LOAD-002", spec, uri, "the cache holds no shard yet",
                     "run `sexpgpu tokenize` to the end")
  return manifest


TEXT = LoaderDef(
    "text", "a `sexpgpu tokenize` cache in rows of packed documents (:tokens :segments "
    ":positions); a text file instead is one document of characters, as `tokenize --chars` "
    "makes them",
    (key("path"), key("seq", required=True), key("batch", required=True),
     key("pack", default="concat", choices=PACKS), key("split"), key("shuffle"), key("stream"),
     key("seed"), key("vocab", default=0, lo=0), key("offsets", choices=OFFSETS),
     key("split-by", choices=SPLIT_BY)), TextLoader)

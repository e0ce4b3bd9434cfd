"""File loaders: token windows from a flat binary (`tokens`), bytes of a file, rows of an `.npz`."""

from __future__ import annotations

import math
import os
import zipfile
from typing import Any

import numpy as np

from sexpgpu.data import base, remote
from sexpgpu.data.spec import LoaderDef, LoaderSpec, form_error, key, load_error
from sexpgpu.errors import did_you_mean

_TOKEN_DTYPES = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32,
                 "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
_CASTS = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.int32),
          np.dtype(np.float64): np.dtype(np.float32)}
# The dtypes an `.npz` field may have, each as the IR's dtype it becomes.
_NPZ_DTYPES = {np.dtype(t): _CASTS.get(np.dtype(t), np.dtype(u)) for t, u in [
    (np.bool_, np.bool_), (np.int8, np.int32), (np.int16, np.int32), (np.int32, np.int32),
    (np.int64, np.int32), (np.uint8, np.int32), (np.uint16, np.int32), (np.uint32, np.uint32),
    (np.uint64, np.int32), (np.float16, np.float16), (np.float32, np.float32),
    (np.float64, np.float32)]}


class RecordOrder:
  """Which source record (window or row) stands at each record position.

  Without shuffle, position r reads source r mod n (wrapping around). With
  shuffle, epoch e = r // n reads a permutation seeded by (seed, stream, e),
  so any position's record is computable without the ones before it.
  """

  def __init__(self, count: int, shuffle: bool, seed: int, stream: int):
    self.count, self.shuffle, self.seed, self.stream = count, shuffle, seed, stream
    self._perms: dict[int, np.ndarray] = {}

  def permutation(self, epoch: int) -> np.ndarray:
    """The order of the source records in one epoch (cached, at most two)."""
    if epoch not in self._perms:
      if len(self._perms) >= 2:
        self._perms.pop(next(iter(self._perms)))
      g = base.rng(base.TAG_SHUFFLE, self.seed, self.stream, epoch)
      self._perms[epoch] = g.permutation(self.count)
    return self._perms[epoch]

  def indices(self, start: int, n: int) -> np.ndarray:
    """Source indices of the records at positions start .. start+n-1."""
    pos = np.arange(start, start + n, dtype=np.int64)
    if not self.shuffle:
      return pos % self.count
    epochs, within = pos // self.count, pos % self.count
    out = np.empty(n, np.int64)
    for e in np.unique(epochs):
      sel = epochs == e
      out[sel] = self.permutation(int(e))[within[sel]]
    return out


def _common(args: dict[str, Any], shuffle_default: bool):
  """(split, shuffle, stream), as bind_args checked them; :shuffle absent is the context's."""
  shuffle = shuffle_default if args["shuffle"] is None else args["shuffle"]
  return args["split"], shuffle, args["stream"]


def _check_path(spec: LoaderSpec, args: dict[str, Any]) -> str:
  path = args["path"]
  if not isinstance(path, str) or not path:
    raise form_error(spec, f"the file is {path!r}, expected a string",
                     f'write ({spec.kind} "FILE" ...)')
  return path


class WindowLoader(base.Loader):
  """`(tokens "train.bin" :dtype u16 :seq N :batch B)` and `(bytes "corpus.txt" :seq N :batch B)`.

  A record is a window of N tokens (int32). `:split [a b]` first cuts the
  token range [a·T, b·T) of the file's T tokens, so splits share no token;
  windows start every `:stride` tokens inside it (default N: windows do not
  overlap; a trailing part shorter than N is unused). `tokens` reads the
  nanoGPT layout (a flat array of u16 or u32, memory-mapped); `bytes` reads
  a file's bytes (vocabulary 256). `:vocab V` checks each microbatch read
  (and `validate()` the whole range) for tokens >= V.
  """

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    path = _check_path(spec, args)
    self.seq, self.batch_size = args["seq"], args["batch"]
    self.stride = args["stride"] or self.seq
    self.vocab = args["vocab"] or None
    split, shuffle, stream = _common(args, ctx.shuffle_default)
    self.dtype = np.dtype(self._dtype(spec, args))
    self.uri = path
    self.file = remote.resolve(spec, path, ctx.cache_dir)
    size = os.path.getsize(self.file)
    if size % self.dtype.itemsize:
      raise load_error("E-LOAD-003", spec, path,
                       f"{size} bytes is not a multiple of {self.dtype.itemsize}"
                       f" ({self.dtype.name})",
                       "check :dtype (u16 for vocabularies up to 65536, else u32) and the file")
    total = size // self.dtype.itemsize
    self.lo, self.hi = math.floor(split[0] * total), math.floor(split[1] * total)
    span = self.hi - self.lo
    self.records = (span - self.seq) // self.stride + 1 if span >= self.seq else 0
    if self.records < self.batch_size:
      raise load_error("E-LOAD-002", spec, path,
                       f"{self.records} records (windows of {self.seq} tokens in {span} tokens"
                       f" of the split) is fewer than one microbatch of {self.batch_size}",
                       "use a larger file or split, or a smaller :seq or :batch")
    self.tokens = np.memmap(self.file, dtype=self.dtype, mode="r")
    self.order = RecordOrder(self.records, shuffle, ctx.seed, stream)
    self.fields = {"tokens": ((self.batch_size, self.seq), np.dtype(np.int32))}

  @staticmethod
  def _dtype(spec: LoaderSpec, args: dict[str, Any]):
    if "dtype" not in args:
      return np.uint8
    if args["dtype"] not in _TOKEN_DTYPES:
      raise form_error(spec, f"`:dtype` is {args['dtype']!r}, expected u16 or u32",
                       "write :dtype u16 (nanoGPT's layout) or :dtype u32")
    return _TOKEN_DTYPES[args["dtype"]]

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of windows, a pure function of (args, seed, i).

    Raises:
      SxError: E-LOAD-003 when a token is >= `:vocab`.
    """
    starts = self.lo + self.order.indices(i * self.batch_size, self.batch_size) * self.stride
    out = self.tokens[starts[:, None] + np.arange(self.seq)].astype(np.int32)
    if self.vocab is not None and out.size and int(out.max()) >= self.vocab:
      self._vocab_error(int(out.max()))
    return {"tokens": out}

  def validate(self, chunk: int = 1 << 24) -> None:
    """Reads the whole split and checks every token against `:vocab`.

    Raises:
      SxError: E-LOAD-003 when a token is >= `:vocab`.
    """
    if self.vocab is None:
      return
    for start in range(self.lo, self.hi, chunk):
      top = int(self.tokens[start:min(start + chunk, self.hi)].max())
      if top >= self.vocab:
        self._vocab_error(top)

  def _vocab_error(self, top: int):
    raise load_error("E-LOAD-003", self.spec, self.uri,
                     f"token {top} is not below the vocabulary size {self.vocab}",
                     "raise :vocab to the tokenizer's vocabulary size, or check :dtype")

  def describe(self) -> dict[str, Any]:
    """Kind, field types, records in the split, and the file (no credentials)."""
    return {**super().describe(), "file": remote.redact(self.uri)}


class TokensLoader(WindowLoader):
  """`(tokens "train.bin" :dtype u16|u32 :seq N :batch B [:vocab V] [:stride K])`."""

  kind = "tokens"


class BytesLoader(WindowLoader):
  """`(bytes "corpus.txt" :seq N :batch B [:stride K])`: a file's bytes as tokens."""

  kind = "bytes"


class ArraysLoader(base.Loader):
  """`(arrays "data.npz" :fields [x y] :batch B)`: rows of named arrays.

  A record is one row of every named array (their leading axes must agree);
  int64 becomes int32 and float64 float32. Shapes are read from the `.npz`
  headers; the arrays are loaded on the first batch. `:split` takes the row
  range [a·R, b·R).
  """

  kind = "arrays"

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.uri = _check_path(spec, args)
    names = args["fields"]
    self.batch_size = args["batch"]
    split, shuffle, stream = _common(args, ctx.shuffle_default)
    self.file = remote.resolve(spec, self.uri, ctx.cache_dir)
    headers = self._headers(list(names))
    rows = {shape[0] if shape else 0 for shape, _ in headers.values()}
    if len(rows) != 1:
      raise load_error("E-LOAD-002", spec, self.uri,
                       "the fields have different numbers of rows: "
                       + ", ".join(f"{n} {s[0] if s else 0}" for n, (s, _) in headers.items()),
                       "give every field the same leading axis")
    total = rows.pop()
    self.lo, self.hi = math.floor(split[0] * total), math.floor(split[1] * total)
    self.records = self.hi - self.lo
    if self.records < self.batch_size:
      raise load_error("E-LOAD-002", spec, self.uri,
                       f"{self.records} records (rows of the split) is fewer than one"
                       f" microbatch of {self.batch_size}",
                       "use more rows or a wider split, or a smaller :batch")
    for n, (_, d) in headers.items():
      if d not in _NPZ_DTYPES:
        raise load_error("E-LOAD-001", spec, self.uri, f"array `{n}` holds {d.name} values, "
                         "which no tensor holds", "store bool, integer or float arrays "
                         "(they become bool, i32, u32, f16 or f32)")
    self.fields = {n: ((self.batch_size,) + s[1:], _NPZ_DTYPES[d])
                   for n, (s, d) in headers.items()}
    self.order = RecordOrder(self.records, shuffle, ctx.seed, stream)
    self._arrays: dict[str, np.ndarray] | None = None

  def _headers(self, names: list[str]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each field's shape and dtype, from the `.npy` headers inside the archive."""
    try:
      with zipfile.ZipFile(self.file) as z:
        members = {m[:-4]: m for m in z.namelist() if m.endswith(".npy")}
        out = {}
        for name in names:
          if name not in members:
            hint = did_you_mean(name, members)
            raise load_error("E-LOAD-001", self.spec, self.uri, f"no array `{name}` in the file",
                             (hint + " " if hint else "") + "arrays in the file: "
                             + " ".join(sorted(members)))
          with z.open(members[name]) as f:
            out[name] = _npy_header(f)
        return out
    except (zipfile.BadZipFile, ValueError) as e:
      raise load_error("E-LOAD-001", self.spec, self.uri, f"not a readable .npz archive ({e})",
                       "write the file with numpy.savez") from None

  def _load(self) -> dict[str, np.ndarray]:
    if self._arrays is None:
      with np.load(self.file) as z:
        self._arrays = {n: np.asarray(z[n][self.lo:self.hi]).astype(d)
                        for n, (_, d) in self.fields.items()}
    return self._arrays

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of rows, a pure function of (args, seed, i)."""
    rows = self.order.indices(i * self.batch_size, self.batch_size)
    return {n: a[rows] for n, a in self._load().items()}

  def describe(self) -> dict[str, Any]:
    """Kind, field types, records in the split, and the file (no credentials)."""
    return {**super().describe(), "file": remote.redact(self.uri)}


def _npy_header(f) -> tuple[tuple[int, ...], np.dtype]:
  """The shape and dtype of an open `.npy` stream, read from its header only."""
  version = np.lib.format.read_magic(f)
  read = {(1, 0): np.lib.format.read_array_header_1_0,
          (2, 0): np.lib.format.read_array_header_2_0}.get(version)
  if read is None:
    raise ValueError(f".npy format version {version} is not supported")
  shape, _, dtype = read(f)
  return tuple(shape), np.dtype(dtype)


# The file kinds, declared beside their builders; :split, :shuffle and :stream are every
# file kind's.
_COMMON = (key("split"), key("shuffle"), key("stream"))
_WINDOW = (key("path"), key("seq", required=True), key("batch", required=True),
           key("stride", default=0, lo=0), key("vocab", default=0, lo=0))
TOKENS = LoaderDef("tokens", "windows of a flat token file, nanoGPT's .bin layout (:tokens)",
                   _WINDOW + (key("dtype", default="u16", choices=tuple(_TOKEN_DTYPES)),)
                   + _COMMON, TokensLoader)
BYTES = LoaderDef("bytes", "windows of a file's bytes (:tokens)", _WINDOW + _COMMON, BytesLoader)
ARRAYS = LoaderDef("arrays", "rows of the named arrays of an .npz (one field per array)",
                   (key("path"), key("fields", required=True), key("batch", required=True))
                   + _COMMON, ArraysLoader)

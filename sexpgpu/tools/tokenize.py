"""`sexpgpu tokenize`: text files (local or s3://, gs://) into a resumable token cache."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

from sexpgpu.data import textcache
from sexpgpu.data.remote import is_remote
from sexpgpu.data.spec import redact
from sexpgpu.errors import SxError

EXTENSIONS = (".txt", ".jsonl", ".parquet")
# Sources are tokenized in groups (up to this many bytes, or one file a core), so
# encode_batch has documents from several files to spread over its threads while
# shards still land one group at a time.
GROUP_BYTES = 8 << 20
GROUP_FILES = max(2, os.cpu_count() or 2)


@dataclasses.dataclass(frozen=True)
class Options:
  """What `sexpgpu tokenize` was asked to do.

  Attributes:
    sources: files, globs, folders or s3:// / gs:// prefixes, as written.
    output: the cache folder.
    train_bpe: the vocabulary of a byte-level BPE to train, or None.
    tokenizer: a tokenizer.json to use instead, or None.
    field: the document field of .jsonl lines and .parquet columns.
    eos: the end-of-document token.
    workers: tokenizer threads, or None for all cores.
  """

  sources: tuple[str, ...]
  output: str
  train_bpe: int | None = None
  tokenizer: str | None = None
  field: str = "text"
  eos: str = "<|endoftext|>"
  workers: int | None = None


@dataclasses.dataclass(frozen=True)
class Source:
  """One source file: where it is (local path or URI) and its stamp."""

  uri: str
  size: int
  mtime: str

  @property
  def kind(self) -> str:
    return os.path.splitext(self.uri)[1].lower()


@dataclasses.dataclass
class Summary:
  """What a run did: sources tokenized and skipped, documents, tokens, bytes, seconds."""

  sources: int = 0
  skipped: int = 0
  documents: int = 0
  tokens: int = 0
  bytes: int = 0
  seconds: float = 0.0

  def line(self, output: str) -> str:
    """The one summary line printed when standard error is no terminal."""
    mb = self.bytes / 1e6
    return (f"tokenize: {output}: {self.sources} sources ({self.skipped} already in the cache), "
            f"{self.documents} documents, {self.tokens} tokens, {mb:.2f} MB in "
            f"{self.seconds:.2f} s ({mb / max(self.seconds, 1e-9):.1f} MB/s)")


def tok_error(source: str, message: str, fix: str, line: int | None = None) -> SxError:
  """E-TOK-001: a source that cannot be read, naming it (and the line)."""
  where = redact(source) + (f":{line}" if line is not None else "")
  return SxError("E-TOK-001", f"{where}: {message}", where=where, fix=fix)


# --- sources ----------------------------------------------------------------------------------

def _fs(uri: str):
  import fsspec  # pylint: disable=import-outside-toplevel
  options: dict[str, Any] = {"skip_instance_cache": True}
  if uri.lower().startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
    options["client_kwargs"] = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
  try:
    return fsspec.core.url_to_fs(uri, **options)
  except (ImportError, ValueError) as e:
    raise tok_error(uri, f"cannot open this store ({e})",
                    "install s3fs or gcsfs, and write s3://bucket/prefix") from None


def expand(patterns: tuple[str, ...]) -> list[Source]:
  """The source files named by files, globs, folders and remote prefixes, each once, in order.

  Raises:
    SxError: E-TOK-001 when a pattern names nothing, or names a file of another kind.
  """
  out: dict[str, Source] = {}
  for pattern in patterns:
    found = _expand_remote(pattern) if is_remote(pattern) else _expand_local(pattern)
    if not found:
      raise tok_error(pattern, "no source files here (an empty glob, folder or prefix)",
                      f"give .txt, .jsonl or .parquet files; {pattern} matched none")
    for s in found:
      if s.kind not in EXTENSIONS:
        raise tok_error(s.uri, f"a {s.kind or 'extensionless'} file is no text source",
                        "give .txt (a document a file), .jsonl (a document a line) or .parquet")
      out.setdefault(s.uri, s)
  return list(out.values())


def _expand_local(pattern: str) -> list[Source]:
  if os.path.isdir(pattern):
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(pattern) for f in fs
                   if f.lower().endswith(EXTENSIONS))
  elif glob.has_magic(pattern):
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  elif os.path.isfile(pattern):
    paths = [pattern]
  else:
    raise tok_error(pattern, "no such file", "check the path")
  out = []
  for p in paths:
    st = os.stat(p)
    out.append(Source(p, st.st_size, str(st.st_mtime_ns)))
  return out


def _expand_remote(pattern: str) -> list[Source]:
  fs, path = _fs(pattern)
  scheme = pattern.split("://", 1)[0]
  try:
    if glob.has_magic(path):
      infos = fs.glob(path, detail=True)
    elif fs.isdir(path):
      infos = fs.find(path, detail=True)
    else:
      infos = {path: fs.info(path)}
  except FileNotFoundError:
    raise tok_error(pattern, "no such object or prefix", "check the bucket and key") from None
  except PermissionError:
    raise tok_error(pattern, "access refused", "check the credentials") from None
  out = []
  for p in sorted(infos):
    info = infos[p]
    if info.get("type") == "directory" or (not p.lower().endswith(EXTENSIONS)
                                            and fs.isdir(path)):
      continue
    stamp = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
    out.append(Source(f"{scheme}://{p}", int(info.get("size") or 0), str(stamp).strip('"')))
  return out


def read_bytes(source: Source) -> bytes:
  """A source file's bytes.

  Raises:
    SxError: E-TOK-001 when it cannot be read.
  """
  try:
    if is_remote(source.uri):
      fs, path = _fs(source.uri)
      return fs.cat_file(path)
    with open(source.uri, "rb") as f:
      return f.read()
  except (OSError, ValueError) as e:
    raise tok_error(source.uri, f"cannot read it ({type(e).__name__}: {e})",
                    "check that the file exists and is readable") from None


def documents(source: Source, data: bytes, field: str) -> list[str]:
  """The documents of one source: a .txt file is one, a .jsonl line one, a .parquet row one.

  Raises:
    SxError: E-TOK-001 for an empty or binary file, a .jsonl line that is not
      JSON or lacks the field, a .parquet file without the column.
  """
  if not data:
    raise tok_error(source.uri, "the file is empty: no documents",
                    "remove it from the sources, or give it text")
  if source.kind == ".parquet":
    return _parquet_documents(source, data, field)
  text = _text(source, data)
  if source.kind == ".txt":
    return [text]
  docs = []
  for n, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError as e:
      raise tok_error(source.uri, f"line {n} is not JSON ({e.msg})",
                      "write one JSON object a line", line=n) from None
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
      found = "no field" if not isinstance(record, dict) or field not in record else (
          f"a {type(value).__name__}")
      raise tok_error(source.uri, f"line {n} has {found} `{field}`, expected a string",
                      "pass --field with the name of the text field", line=n)
    docs.append(value)
  if not docs:
    raise tok_error(source.uri, "no documents (every line is blank)", "give it JSON lines")
  return docs


def _text(source: Source, data: bytes) -> str:
  bad = data.find(b"\x00")
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    bad = e.start if bad < 0 else min(bad, e.start)
  if bad >= 0:
    raise tok_error(source.uri, f"not UTF-8 text (a binary file?): byte {bad} is "
                    f"0x{data[bad]:02x}", "give text files, or convert this one to UTF-8")
  return text


def _parquet_documents(source: Source, data: bytes, field: str) -> list[str]:
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  try:
    schema = pq.read_schema(io.BytesIO(data))
    if field not in schema.names:
      raise tok_error(source.uri, f"no column `{field}`; columns: {' '.join(schema.names)}",
                      "pass --field with the text column")
    column = pq.read_table(io.BytesIO(data), columns=[field]).column(field)
  except (pa.ArrowException, OSError) as e:
    raise tok_error(source.uri, f"not a readable parquet file ({e})",
                    "write it with pyarrow or pandas") from None
  if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
    raise tok_error(source.uri, f"column `{field}` holds {column.type}, expected strings",
                    "pass --field with the text column")
  if column.null_count:
    raise tok_error(source.uri, f"column `{field}` has {column.null_count} null rows",
                    "drop or fill the null rows")
  docs = column.to_pylist()
  if not docs:
    raise tok_error(source.uri, "no rows: no documents", "remove it from the sources")
  return docs


# --- tokenizer --------------------------------------------------------------------------------

def load_tokenizer(path: str):
  """A tokenizer from its tokenizer.json, and the file's bytes.

  Raises:
    SxError: E-TOK-002 when the path is no file (a name such as `gpt2`) or not a tokenizer.
  """
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(path):
    raise SxError("E-TOK-002", f"--tokenizer {path}: no such file; tokenizers are not downloaded",
                  where="--tokenizer",
                  fix="pass the tokenizer.json file (saved by tokenizers or transformers)")
  with open(path, "rb") as f:
    data = f.read()
  try:
    return Tokenizer.from_str(data.decode("utf-8")), data
  except Exception as e:  # pylint: disable=broad-except  # tokenizers raises bare Exception
    raise SxError("E-TOK-002", f"--tokenizer {path}: not a tokenizer.json ({e})",
                  where="--tokenizer",
                  fix="pass the tokenizer.json file (saved by tokenizers or transformers)"
                  ) from None


def train_bpe(texts: Iterator[str], vocab: int, eos: str):
  """A byte-level BPE (GPT-2's kind) of `vocab` tokens, the end-of-document token first."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  return tok


# --- the run ----------------------------------------------------------------------------------

class _Progress:
  """A rich progress bar on a terminal; nothing otherwise (the summary line follows)."""

  def __init__(self, total_bytes: int, files: int, enabled: bool):
    self.bar = None
    if not enabled:
      return
    from rich.console import Console  # pylint: disable=import-outside-toplevel
    from rich.progress import (BarColumn, Progress, TextColumn, TimeRemainingColumn,  # pylint: disable=import-outside-toplevel
                               TransferSpeedColumn)
    self.bar = Progress(TextColumn("tokenize"), BarColumn(),
                        TextColumn("{task.fields[files]}/" + str(files) + " files"),
                        TextColumn("{task.fields[docs]} docs {task.fields[tokens]} tokens"),
                        TransferSpeedColumn(), TimeRemainingColumn(),
                        console=Console(file=sys.stderr, force_terminal=True), transient=True)
    self.task = self.bar.add_task("tokenize", total=total_bytes, files=0, docs=0, tokens=0)
    self.bar.start()

  def update(self, s: Summary, advance: int) -> None:
    if self.bar is not None:
      self.bar.update(self.task, advance=advance, files=s.sources, docs=s.documents,
                      tokens=s.tokens)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.stop()


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _entry(index: int, source: Source, sha: str) -> dict[str, Any]:
  return {"shard": textcache.shard_name(index), "source": redact(source.uri),
          "size": source.size, "mtime": source.mtime, "sha256": sha}


def tokenize(opts: Options, progress: bool | None = None,
             on_shard: Callable[[str], None] | None = None) -> Summary:
  """Builds (or completes) a token cache from text sources.

  Each source becomes one shard, written under a temporary name and renamed,
  then recorded in the manifest (itself replaced whole); a shard the manifest
  already holds for the same source stamp, sha256 and tokenizer is skipped, so
  an interrupted run continues where it stopped.

  Args:
    opts: sources, output, tokenizer choice, field, end-of-document token.
    progress: show a rich bar on standard error (default: when it is a terminal).
    on_shard: called with each shard's stem once it is recorded.

  Returns:
    What was done.

  Raises:
    SxError: E-TOK-001 for a source that cannot be read, E-TOK-002 for a
      tokenizer that is no file, E-FORM-001 for contradictory options.
  """
  t0 = time.perf_counter()
  if (opts.train_bpe is None) == (opts.tokenizer is None):
    raise SxError("E-FORM-001", "sexpgpu tokenize needs one of --train-bpe V and --tokenizer FILE",
                  where="the command line",
                  fix="sexpgpu tokenize data/*.txt -o cache/ --train-bpe 2048")
  if opts.train_bpe is not None and opts.train_bpe < 257:
    raise SxError("E-FORM-001", f"--train-bpe {opts.train_bpe}: a byte-level BPE needs at least "
                  "257 tokens (256 bytes and the end-of-document token)",
                  where="--train-bpe", fix="--train-bpe 2048")
  if opts.workers:
    os.environ["RAYON_NUM_THREADS"] = str(opts.workers)
  if is_remote(opts.output):
    raise SxError("E-FORM-001", f"-o {redact(opts.output)}: the cache is written to a local "
                  "folder", where="-o",
                  fix="tokenize into a folder, then upload it (aws s3 sync cache/ s3://…)")
  sources = expand(opts.sources)
  out = opts.output
  os.makedirs(out, exist_ok=True)
  _remove_temporaries(out)
  old = textcache.read_manifest(out) or {}
  cache: dict[int, bytes] = {}  # source bytes read while training, reused while encoding

  def data_of(i: int) -> bytes:
    return cache.pop(i) if i in cache else read_bytes(sources[i])

  shas = []
  for i, s in enumerate(sources):
    data = read_bytes(s)
    shas.append(_sha256(data))
    if len(cache) < GROUP_FILES and sum(map(len, cache.values())) + len(data) <= GROUP_BYTES:
      cache[i] = data
  tok, tok_bytes, trained = _tokenizer(opts, sources, shas, old, data_of, cache)
  eos_id = tok.token_to_id(opts.eos)
  if eos_id is None:
    raise SxError("E-TOK-002", f"the tokenizer has no token {opts.eos!r}", where="--eos",
                  fix="pass --eos with the tokenizer's end-of-document token")
  vocab = tok.get_vocab_size(with_added_tokens=True)
  dtype = textcache.token_dtype(vocab)
  tok_info = {"file": textcache.TOKENIZER, "sha256": _sha256(tok_bytes), "vocab": vocab,
              "eos": opts.eos, "eos_id": eos_id, "trained": trained}
  manifest = {"format": textcache.FORMAT, "dtype": dtype.name, "field": opts.field,
              "tokenizer": tok_info, "shards": []}
  reuse = old.get("tokenizer") == tok_info and old.get("dtype") == dtype.name and (
      old.get("field") == opts.field)
  kept = {e["shard"]: e for e in old.get("shards", [])} if reuse else {}
  if not reuse or not os.path.isfile(os.path.join(out, textcache.TOKENIZER)):
    textcache.write_atomic(os.path.join(out, textcache.TOKENIZER), tok_bytes)

  summary = Summary()
  bar = _Progress(sum(s.size for s in sources), len(sources),
                  sys.stderr.isatty() if progress is None else progress)
  try:
    todo = []
    for i, s in enumerate(sources):
      entry = _entry(i, s, shas[i])
      prev = kept.get(entry["shard"])
      if prev is not None and {k: prev.get(k) for k in entry} == entry and (
          textcache.shard_problem(out, prev, dtype) is None):
        manifest["shards"].append(prev)
        summary.skipped += 1
        summary.sources += 1
        bar.update(summary, s.size)
      else:
        todo.append((i, entry))
    _write_manifest(out, manifest)
    for group in _groups(todo, sources):
      docs = [(i, entry, documents(sources[i], data_of(i), opts.field)) for i, entry in group]
      flat = [d for _, _, ds in docs for d in ds]
      encoded = tok.encode_batch_fast(flat) if hasattr(tok, "encode_batch_fast") else (
          tok.encode_batch(flat))
      k = 0
      for i, entry, ds in docs:
        ids = [e.ids for e in encoded[k:k + len(ds)]]
        k += len(ds)
        entry.update(_write_shard(out, entry["shard"], ids, eos_id, dtype))
        manifest["shards"].append(entry)
        manifest["shards"].sort(key=lambda e: e["shard"])
        _write_manifest(out, manifest)
        summary.sources += 1
        summary.documents += entry["documents"]
        summary.tokens += entry["tokens"]
        summary.bytes += sources[i].size
        bar.update(summary, sources[i].size)
        if on_shard is not None:
          on_shard(entry["shard"])
  finally:
    bar.close()
  _remove_strays(out, {e["shard"] for e in manifest["shards"]})
  summary.seconds = time.perf_counter() - t0
  return summary


def _tokenizer(opts: Options, sources: list[Source], shas: list[str], old: dict[str, Any],
               data_of: Callable[[int], bytes], cache: dict[int, bytes]):
  """The tokenizer, its tokenizer.json bytes, and how it was trained (None: loaded)."""
  if opts.tokenizer is not None:
    tok, data = load_tokenizer(opts.tokenizer)
    return tok, data, None
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  trained = {"vocab": opts.train_bpe, "sources": _sha256("\n".join(shas).encode())}
  prev = old.get("tokenizer") or {}
  path = os.path.join(opts.output, textcache.TOKENIZER)
  if prev.get("trained") == trained and os.path.isfile(path):
    with open(path, "rb") as f:
      data = f.read()
    if _sha256(data) == prev.get("sha256"):
      return Tokenizer.from_str(data.decode("utf-8")), data, trained

  def texts() -> Iterator[str]:
    for i, s in enumerate(sources):
      data = cache[i] if i in cache else read_bytes(s)
      yield from documents(s, data, opts.field)

  tok = train_bpe(texts(), opts.train_bpe, opts.eos)
  return tok, tok.to_str().encode("utf-8"), trained


def _groups(todo: list, sources: list[Source]) -> Iterator[list]:
  group, size = [], 0
  for item in todo:
    group.append(item)
    size += sources[item[0]].size
    if size >= GROUP_BYTES or len(group) >= GROUP_FILES:
      yield group
      group, size = [], 0
  if group:
    yield group


def _write_shard(out: str, stem: str, ids: list[list[int]], eos_id: int,
                 dtype: np.dtype) -> dict[str, int]:
  """Writes one shard's .bin and .idx whole (temporary names, then renames)."""
  lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
  offsets = np.zeros(len(ids) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  tokens = np.empty(int(offsets[-1]), dtype)
  for start, x in zip(offsets[:-1], ids):
    tokens[start:start + len(x)] = x
  tokens[offsets[1:] - 1] = eos_id
  textcache.write_atomic(os.path.join(out, stem + ".bin"), tokens.tobytes())
  textcache.write_atomic(os.path.join(out, stem + ".idx"), offsets.tobytes())
  return {"documents": len(ids), "tokens": int(offsets[-1])}


def _write_manifest(out: str, manifest: dict[str, Any]) -> None:
  manifest["documents"] = sum(e["documents"] for e in manifest["shards"])
  manifest["tokens"] = sum(e["tokens"] for e in manifest["shards"])
  textcache.write_atomic(os.path.join(out, textcache.MANIFEST), textcache.dumps(manifest).encode())


def _remove_temporaries(out: str) -> None:
  """Temporary files an interrupted run left behind (never counted as shards)."""
  for name in os.listdir(out):
    if name.startswith(".") and ".tmp-" in name:
      os.remove(os.path.join(out, name))


def _remove_strays(out: str, listed: set[str]) -> None:
  """Shard files the manifest does not list (an older source set's), so the folder is the cache."""
  for name in os.listdir(out):
    stem, ext = os.path.splitext(name)
    if stem.startswith("shard-") and ext in (".bin", ".idx") and stem not in listed:
      os.remove(os.path.join(out, name))

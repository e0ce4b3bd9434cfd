"""`sexpgpu tokenize`: text files (local or s3://, gs://) into a resumable token cache."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

from sexpgpu import bounded
from sexpgpu.data import textcache
from sexpgpu.data.remote import default_cache_dir, is_remote
from sexpgpu.data.spec import redact
from sexpgpu.errors import SxError
from sexpgpu.tools.textsources import Source, documents, expand, read_bytes, remote_fs
# Sources are tokenized in groups (up to this many bytes, or one file a core), so
# encode_batch has documents from several files to spread over its threads while
# shards still land one group at a time.
GROUP_BYTES = 8 << 20
GROUP_FILES = max(2, os.cpu_count() or 2)
_TOKENIZER_FILE = "pass the tokenizer.json file (saved by tokenizers or transformers)"
# --train-bpe's range: 256 bytes and the end-of-document token at least; at most 2**20,
# since the tokenizers trainer sets aside memory for the whole vocabulary before it starts
# (2**28 takes 0.6 GB, 10**9 aborts the process) and ids past 2**16 already take uint32.
# The data bounds it too: each merge joins two symbols of the text, so a BPE cannot have
# more tokens than 257 and the sources' bytes.
BPE_MIN, BPE_MAX = 257, 1 << 20
# --workers: threads past a few a core only contend (100,000 of them never start working).
WORKERS_PER_CORE = 4
TOKENIZER_LIMIT = 256 * bounded.MiB  # the largest tokenizer.json read (Gemma's is 33 MB)
MANIFEST_LIMIT = 256 * bounded.MiB  # a cache's manifest.json, a line a source


@dataclasses.dataclass(frozen=True)
class Options:
  """What `sexpgpu tokenize` was asked to do.

  Attributes:
    sources: files, globs, folders or s3:// / gs:// prefixes, as written.
    output: the cache: a folder, or an s3:// / gs:// prefix.
    train_bpe: the vocabulary of a byte-level BPE to train, or None.
    tokenizer: a tokenizer.json to use instead, or None.
    field: the document field of .jsonl lines and .parquet columns.
    eos: the end-of-document token.
    workers: tokenizer threads, or None for all cores.
    as_: "text", "jsonl" or "parquet": how to read every source, or None to go
      by extension (.txt, .md, .rst and files without one are text).
    chars: a character-level tokenizer of the sources' characters instead (ids
      in their sorted order, nanoGPT's shakespeare_char; the end-of-document
      token last).
  """

  sources: tuple[str, ...]
  output: str
  train_bpe: int | None = None
  tokenizer: str | None = None
  field: str = "text"
  eos: str = "<|endoftext|>"
  workers: int | None = None
  as_: str | None = None
  chars: bool = False


@dataclasses.dataclass
class Summary:
  """What a run did: sources tokenized and skipped, documents, tokens, bytes, seconds."""

  sources: int = 0
  skipped: int = 0
  documents: int = 0
  tokens: int = 0
  bytes: int = 0
  seconds: float = 0.0
  taken: dict[str, list[str]] = dataclasses.field(default_factory=dict)

  def line(self, output: str) -> str:
    """The one summary line printed when standard error is no terminal."""
    mb = self.bytes / 1e6
    n = lambda k, what: f"{k} {what}{'' if k == 1 else 's'}"
    return (f"tokenize: {redact(output)}: {n(self.sources, 'source')} ({self.skipped} already in "
            f"the cache), {self.taken_as()}, {n(self.documents, 'document')}, "
            f"{n(self.tokens, 'token')}, {mb:.2f} MB in "
            f"{self.seconds:.2f} s ({mb / max(self.seconds, 1e-9):.1f} MB/s)")

  def taken_as(self) -> str:
    """What each source was read as: `2 as text (README, notes.md), 1 as jsonl (a.jsonl)`."""
    parts = []
    for reader, names in self.taken.items():
      shown = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
      parts.append(f"{len(names)} as {reader} ({shown})")
    return ", ".join(parts) or "none read"


# --- tokenizer --------------------------------------------------------------------------------

def load_tokenizer(path: str):
  """A tokenizer from its tokenizer.json, and the file's bytes.

  Raises:
    SxError: E-TOK-002 when the path is no file (a name such as `gpt2`) or not a tokenizer.
  """
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  if not os.path.lexists(path):
    raise SxError("E-TOK-002", f"--tokenizer {path}: no such file; tokenizers are not downloaded",
                  where="--tokenizer",
                  fix=_TOKENIZER_FILE)
  text = bounded.read_text(path, limit=TOKENIZER_LIMIT, what="--tokenizer", code="E-TOK-002",
                           where="--tokenizer",
                           fix="pass a tokenizer.json file (UTF-8 JSON, saved by tokenizers "
                           f"or transformers) of at most {bounded.size_text(TOKENIZER_LIMIT)}")
  try:
    return Tokenizer.from_str(text), text.encode("utf-8")
  except BaseException as e:  # pylint: disable=broad-except  # bare Exception, or a Rust panic
    if isinstance(e, (KeyboardInterrupt, SystemExit)):
      raise
    raise SxError("E-TOK-002", f"--tokenizer {path}: not a tokenizer.json "
                  f"({type(e).__name__}: {str(e)[:200]})",
                  where="--tokenizer",
                  fix=_TOKENIZER_FILE
                  ) from None


def train_bpe(texts: Iterator[str], vocab: int, eos: str, show_progress: bool = False):
  """A byte-level BPE (GPT-2's kind) of `vocab` tokens, the end-of-document token first
  (`show_progress`: the trainer's own bars on standard error, a terminal's)."""
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos],
                                show_progress=show_progress,
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
    # pylint: disable-next=import-outside-toplevel
    from rich.progress import (BarColumn, Progress, TextColumn, TimeRemainingColumn,
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


class _Store:
  """Where the cache goes: a local folder, or an s3:// / gs:// prefix through a staging folder.

  Every file is written whole into the folder (a temporary name, then a rename).
  For a remote cache it is then uploaded (an object appears whole) and a shard's
  staged copy dropped; the manifest goes last, so it lists only what is there.
  """

  def __init__(self, output: str):
    self.uri, self.fs = output, None
    if is_remote(output):
      self.fs, self.root = remote_fs(output)
      self.root = self.root.rstrip("/")
      digest = hashlib.sha256(redact(output).encode()).hexdigest()[:32]
      self.folder = os.path.join(default_cache_dir(), "tokenize", digest)
    else:
      self.folder = output
      if os.path.lexists(output) and not os.path.isdir(output):
        raise SxError("E-TOK-001", f"-o {output}: a file or device is there, not a folder "
                      "for the cache", where="-o",
                      fix="give -o a new folder, or one that holds a cache to complete")
    self.created = not os.path.isdir(self.folder)
    try:
      os.makedirs(self.folder, exist_ok=True)
      for name in os.listdir(self.folder):  # what an interrupted run left half-written
        if name.startswith(".") and ".tmp-" in name:
          os.remove(os.path.join(self.folder, name))
      probe = os.path.join(self.folder, f".probe.tmp-{os.getpid()}")  # writable, or say so now
      os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
      os.remove(probe)
    except OSError as e:
      self.discard()
      raise self._local_error(e) from None

  def _local_error(self, e: OSError) -> SxError:
    return SxError("E-TOK-001", f"-o {self.folder}: the cache cannot be written there "
                   f"({e.strerror or type(e).__name__})", where="-o",
                   fix="give -o a folder you can write, on a disk with room for the tokens")

  def discard(self) -> None:
    """Removes the cache folder if this run made it and wrote nothing of a cache in it yet
    (a failure before the tokenizer was saved); a trained tokenizer or shards stay, and the
    next run completes the cache from them."""
    if self.created and os.path.isdir(self.folder):
      if not [n for n in os.listdir(self.folder) if not n.startswith(".")]:
        shutil.rmtree(self.folder, ignore_errors=True)

  def read(self, name: str) -> bytes | None:
    """A file of the cache (fetched when remote), or None when it has none or it is no
    regular file of at most MANIFEST_LIMIT (a FIFO left there is never opened for reading)."""
    path = os.path.join(self.folder, name)
    if self.fs is not None:
      if not self._call(self.fs.exists, f"{self.root}/{name}"):
        return None
      self._call(self.fs.get_file, f"{self.root}/{name}", path)
    try:
      return bounded.read_bytes(path, limit=MANIFEST_LIMIT, what="cache file", code="E-TOK-001")
    except SxError:
      return None

  def manifest(self) -> dict[str, Any]:
    """The cache's manifest, or {} when it has none yet (or one that is no manifest: it is
    replaced)."""
    data = self.read(textcache.MANIFEST)
    try:
      manifest = json.loads(data.decode("utf-8")) if data is not None else {}
    except (ValueError, RecursionError):
      return {}
    ok = (isinstance(manifest, dict) and manifest.get("format") == textcache.FORMAT
          and isinstance(manifest.get("shards", []), list)
          and all(isinstance(e, dict) and isinstance(e.get("shard"), str)
                  and isinstance(e.get("tokens"), int) and isinstance(e.get("documents"), int)
                  for e in manifest.get("shards", [])))
    return manifest if ok else {}

  def whole(self, entry: dict[str, Any], dtype: np.dtype) -> bool:
    """Whether a listed shard's files are there with the sizes the manifest says."""
    if self.fs is None:
      return textcache.shard_problem(self.folder, entry, dtype) is None
    for ext, want in textcache.shard_sizes(entry, dtype).items():
      try:
        if int(self._call(self.fs.info, f"{self.root}/{entry['shard']}{ext}")["size"]) != want:
          return False
      except FileNotFoundError:
        return False
    return True

  def write(self, name: str, data: bytes) -> None:
    """Writes one file of the cache whole."""
    path = os.path.join(self.folder, name)
    try:
      textcache.write_atomic(path, data)
    except OSError as e:
      raise self._local_error(e) from None
    if self.fs is not None:
      self._call(self.fs.put_file, path, f"{self.root}/{name}")
      if name.startswith("shard-"):
        os.remove(path)

  def prune(self, listed: set[str]) -> None:
    """Removes shard files the manifest does not list (an older source set's)."""
    if self.fs is None:
      names = os.listdir(self.folder)
    else:
      names = [p.rsplit("/", 1)[-1] for p in self._call(self.fs.glob, f"{self.root}/shard-*")]
    for name in names:
      stem, ext = os.path.splitext(name)
      if stem.startswith("shard-") and ext in (".bin", ".idx") and stem not in listed:
        if self.fs is None:
          os.remove(os.path.join(self.folder, name))
        else:
          self._call(self.fs.rm, f"{self.root}/{name}")

  def _call(self, method, *args):
    try:
      return method(*args)
    except FileNotFoundError:
      raise
    except (OSError, PermissionError) as e:
      raise SxError("E-TOK-001", f"{redact(self.uri)}: the cache cannot be read or written "
                    f"there ({type(e).__name__})", where="-o",
                    fix="check the bucket, the credentials and AWS_ENDPOINT_URL") from None


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _check_options(opts: Options) -> None:
  given = [f for f, on in (("--train-bpe", opts.train_bpe is not None),
                           ("--tokenizer", opts.tokenizer is not None), ("--chars", opts.chars))
           if on]
  if len(given) != 1:
    raise SxError("E-FORM-001", "sexpgpu tokenize needs one of --train-bpe V, --tokenizer FILE "
                  "and --chars" + (f", given {' and '.join(given)}" if given else ""),
                  where="the command line",
                  fix="sexpgpu tokenize data/*.txt -o cache/ --train-bpe 2048 (or --chars: "
                  "one token a character)")
  if opts.train_bpe is not None and opts.train_bpe < BPE_MIN:
    raise SxError("E-FORM-001", f"--train-bpe {opts.train_bpe}: a byte-level BPE needs at least "
                  "257 tokens (256 bytes and the end-of-document token)",
                  where="--train-bpe", fix="--train-bpe 2048")
  if opts.train_bpe is not None and opts.train_bpe > BPE_MAX:
    raise SxError("E-FORM-001", f"--train-bpe {opts.train_bpe}: more tokens than the "
                  f"{BPE_MAX} a BPE is trained to here", where="--train-bpe",
                  fix=f"give --train-bpe from {BPE_MIN} to {BPE_MAX} (GPT-2 has 50257, "
                  "Llama 3 128256)")
  most = WORKERS_PER_CORE * (os.cpu_count() or 1)
  if opts.workers is not None and not 1 <= opts.workers <= most:
    raise SxError("E-FORM-001", f"--workers {opts.workers}: this machine has "
                  f"{os.cpu_count()} cores", where="--workers",
                  fix=f"give --workers from 1 to {most} ({WORKERS_PER_CORE} a core), or leave it "
                  "out for one a core")


def _check_vocab_fits_data(opts: Options, sources: list[Source]) -> None:
  """E-FORM-001 when --train-bpe asks more tokens than the sources' bytes can make."""
  most = BPE_MIN + sum(s.size for s in sources)
  if opts.train_bpe is not None and opts.train_bpe > most:
    raise SxError("E-FORM-001", f"--train-bpe {opts.train_bpe}: the sources hold "
                  f"{most - BPE_MIN} bytes, enough for at most {most} tokens", where="--train-bpe",
                  fix=f"give --train-bpe from {BPE_MIN} to {min(most, BPE_MAX)}, or more text")


class _Reader:
  """Each source's bytes and sha256, read once up front; the first group's bytes are kept."""

  def __init__(self, sources: list[Source]):
    self.sources, self.kept, self.shas = sources, {}, []
    size = 0
    for i, s in enumerate(sources):
      data = read_bytes(s)
      self.shas.append(_sha256(data))
      if len(self.kept) < GROUP_FILES and size + len(data) <= GROUP_BYTES:
        self.kept[i] = data
        size += len(data)

  def data(self, i: int, keep: bool = False) -> bytes:
    """Source i's bytes (read again unless kept; `keep` leaves a kept copy for a later use)."""
    if i in self.kept:
      return self.kept[i] if keep else self.kept.pop(i)
    return read_bytes(self.sources[i])


def tokenize(opts: Options, progress: bool | None = None,
             on_shard: Callable[[str], None] | None = None) -> Summary:
  """Builds (or completes) a token cache from text sources.

  Each source becomes one shard, written whole (see `_Store`) and then
  recorded in the manifest (itself replaced whole); a shard the manifest
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
  _check_options(opts)
  if opts.workers:
    os.environ["RAYON_NUM_THREADS"] = str(opts.workers)
  sources = expand(opts.sources, opts.as_)
  store = _Store(opts.output)  # everything above is checked before anything is written
  try:
    return _tokenize(opts, sources, store, t0, progress, on_shard)
  except BaseException:
    store.discard()
    raise


def _tokenize(opts: Options, sources: list[Source], store: _Store, t0: float,
              progress: bool | None, on_shard: Callable[[str], None] | None) -> Summary:
  old = store.manifest()
  reader = _Reader(sources)
  shown = sys.stderr.isatty() if progress is None else progress
  tok, manifest = _start(opts, sources, reader, old, store, shown)
  dtype = np.dtype(manifest["dtype"])
  kept = {e["shard"]: e for e in old.get("shards", [])} if _same_cache(old, manifest) else {}
  summary = Summary()
  for s in sources:
    summary.taken.setdefault(s.reader, []).append(os.path.basename(s.uri.rstrip("/")))
  bar = _Progress(sum(s.size for s in sources), len(sources), shown)
  try:
    todo = []
    for i, s in enumerate(sources):
      entry = _entry(i, s, reader.shas[i])
      prev = kept.get(entry["shard"])
      if prev is not None and {k: prev.get(k) for k in entry} == entry and store.whole(prev, dtype):
        manifest["shards"].append(prev)
        summary.skipped += 1
        summary.sources += 1
        bar.update(summary, s.size)
      else:
        todo.append((i, entry))
    _write_manifest(store, manifest)
    for group in _groups(todo, sources):
      for i, entry in _encode(group, sources, reader, tok, opts, manifest, store):
        summary.sources += 1
        summary.documents += entry["documents"]
        summary.tokens += entry["tokens"]
        summary.bytes += sources[i].size
        bar.update(summary, sources[i].size)
        if on_shard is not None:
          on_shard(entry["shard"])
  finally:
    bar.close()
  store.prune({e["shard"] for e in manifest["shards"]})
  summary.seconds = time.perf_counter() - t0
  return summary


def _entry(index: int, source: Source, sha: str) -> dict[str, Any]:
  return {"shard": textcache.shard_name(index), "source": redact(source.uri),
          "size": source.size, "mtime": source.mtime, "sha256": sha, "as": source.reader}


def _start(opts: Options, sources: list[Source], reader: _Reader, old: dict[str, Any],
           store: _Store, progress: bool = False):
  """The tokenizer (trained, loaded or reused) and the new manifest, holding no shard yet."""
  tok, tok_bytes, trained = _tokenizer(opts, sources, reader, old, store, progress)
  eos_id = tok.token_to_id(opts.eos)
  if eos_id is None:
    raise SxError("E-TOK-002", f"the tokenizer has no token {opts.eos!r}", where="--eos",
                  fix="pass --eos with the tokenizer's end-of-document token")
  vocab = tok.get_vocab_size(with_added_tokens=True)
  info = {"file": textcache.TOKENIZER, "sha256": _sha256(tok_bytes), "vocab": vocab,
          "eos": opts.eos, "eos_id": eos_id, "trained": trained}
  manifest = {"format": textcache.FORMAT, "dtype": textcache.token_dtype(vocab).name,
              "field": opts.field, "tokenizer": info, "shards": []}
  if not _same_cache(old, manifest) or store.read(textcache.TOKENIZER) != tok_bytes:
    store.write(textcache.TOKENIZER, tok_bytes)
  return tok, manifest


def _same_cache(old: dict[str, Any], new: dict[str, Any]) -> bool:
  """Whether an old manifest's shards were made as the new ones will be."""
  return all(old.get(k) == new[k] for k in ("tokenizer", "dtype", "field"))


def _tokenizer(opts: Options, sources: list[Source], reader: _Reader, old: dict[str, Any],
               store: _Store, progress: bool = False):
  """The tokenizer, its tokenizer.json bytes, and how it was trained (None: loaded)."""
  if opts.tokenizer is not None:
    tok, data = load_tokenizer(opts.tokenizer)
    return tok, data, None
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  trained = {"vocab": opts.train_bpe, "sources": _sha256("\n".join(reader.shas).encode())}
  if opts.chars:
    trained = {"chars": True, "sources": trained["sources"]}
  prev = old.get("tokenizer") or {}
  if prev.get("trained") == trained:
    data = store.read(textcache.TOKENIZER)
    if data is not None and _sha256(data) == prev.get("sha256"):
      return Tokenizer.from_str(data.decode("utf-8")), data, trained

  def texts() -> Iterator[str]:
    for i, s in enumerate(sources):
      yield from documents(s, reader.data(i, keep=True), opts.field)

  if opts.chars:  # the sorted characters of every document: nanoGPT's shakespeare_char ids
    tok = textcache.char_tokenizer(textcache.char_vocabulary(texts()), opts.eos)
    return tok, tok.to_str().encode("utf-8"), trained
  tok = train_bpe(texts(), opts.train_bpe, opts.eos, show_progress=progress)
  _check_vocab_fits_data(opts, sources)  # after the sources' own errors; the trainer stops
  # at what the text gives, and a vocabulary within BPE_MAX never strains it
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


def _encode(group: list, sources: list[Source], reader: _Reader, tok, opts: Options,
            manifest: dict[str, Any], store: _Store) -> Iterator[tuple[int, dict[str, Any]]]:
  """Encodes a group of sources in one encode_batch; writes and records each one's shard."""
  docs = [(i, entry, documents(sources[i], reader.data(i), opts.field)) for i, entry in group]
  flat = [d for _, _, ds in docs for d in ds]
  encoded = tok.encode_batch_fast(flat) if hasattr(tok, "encode_batch_fast") else (
      tok.encode_batch(flat))
  eos_id = manifest["tokenizer"]["eos_id"]
  k = 0
  for i, entry, ds in docs:
    tokens, offsets = _shard(encoded[k:k + len(ds)], eos_id, np.dtype(manifest["dtype"]))
    k += len(ds)
    store.write(entry["shard"] + ".bin", tokens.tobytes())
    store.write(entry["shard"] + ".idx", offsets.tobytes())
    entry.update(documents=len(ds), tokens=int(offsets[-1]))
    manifest["shards"].append(entry)
    manifest["shards"].sort(key=lambda e: e["shard"])
    _write_manifest(store, manifest)
    yield i, entry


def _shard(encodings, eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
  """One shard's tokens (each document followed by the end-of-document id) and offsets."""
  ids = [e.ids for e in encodings]
  lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
  offsets = np.zeros(len(ids) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  tokens = np.empty(int(offsets[-1]), dtype)
  for start, x in zip(offsets[:-1], ids):
    tokens[start:start + len(x)] = x
  tokens[offsets[1:] - 1] = eos_id
  return tokens, offsets


def _write_manifest(store: _Store, manifest: dict[str, Any]) -> None:
  manifest["documents"] = sum(e["documents"] for e in manifest["shards"])
  manifest["tokens"] = sum(e["tokens"] for e in manifest["shards"])
  store.write(textcache.MANIFEST, textcache.dumps(manifest).encode())

"""Text sources for `sexpgpu tokenize`: files, globs, folders, s3:// prefixes, their documents."""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import re

import numpy as np

from sexpgpu import bounded
from sexpgpu.data.remote import is_remote
from sexpgpu.data.spec import redact
from sexpgpu.errors import SxError
from sexpgpu.paths import remote_filesystem

# How a file is read, by its extension: "text" is one document a file, "jsonl" one a line,
# "parquet" one a row. A file without an extension (README, COPYING) is text.
READERS = {".txt": "text", ".md": "text", ".rst": "text", "": "text", ".jsonl": "jsonl",
           ".parquet": "parquet"}
AS = ("text", "jsonl", "parquet")
EXTENSIONS = tuple(e for e in READERS if e)
# The most bytes read from one source: it is held whole in memory and encoded in one batch.
SOURCE_LIMIT = bounded.GiB
# The longest run of one character class (letters, digits, other signs, whitespace) that a
# document may hold: the byte-level pre-tokenizer makes each run one word, and BPE training
# and encoding grow faster than linearly in a word's length (1 MiB of letters: 1.3 s to
# encode, 500 s to train 1000 merges; 4 MiB: 10 s to encode). Natural text stays far below.
WORD_LIMIT = 32 * bounded.KiB
# The longest document (a text file, a .jsonl line, a .parquet row), in characters: one
# document is encoded whole by one thread, its encoding holding some 200 bytes a token (an
# 8 MiB line of words: 111 s and 1.4 GB where 100 lines of it take 71 s and 0.95 GB; 33 MB:
# 318 s and 6.4 GB, on a loaded 2-core machine).
DOC_LIMIT = 16 * bounded.MiB


@dataclasses.dataclass(frozen=True)
class Source:
  """One source file: where it is (local path or URI), its stamp, and how it is read."""

  uri: str
  size: int
  mtime: str
  reader: str = ""

  @property
  def kind(self) -> str:
    """The file's extension, lower case ("" for none)."""
    return os.path.splitext(os.path.basename(self.uri))[1].lower()


def tok_error(source: str, message: str, fix: str, line: int | None = None) -> SxError:
  """E-TOK-001: a source that cannot be read, naming it (and the line)."""
  where = redact(source) + (f":{line}" if line is not None else "")
  return SxError("E-TOK-001", f"{where}: {message}", where=where, fix=fix)


def remote_fs(uri: str):
  """The fsspec filesystem and path of an s3:// or gs:// URI (paths.remote_filesystem's)."""
  try:
    return remote_filesystem(uri)
  except (ImportError, ValueError) as e:
    raise tok_error(uri, f"cannot open this store ({e})",
                    "install s3fs or gcsfs, and write s3://bucket/prefix") from None


def expand(patterns: tuple[str, ...], as_: str | None = None) -> list[Source]:
  """The source files named by files, globs, folders and remote prefixes, each once, in order.

  Args:
    patterns: files, globs, folders or s3:// / gs:// prefixes.
    as_: "text", "jsonl" or "parquet" to read every file so whatever its name
      (a folder then gives all its files), or None to go by extension: .txt,
      .md, .rst and files without one are text.

  Returns:
    The sources, each with the reader it is read by.

  Raises:
    SxError: E-TOK-001 when a pattern names nothing, or names a file of another kind.
  """
  out: dict[str, Source] = {}
  for pattern in patterns:
    found = (_expand_remote(pattern, as_) if is_remote(pattern)
             else _expand_local(pattern, as_))
    if not found:
      raise tok_error(pattern, "no source files here (an empty glob, folder or prefix)",
                      f"give .txt, .md, .jsonl or .parquet files; {pattern} matched none")
    for s in found:
      reader = as_ or READERS.get(s.kind)
      if reader is None:
        raise tok_error(s.uri, f"a {s.kind} file is no text source known by its name",
                        "pass --as text (a document a file), --as jsonl (a document a line) "
                        "or --as parquet to say how to read it")
      out.setdefault(s.uri, dataclasses.replace(s, reader=reader))
  return list(out.values())


def _walked(name: str, as_: str | None) -> bool:
  """Whether a folder's file is a source: any visible one with --as, else a known extension."""
  if as_ is not None:
    return not name.startswith(".")
  return name.lower().endswith(EXTENSIONS)


def _expand_local(pattern: str, as_: str | None) -> list[Source]:
  if os.path.isdir(pattern):
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(pattern) for f in fs
                   if _walked(f, as_))
  elif glob.has_magic(pattern):
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  elif os.path.isfile(pattern):
    paths = [pattern]
  elif os.path.exists(pattern):
    raise tok_error(pattern, "not a regular file (a FIFO, a device or a socket)",
                    "give text files; a pipe or a device is never read as a source")
  else:
    raise tok_error(pattern, "no such file", "check the path")
  out = []
  for p in paths:
    st = os.stat(p)
    out.append(Source(p, st.st_size, str(st.st_mtime_ns)))
  return out


def _expand_remote(pattern: str, as_: str | None) -> list[Source]:
  fs, path = remote_fs(pattern)
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
    if info.get("type") == "directory" or (not _walked(p.rsplit("/", 1)[-1], as_)
                                            and fs.isdir(path)):
      continue
    stamp = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
    out.append(Source(f"{scheme}://{p}", int(info.get("size") or 0), str(stamp).strip('"')))
  return out


def read_bytes(source: Source) -> bytes:
  """A source file's bytes, at most SOURCE_LIMIT of them.

  Raises:
    SxError: E-TOK-001 when it cannot be read, is no regular file or is larger than
      SOURCE_LIMIT.
  """
  if not is_remote(source.uri):
    return bounded.read_bytes(source.uri, limit=SOURCE_LIMIT, what="source", code="E-TOK-001",
                              where=redact(source.uri),
                              fix=f"give regular text files of at most "
                              f"{bounded.size_text(SOURCE_LIMIT)}; split a larger one")
  if source.size > SOURCE_LIMIT:
    raise tok_error(source.uri, f"{source.size} bytes, more than the "
                    f"{bounded.size_text(SOURCE_LIMIT)} read from one source",
                    "split the object into smaller ones under the prefix")
  try:
    fs, path = remote_fs(source.uri)
    return fs.cat_file(path)
  except (OSError, ValueError) as e:
    raise tok_error(source.uri, f"cannot read it ({type(e).__name__}: {e})",
                    "check that the file exists and is readable") from None


def documents(source: Source, data: bytes, field: str) -> list[str]:
  """The documents of one source: a text file is one, a .jsonl line one, a .parquet row one.

  Raises:
    SxError: E-TOK-001 for an empty or binary file, a .jsonl line that is not
      JSON or lacks the field, a .parquet file without the column.
  """
  if not data:
    raise tok_error(source.uri, "the file is empty: no documents",
                    "remove it from the sources, or give it text")
  reader = source.reader or READERS.get(source.kind, "text")
  if reader == "parquet":
    return _parquet_documents(source, data, field)
  text = _text(source, data)
  if reader == "text":
    _check_words(source, text, None)
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
    except RecursionError:
      raise tok_error(source.uri, f"line {n} nests deeper than Python's JSON reader goes",
                      "write one flat JSON object a line, the text in its --field",
                      line=n) from None
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
      found = "no field" if not isinstance(record, dict) or field not in record else (
          _JSON_TYPES.get(type(value), "a value"))
      raise tok_error(source.uri, f"line {n} has {found} `{field}`, expected a string",
                      "pass --field with the name of the text field", line=n)
    _check_words(source, value, n)
    docs.append(value)
  if not docs:
    raise tok_error(source.uri, "no documents (every line is blank)", "give it JSON lines")
  return docs


# A JSON value's type as a message names it ("line 3 has a number `text`").
_JSON_TYPES = {int: "a number", float: "a number", bool: "a boolean", list: "a list",
               dict: "an object", type(None): "null"}


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
  for row, doc in enumerate(docs, 1):
    _check_words(source, doc, None, row)
  return docs


def _runs(limit: int) -> re.Pattern:
  """A run of more than `limit` letters, digits, other signs or whitespace, each matched
  only from its start (the lookbehinds), so the search stays linear in the text."""
  n = limit + 1
  return re.compile(rf"(?<![^\W\d_])[^\W\d_]{{{n}}}|(?<!\d)\d{{{n}}}"
                    rf"|(?<![^\w\s])(?<!_)(?:[^\w\s]|_){{{n}}}|(?<!\s)\s{{{n}}}")


_RUNS: dict[int, re.Pattern] = {}
_ASCII_SPACE = np.zeros(256, bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 32]] = True


def _may_hold_a_long_word(text: str, limit: int) -> bool:
  """Whether `text`'s UTF-8 bytes hold a run of more than `limit` bytes between ASCII spaces,
  or of ASCII spaces: true of every text holding a word longer than `limit` characters, and
  found at numpy's speed (the regex reads 20 MB/s), so that only such texts are searched."""
  data = np.frombuffer(text.encode("utf-8"), np.uint8)
  space = _ASCII_SPACE[data]
  edges = np.flatnonzero(space[1:] != space[:-1]) + 1
  runs = np.diff(np.concatenate(([0], edges, [len(data)])))
  return bool(runs.size) and int(runs.max()) > limit


def _check_words(source: Source, text: str, line: int | None, row: int | None = None) -> None:
  """E-TOK-001 when a document is longer than DOC_LIMIT characters or holds a word (one run
  of a character class) longer than WORD_LIMIT."""
  at = f"row {row}: " if row is not None else ""
  if len(text) > DOC_LIMIT:
    raise tok_error(source.uri, f"{at}a document of {len(text)} characters, more than the "
                    f"{DOC_LIMIT} one document may hold (it is encoded whole, in one thread)",
                    "split it into documents: several files, or a .jsonl with one a line",
                    line=line)
  if len(text) <= WORD_LIMIT or not _may_hold_a_long_word(text, WORD_LIMIT):
    return
  pattern = _RUNS.setdefault(WORD_LIMIT, _runs(WORD_LIMIT))
  m = pattern.search(text)
  if m is None:
    return
  raise tok_error(source.uri, f"{at}a word (a run without a break between letters, digits, "
                  f"signs and spaces) longer than {WORD_LIMIT} characters at character "
                  f"{m.start()}: the tokenizer's time grows faster than its length",
                  f"break the text into words or lines of at most {WORD_LIMIT} characters, "
                  "or leave this source out", line=line)

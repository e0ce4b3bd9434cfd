"""Text sources for `sexpgpu tokenize`: files, globs, folders, s3:// prefixes, their documents."""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os

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
  """A source file's bytes.

  Raises:
    SxError: E-TOK-001 when it cannot be read.
  """
  try:
    if is_remote(source.uri):
      fs, path = remote_fs(source.uri)
      return fs.cat_file(path)
    with open(source.uri, "rb") as f:
      return f.read()
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
          _JSON_TYPES.get(type(value), "a value"))
      raise tok_error(source.uri, f"line {n} has {found} `{field}`, expected a string",
                      "pass --field with the name of the text field", line=n)
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
  return docs

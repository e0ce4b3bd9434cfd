"""`sexpgpu check FILE --print batch [--loader NAME]`: one microbatch of a loader, as read."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from sexpgpu.errors import SxError, did_you_mean

ROWS = 2  # the rows of each field printed
VALUES = 32  # the values of a row printed before "…"
TEXT = 200  # the characters of a row's decoded text printed before "…"
# The fields of token ids that a tokenizer decodes (pairs' two sequences as well as tokens).
TEXT_FIELDS = ("tokens", "chosen", "rejected")


def batch_text(c, loader: str | None = None) -> str:
  """The text of `check --print batch`: microbatch 0 of `loader` (default the run's
  training loader), each field's type and its first rows, and the token fields (`tokens`,
  pairs' `chosen` and `rejected`) decoded as text where a tokenizer is known (a text loader's, a chat template's, a `bytes` file's
  UTF-8).

  Args:
    c: the compiled experiment (run.compile.Compiled).
    loader: a defloader's name, or None for the run's `:data`.

  Returns:
    The lines, ending in a newline.

  Raises:
    SxError: E-NAME-001 when no loader has that name.
  """
  name = loader if loader is not None else c.exp.data
  if name not in c.loaders:
    raise SxError("E-NAME-001", f"--loader {name}: the experiment has no loader `{name}`",
                  where=f"--loader {name}",
                  fix=" ".join(filter(None, [did_you_mean(name, c.loaders),
                                             "loaders: " + " ".join(c.loaders)])))
  ld = c.loaders[name]
  batch = ld.batch(0)
  size = "endless" if ld.records is None else f"of {ld.records}"
  lines = [f"batch: loader {name} ({ld.kind}) microbatch 0: {ld.batch_size} records ({size})"]
  decode, how = decoder_of(ld)
  for field, (_, dtype) in ld.fields.items():
    a = np.asarray(batch[field])
    lines.append(f"  :{field} {np.dtype(dtype).name}[{','.join(map(str, a.shape))}]")
    for r in range(min(ROWS, a.shape[0])):
      lines.append(f"    {r}: {_values(a[r])}")
      if decode is not None and field in TEXT_FIELDS and a.ndim == 2:
        lines.append(f"       text ({how}): {_clip(decode(a[r]))!r}")
  if ld.batch_size > ROWS:
    more = ld.batch_size - ROWS
    lines.append(f"  ({more} more row{'s' if more != 1 else ''} in each field)")
  return "\n".join(lines) + "\n"


def _values(row: np.ndarray) -> str:
  flat = row.reshape(-1)
  if flat.dtype == np.bool_:
    words = [str(int(v)) for v in flat[:VALUES]]
  elif np.issubdtype(flat.dtype, np.floating):
    words = [f"{float(v):.4g}" for v in flat[:VALUES]]
  else:
    words = [str(int(v)) for v in flat[:VALUES]]
  more = flat.size - VALUES
  shape = f"[{','.join(map(str, row.shape))}] " if row.ndim > 1 else ""
  return shape + " ".join(words) + (f" … ({more} more)" if more > 0 else "")


def _clip(text: str) -> str:
  return text if len(text) <= TEXT else text[:TEXT] + "…"


def decoder_of(ld) -> tuple[Any, str]:
  """(a function of a row of token ids to text, how it decodes) for a loader, or (None, "")
  when no tokenizer is known: a text loader's cache's tokenizer.json (or the one it made of a
  text file's characters), a chat loader's template's tokenizer, a `bytes` file as UTF-8, a
  mix's first component that has one."""
  made = getattr(ld, "tokenizer_json", None)
  folder = getattr(ld, "folder", None)
  tok = None
  if isinstance(made, str):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(made)
  elif isinstance(folder, str) and os.path.isfile(os.path.join(folder, "tokenizer.json")):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
  else:
    template_tok = getattr(getattr(ld, "template", None), "tokenizer", None)
    if hasattr(template_tok, "decode"):
      tok = template_tok
  if tok is not None:
    return (lambda row: tok.decode([int(i) for i in row], skip_special_tokens=False),
            "tokenizer")
  if ld.kind == "bytes":
    return (lambda row: bytes(int(i) & 0xFF for i in row).decode("utf-8", "replace"),
            "UTF-8")
  for sub in getattr(ld, "subs", ()):
    found = decoder_of(sub)
    if found[0] is not None:
      return found
  return None, ""

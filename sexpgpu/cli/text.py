"""`sexpgpu tokenize SOURCE... -o CACHE`: flags and output; the work is in tools.tokenize."""

from __future__ import annotations

import sys

from absl import flags

from sexpgpu.cli.main import parse_flags
from sexpgpu.errors import SxError


def _tokenize_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  flags.DEFINE_string("output", None, "the cache to write: a folder or s3:// / gs:// prefix",
                      short_name="o", flag_values=fv)
  flags.DEFINE_integer("train_bpe", None, "train a byte-level BPE of this many tokens",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_string("tokenizer", None, "a tokenizer.json to use instead (nothing is downloaded)",
                      flag_values=fv)
  flags.DEFINE_bool("chars", False, "a character-level tokenizer instead: one token a "
                    "character of the sources, ids in sorted order (nanoGPT's shakespeare_char)",
                    flag_values=fv)
  flags.DEFINE_string("field", "text", "the text field of .jsonl lines and .parquet columns",
                      flag_values=fv)
  flags.DEFINE_string("eos", "<|endoftext|>", "the end-of-document token", flag_values=fv)
  flags.DEFINE_enum("as", None, ["text", "jsonl", "parquet"],
                    "read every source as this (default: by extension; .txt, .md, .rst and "
                    "files without one are text)", flag_values=fv)
  flags.DEFINE_integer("workers", None, "tokenizer threads (default: all cores)", lower_bound=1,
                       flag_values=fv)
  return fv


def cmd_tokenize(argv: list[str]) -> int:
  """`sexpgpu tokenize SOURCE... -o CACHE [--train-bpe V | --tokenizer FILE | --chars]`."""
  from sexpgpu.tools.tokenize import Options, tokenize
  fv = _tokenize_flags()
  rest = parse_flags(fv, argv, "tokenize")
  if not rest or not fv.output:
    raise SxError("E-FORM-001", "sexpgpu tokenize takes source files and -o CACHE",
                  where="the command line",
                  fix="sexpgpu tokenize configs/data/*.txt -o cache/ --train-bpe 2048")
  opts = Options(sources=tuple(rest), output=fv.output, train_bpe=fv.train_bpe,
                 tokenizer=fv.tokenizer, field=fv.field, eos=fv.eos, workers=fv.workers,
                 as_=fv["as"].value, chars=fv.chars)
  summary = tokenize(opts)
  sys.stderr.write(summary.line(fv.output) + "\n")
  return 0


COMMANDS = {"tokenize": cmd_tokenize}

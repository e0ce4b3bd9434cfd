"""A newcomer's second day, as docs/guide.md ("Train on your text") tells it, from a fresh
folder: one book tokenized by characters, split 90/10 by tokens, a character model trained
on it, a batch looked at, and a text prompt continued and echoed. No step may fail."""

import os
import shutil
import subprocess

import pytest

from conftest import ROOT, sexpgpu_cmd

CONFIG = os.path.join(ROOT, "configs", "shakespeare-char.sx")


def _ok(tmp, *argv):
  r = subprocess.run(sexpgpu_cmd(*argv), cwd=tmp, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, (argv, r.stderr)
  assert "Traceback" not in r.stderr
  return r


@pytest.mark.slow  # the guide's whole path as a newcomer runs it: five commands in subprocesses
def test_one_book_by_characters_from_a_fresh_folder(tmp_path):
  book = tmp_path / "book.txt"
  shutil.copy(os.path.join(ROOT, "tests", "data", "corpus.txt"), book)
  _ok(tmp_path, "tokenize", "book.txt", "-o", "chars", "--chars")
  assert (tmp_path / "chars" / "tokenizer.json").is_file()
  sel = ["--variant", "smoke", "--set", f"text={tmp_path / 'chars'}"]

  # one batch of each split, decoded as the book's text: a single document split by tokens
  train = _ok(tmp_path, "check", CONFIG, *sel, "--print", "batch").stdout
  valid = _ok(tmp_path, "check", CONFIG, *sel, "--print", "batch", "--loader", "valid").stdout
  assert "tokens" in train and "tokens" in valid and train != valid
  words = set(book.read_text().split())
  assert any(w in train for w in words) and any(w in valid for w in words)

  r = _ok(tmp_path, "run", CONFIG, *sel, "--steps", "6", "--checkpoint-dir", "ck")
  assert r.stderr.splitlines()[-4].startswith("done: 6 steps, train/loss ")

  prompt = "the model"
  out = _ok(tmp_path, "sample", CONFIG, *sel, "--resume", "latest", "--checkpoint-dir", "ck",
            "--prompt", prompt, "--tokens", "8").stdout
  assert out.startswith(prompt) and len(out.rstrip("\n")) > len(prompt)

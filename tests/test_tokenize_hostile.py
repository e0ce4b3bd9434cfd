"""`sexpgpu tokenize` with hostile flags and files (issue 37, finding 10): --train-bpe and
--workers bounded before anything is written, -o that is no folder, sources and tokenizers
that are FIFOs, /dev/zero, deep JSON or one endless word, and no partial cache left behind."""

import importlib.util
import os
import shutil
import subprocess
import threading

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.cli.main import main
from sexpgpu.tools import textsources, tokenize as tk

CORPUS = os.path.join(ROOT, "tests", "data", "corpus.txt")


@pytest.fixture
def text(tmp_path):
  path = tmp_path / "good.txt"
  with open(CORPUS, encoding="utf-8") as f:
    path.write_text(f.read()[:6000], encoding="utf-8")
  return str(path)


def _refused(argv, capsys, code, *needles):
  assert main(argv) == 1
  err = capsys.readouterr().err
  assert err.startswith(f"error[{code}]") and "Traceback" not in err, err
  for needle in needles:
    assert needle in err, err
  return err


def _in_time(call, seconds=60):
  """call() in a thread, which must end within `seconds` (a FIFO's open must not wait)."""
  done = []
  t = threading.Thread(target=lambda: done.append(call()), daemon=True)
  t.start()
  t.join(seconds)
  assert done, f"still running after {seconds} s"
  return done[0]


def test_train_bpe_of_a_billion_is_refused_before_the_trainer_aborts(text, tmp_path):
  cache = tmp_path / "c"
  r = subprocess.run(sexpgpu_cmd("tokenize", text, "-o", str(cache), "--train-bpe",
                                 "1000000000"), cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 1, (r.returncode, r.stderr[-500:])
  assert r.stderr.startswith("error[E-FORM-001]: --train-bpe 1000000000")
  assert "from 257 to 1048576" in r.stderr and not cache.exists()


def test_train_bpe_past_what_the_text_can_give_is_refused_and_leaves_nothing(text, tmp_path,
                                                                            capsys):
  cache = tmp_path / "c"
  _refused(["tokenize", text, "-o", str(cache), "--train-bpe", "100000"], capsys, "E-FORM-001",
           "the sources hold 6", "give --train-bpe from 257 to 6")
  assert not cache.exists()  # the folder this run made is removed with its failure


@pytest.mark.parametrize("value", ["100000", "0", str(10 ** 12)])
def test_workers_are_bounded_by_the_cores(text, tmp_path, capsys, value):
  cache = tmp_path / "c"
  err = _refused(["tokenize", text, "-o", str(cache), "--train-bpe", "300", "--workers", value],
                 capsys, "E-FORM-001")
  assert "--workers" in err and not cache.exists()
  if value == "100000":
    assert f"from 1 to {tk.WORKERS_PER_CORE * os.cpu_count()}" in err


def test_an_output_that_is_no_folder_is_e_tok_001(text, tmp_path, capsys):
  a_file = tmp_path / "a-file"
  a_file.write_bytes(b"keep me")
  for out, needle in ((str(a_file), "a file or device is there"),
                      ("/dev/null", "a file or device is there"),
                      ("/proc/sexpgpu-test/cache", "cannot be written there")):
    err = _refused(["tokenize", text, "-o", out, "--train-bpe", "300"], capsys, "E-TOK-001",
                   needle, "--> -o")
    assert "= fix: give -o" in err
  assert a_file.read_bytes() == b"keep me"


def test_a_long_word_is_refused_with_its_bound_and_words_pass(tmp_path, capsys, monkeypatch):
  """The bound lowered to 64: a line of 65 letters without a break is refused (a 30 MB line
  of one word takes the tokenizer minutes), the same letters split by spaces pass."""
  monkeypatch.setattr(textsources, "WORD_LIMIT", 64)
  word = tmp_path / "word.txt"
  word.write_text("intro " + "ab" * 40 + " outro\n")
  _refused(["tokenize", str(word), "-o", str(tmp_path / "c"), "--train-bpe", "300"], capsys,
           "E-TOK-001", "longer than 64 characters at character 6",
           "break the text into words or lines of at most 64 characters")
  assert not (tmp_path / "c").exists()
  line = tmp_path / "line.jsonl"
  line.write_text('{"text": "fine"}\n{"text": "' + "7" * 65 + '"}\n')
  _refused(["tokenize", str(line), "-o", str(tmp_path / "c"), "--train-bpe", "300"], capsys,
           "E-TOK-001", f"--> {line}:2")
  words = tmp_path / "words.txt"
  words.write_text(" ".join(["ab" * 20] * 400) + " 日本語、日本語。" * 20)
  assert main(["tokenize", str(words), "-o", str(tmp_path / "ok"), "--train-bpe", "300"]) == 0


def test_a_document_past_its_bound_is_refused(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(textsources, "DOC_LIMIT", 1000)
  doc = tmp_path / "doc.txt"
  doc.write_text("a few words " * 100)
  _refused(["tokenize", str(doc), "-o", str(tmp_path / "c"), "--train-bpe", "300"], capsys,
           "E-TOK-001", "a document of 1200 characters, more than the 1000",
           "split it into documents")


def test_the_word_search_is_the_pre_tokenizers_classes():
  runs = textsources._runs(4)
  hits = [t for t in ("abcde", "12345", "!!!!!", "     ", "日本語日本語", "ab12345x")
          if runs.search(t)]
  misses = [t for t in ("abcd efgh", "a_!_!b", "a    b", "abcd1234!!!!    ", "日本。日本。")
            if runs.search(t)]
  assert (len(hits), misses) == (6, [])
  assert not textsources._may_hold_a_long_word("abcd efgh\tijkl", 4)
  assert textsources._may_hold_a_long_word("abcd efghi", 4)


def test_fifos_and_devices_as_sources_tokenizers_and_manifests_do_not_hang(text, tmp_path,
                                                                           capsys):
  folder = tmp_path / "src"
  folder.mkdir()
  shutil.copy(text, folder / "a.txt")
  os.mkfifo(folder / "b.txt")  # os.walk lists it; reading it would wait for a writer
  assert _in_time(lambda: main(["tokenize", str(folder), "-o", str(tmp_path / "c"),
                                "--train-bpe", "300"])) == 1
  assert "FIFO" in capsys.readouterr().err
  os.mkfifo(tmp_path / "pipe.txt")
  _refused(["tokenize", str(tmp_path / "pipe.txt"), "-o", str(tmp_path / "c"), "--train-bpe",
            "300"], capsys, "E-TOK-001", "not a regular file")
  tok = tmp_path / "tokenizer.json"
  os.mkfifo(tok)
  assert _in_time(lambda: main(["tokenize", text, "-o", str(tmp_path / "c"), "--tokenizer",
                                str(tok)])) == 1
  assert "E-TOK-002" in capsys.readouterr().err
  os.remove(tok)
  tok.write_bytes(b"[" * 100_000 + b"]" * 100_000)
  _refused(["tokenize", text, "-o", str(tmp_path / "c"), "--tokenizer", str(tok)], capsys,
           "E-TOK-002", "not a tokenizer.json")
  cache = tmp_path / "cache"
  cache.mkdir()
  os.mkfifo(cache / "manifest.json")  # a cache to complete, whose manifest is a FIFO
  assert _in_time(lambda: main(["tokenize", text, "-o", str(cache), "--train-bpe", "300"])) == 0
  assert os.path.isfile(cache / "manifest.json")  # replaced by a manifest


def test_a_deeply_nested_jsonl_line_is_e_tok_001(tmp_path, capsys):
  deep = tmp_path / "deep.jsonl"
  deep.write_text('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
  _refused(["tokenize", str(deep), "-o", str(tmp_path / "c"), "--train-bpe", "300"], capsys,
           "E-TOK-001", "line 2 nests deeper", f"--> {deep}:2")


def test_a_failure_keeps_a_cache_it_did_not_make_and_one_that_can_be_completed(text, tmp_path,
                                                                              capsys):
  cache = tmp_path / "c"
  assert main(["tokenize", text, "-o", str(cache), "--train-bpe", "300"]) == 0
  before = sorted(os.listdir(cache))
  binary = tmp_path / "b.txt"
  binary.write_bytes(b"\x00\x01binary")
  capsys.readouterr()
  _refused(["tokenize", text, str(binary), "-o", str(cache), "--train-bpe", "300"], capsys,
           "E-TOK-001", "not UTF-8")
  assert sorted(os.listdir(cache)) == before  # the earlier cache is whole
  assert main(["tokenize", text, "-o", str(cache), "--train-bpe", "300"]) == 0
  assert "1 already in the cache" in capsys.readouterr().err


def test_a_slice_of_the_tokenize_fuzzer_finds_nothing(tmp_path):
  spec = importlib.util.spec_from_file_location(
      "fuzz_text_models", os.path.join(ROOT, "benchmarks", "fuzz_text_models.py"))
  fz = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(fz)
  paths = fz.prepare(str(tmp_path))
  findings, refused = [], 0
  for i in range(30):
    case = str(tmp_path / f"case-{i}")
    os.makedirs(case)
    argv = fz._tokenize_case(fz.fuzz_base.case_rng(10, i), case, paths)
    refused += bool(argv.bad)
    found = fz.fuzz_base.feed(case, list(argv), {}, [argv.bad] if argv.bad else [])
    if found:
      findings.append(f"{i} {argv}: {found}")
    shutil.rmtree(case, ignore_errors=True)
  assert findings == [] and refused >= 15

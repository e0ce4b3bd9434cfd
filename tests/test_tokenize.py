"""`sexpgpu tokenize`: the cache, resumable after SIGKILL, and each bad source a coded error."""

import glob
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.data import textcache
from sexpgpu.errors import SxError
from sexpgpu.tools.tokenize import Options, tokenize

SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "data", "*.txt")))


def _shipped_paragraphs():
  out = []
  for path in SHIPPED:
    with open(path, encoding="utf-8") as f:
      out += [p for p in f.read().split("\n\n") if p.strip()]
  return out


def _sources(folder, n, size):
  """n .txt files of about `size` bytes, each a different shuffle of the shipped paragraphs."""
  paras = _shipped_paragraphs()
  folder.mkdir()
  for i in range(n):
    rng = np.random.default_rng(i)
    parts, total = [], 0
    while total < size:
      p = paras[rng.integers(len(paras))]
      parts.append(p)
      total += len(p) + 2
    (folder / f"part-{i:02d}.txt").write_text("\n\n".join(parts), encoding="utf-8")
  return sorted(str(p) for p in folder.iterdir())


def _files(cache):
  return {name: open(os.path.join(cache, name), "rb").read() for name in sorted(os.listdir(cache))}


def _tokenize_cmd(sources, cache, *extra):
  return sexpgpu_cmd("tokenize", *sources, "-o", str(cache), *extra)


def test_shipped_text_cache_layout(tmp_path):
  s = tokenize(Options(tuple(SHIPPED), str(tmp_path / "c"), train_bpe=400), progress=False)
  m = textcache.read_manifest(str(tmp_path / "c"))
  assert [e["shard"] for e in m["shards"]] == [f"shard-{i:05d}" for i in range(len(SHIPPED))]
  assert [e["source"] for e in m["shards"]] == SHIPPED
  assert m["tokenizer"]["eos_id"] == 0 and m["dtype"] == "uint16"
  assert m["documents"] == len(SHIPPED) == s.documents and m["tokens"] == s.tokens
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(str(tmp_path / "c" / "tokenizer.json"))
  for e, path in zip(m["shards"], SHIPPED):
    ids = np.fromfile(tmp_path / "c" / f"{e['shard']}.bin", np.uint16)
    idx = np.fromfile(tmp_path / "c" / f"{e['shard']}.idx", np.int64)
    text = open(path, encoding="utf-8").read()
    assert idx.tolist() == [0, len(ids)] and ids[-1] == 0
    assert ids[:-1].tolist() == tok.encode(text).ids
    assert tok.decode(ids[:-1].tolist()) == text


@pytest.mark.slow
def test_sigkill_mid_way_then_rerun_equals_one_go(tmp_path):
  sources = _sources(tmp_path / "src", 8, 40_000)
  one_go = tmp_path / "one"
  subprocess.run(_tokenize_cmd(sources, one_go, "--train-bpe", "600"), cwd=ROOT, check=True,
                 capture_output=True, timeout=300)
  cache = tmp_path / "killed"
  p = subprocess.Popen(_tokenize_cmd(sources, cache, "--train-bpe", "600"), cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while p.poll() is None and time.time() < deadline:  # until the manifest holds a first shard
    m = textcache.read_manifest(str(cache)) if (cache / "shard-00000.idx").exists() else None
    if m is not None and m["shards"]:
      break
    time.sleep(0.002)
  p.send_signal(signal.SIGKILL)
  p.wait(timeout=30)
  m = textcache.read_manifest(str(cache))
  assert m is not None and 0 < len(m["shards"]) < len(sources), "not killed mid-way"
  for e in m["shards"]:  # what the manifest lists is whole
    assert textcache.shard_problem(str(cache), e, np.dtype(m["dtype"])) is None
  r = subprocess.run(_tokenize_cmd(sources, cache, "--train-bpe", "600"), cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert f"({len(m['shards'])} already in the cache)" in r.stderr
  assert _files(cache) == _files(one_go)


def test_rerun_skips_and_a_changed_source_is_redone(tmp_path):
  sources = _sources(tmp_path / "src", 3, 2000)
  cache = str(tmp_path / "c")
  tokenize(Options(tuple(sources), cache, train_bpe=300), progress=False)
  before = _files(cache)
  s = tokenize(Options(tuple(sources), cache, train_bpe=300), progress=False)
  assert s.skipped == 3 and _files(cache) == before
  with open(os.path.join(cache, "shard-00002.bin"), "r+b") as f:  # a shard cut short
    f.truncate(10)
  s = tokenize(Options(tuple(sources), cache, train_bpe=300), progress=False)
  assert s.skipped == 2 and _files(cache) == before
  with open(sources[1], "a", encoding="utf-8") as f:
    f.write("\n\nA new paragraph at the end.")
  tok = str(tmp_path / "tok.json")
  with open(tok, "wb") as f:
    f.write(before["tokenizer.json"])
  s = tokenize(Options(tuple(sources), cache, tokenizer=tok), progress=False)
  # Loaded instead of trained: the tokenizer record changes, so every shard is redone.
  assert s.skipped == 0 and s.sources == 3
  s = tokenize(Options(tuple(sources), cache, tokenizer=tok), progress=False)
  assert s.skipped == 3


def test_jsonl_and_parquet_documents(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  docs = [p for p in _shipped_paragraphs()[:6]]
  (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": d, "id": i})
                                              for i, d in enumerate(docs[:4])) + "\n")
  pq.write_table(pa.table({"body": docs[4:]}), tmp_path / "b.parquet")
  cache = str(tmp_path / "c")
  s = tokenize(Options((str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")), cache,
                       train_bpe=300, field="body"), progress=False)
  assert s.documents == 6
  m = textcache.read_manifest(cache)
  assert [e["documents"] for e in m["shards"]] == [4, 2]
  idx = np.fromfile(os.path.join(cache, "shard-00000.idx"), np.int64)
  ids = np.fromfile(os.path.join(cache, "shard-00000.bin"), np.uint16)
  assert len(idx) == 5 and (ids[idx[1:] - 1] == 0).all()


def _bad(tmp_path, name, data):
  path = tmp_path / name
  path.write_bytes(data)
  return str(path)


@pytest.mark.parametrize("name,data,needle", [
    ("empty.txt", b"", "empty"),
    ("binary.txt", b"text then \x00\x01\x02\xff binary", "binary"),
    ("notjson.jsonl", b'{"text": "fine"}\n{"text": oops}\n', ":2: line 2 is not JSON"),
    ("nofield.jsonl", b'{"text": "fine"}\n\n{"body": "x"}\n', ":3: line 3 has no field `text`"),
    ("photo.png", b"\x89PNG", "no text source"),
])
def test_bad_source_is_a_coded_error_naming_it(tmp_path, name, data, needle):
  good = _bad(tmp_path, "a-good.txt", "A good document.".encode())
  bad = _bad(tmp_path, name, data)
  cache = str(tmp_path / "c")
  with pytest.raises(SxError) as e:
    tokenize(Options((good, bad), cache, tokenizer=_tokenizer_file(tmp_path)), progress=False)
  assert e.value.code == "E-TOK-001"
  assert bad in str(e.value) and needle in str(e.value)
  m = textcache.read_manifest(cache)
  for entry in (m or {}).get("shards", []):  # nothing of the bad source counts as whole
    assert entry["source"] != bad
  left = os.listdir(cache) if os.path.isdir(cache) else []
  assert not [n for n in left if n.startswith("shard-00001")]


def _tokenizer_file(tmp_path):
  path = tmp_path / "tokenizer.json"
  if not path.exists():
    tokenize(Options(tuple(SHIPPED[:1]), str(tmp_path / "tokcache"), train_bpe=300),
             progress=False)
    path.write_bytes((tmp_path / "tokcache" / "tokenizer.json").read_bytes())
  return str(path)


def test_cli_errors_have_codes_and_no_traceback(tmp_path):
  bad = _bad(tmp_path, "bad.jsonl", b'{"text": 1}\n')
  cases = [
      (["tokenize", bad, "-o", str(tmp_path / "c"), "--train-bpe", "300"], "E-TOK-001",
       f"{bad}:1"),
      (["tokenize", SHIPPED[0], "-o", str(tmp_path / "c"), "--tokenizer", "gpt2"], "E-TOK-002",
       "pass the tokenizer.json file"),
      (["tokenize", str(tmp_path / "none-*.txt"), "-o", str(tmp_path / "c"), "--train-bpe",
        "300"], "E-TOK-001", "no source files"),
      (["tokenize", "-o", str(tmp_path / "c"), "--train-bpe", "300"], "E-FORM-001", "source"),
  ]
  for argv, code, needle in cases:
    r = subprocess.run(sexpgpu_cmd(*argv), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"error[{code}]"), r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
  assert not os.path.exists(tmp_path / "c" / "shard-00000.bin")


def test_progress_bar_draws_and_a_pipe_gets_one_summary_line(tmp_path):
  import io
  import sys
  from rich.console import Console
  from sexpgpu.tools import tokenize as tk
  stream = io.StringIO()
  old = sys.stderr
  sys.stderr = stream
  try:
    tk.tokenize(Options(tuple(SHIPPED), str(tmp_path / "c"), train_bpe=300), progress=True)
  finally:
    sys.stderr = old
  assert "tokenize" in stream.getvalue() and "files" in stream.getvalue()
  r = subprocess.run(_tokenize_cmd(SHIPPED, tmp_path / "d", "--train-bpe", "300"), cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 0 and len(lines) == 1 and lines[0].startswith("tokenize: ")
  assert f"{len(SHIPPED)} sources" in lines[0] and "MB/s" in lines[0]


def test_parquet_without_the_column_and_bad_tokenizers_are_coded(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"body": ["a document"]}), tmp_path / "a.parquet")
  with pytest.raises(SxError) as e:
    tokenize(Options((str(tmp_path / "a.parquet"),), str(tmp_path / "c"), train_bpe=300),
             progress=False)
  assert e.value.code == "E-TOK-001" and "no column `text`; columns: body" in str(e.value)
  (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
  with pytest.raises(SxError) as e:
    tokenize(Options(tuple(SHIPPED[:1]), str(tmp_path / "c"), tokenizer=str(tmp_path / "bad.json")),
             progress=False)
  assert e.value.code == "E-TOK-002" and "not a tokenizer.json" in str(e.value)
  with pytest.raises(SxError) as e:
    tokenize(Options(tuple(SHIPPED[:1]), str(tmp_path / "c"), tokenizer=_tokenizer_file(tmp_path),
                     eos="</s>"), progress=False)
  assert e.value.code == "E-TOK-002" and "'</s>'" in str(e.value)


def test_files_without_a_known_extension_are_text_or_taken_as_told(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "README").write_text("A readme, one document.\n\nStill the same one.\n")
  (src / "notes.md").write_text("# Notes\n\nMarkdown is text.\n")
  (src / "guide.rst").write_text("Guide\n=====\n\nSo is reStructuredText.\n")
  (src / "lines.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
  (src / "server.log").write_text("a log, text too, but only when told\n")
  tok = _tokenizer_file(tmp_path)
  named = tuple(str(src / n) for n in ("README", "notes.md", "guide.rst", "lines.jsonl"))
  summary = tokenize(Options(named, str(tmp_path / "c"), tokenizer=tok), progress=False)
  assert summary.documents == 3 + 2
  assert summary.taken == {"text": ["README", "notes.md", "guide.rst"], "jsonl": ["lines.jsonl"]}
  assert "3 as text (README, notes.md, guide.rst), 1 as jsonl (lines.jsonl)" in summary.line("c")
  with pytest.raises(SxError) as e:
    tokenize(Options((str(src / "server.log"),), str(tmp_path / "d"), tokenizer=tok),
             progress=False)
  assert e.value.code == "E-TOK-001" and "server.log" in str(e.value) and "--as text" in e.value.fix
  # --as text reads every file as one document, whatever its name: the folder gives all five.
  r = subprocess.run(sexpgpu_cmd("tokenize", str(src), "-o", str(tmp_path / "e"), "--tokenizer",
                                 tok, "--as", "text"),
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "5 as text (README, guide.rst, lines.jsonl, +2 more)" in r.stderr, r.stderr
  assert textcache.read_manifest(str(tmp_path / "e"))["documents"] == 5
  # The reader is part of a source's entry: reading the same file another way redoes it.
  again = tokenize(Options((str(src / "lines.jsonl"),), str(tmp_path / "e"), tokenizer=tok,
                           as_="jsonl"), progress=False)
  assert again.skipped == 0 and again.documents == 2

"""The `text` loader: packing properties, split, exact order, bad caches, resume after SIGTERM."""

import glob
import json
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from stopping import stop_at
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.data import make_loader
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.data.text import first_fit
from sexpgpu.data import textcache
from sexpgpu.errors import SxError
from sexpgpu.tools.tokenize import Options, tokenize

SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "data", "*.txt")))


def write_cache(folder, shards):
  """A cache whose tokens are 1, 2, 3 … in stream order (eos 0): each token names its place.

  Args:
    folder: where.
    shards: per shard, the document lengths.
  """
  os.makedirs(folder, exist_ok=True)
  entries, at = [], 1
  for s, lengths in enumerate(shards):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(at, at + offsets[-1], dtype=np.uint32)
    at += int(offsets[-1])
    stem = textcache.shard_name(s)
    tokens.tofile(os.path.join(folder, stem + ".bin"))
    offsets.tofile(os.path.join(folder, stem + ".idx"))
    entries.append({"shard": stem, "source": f"s{s}.txt", "size": 0, "mtime": "0", "sha256": "",
                    "documents": len(lengths), "tokens": int(offsets[-1])})
  manifest = {"format": textcache.FORMAT, "dtype": "uint32", "field": "text", "shards": entries,
              "tokenizer": {"eos_id": 0, "vocab": 1 << 20, "eos": "<eos>"},
              "documents": sum(e["documents"] for e in entries),
              "tokens": sum(e["tokens"] for e in entries)}
  with open(os.path.join(folder, textcache.MANIFEST), "w") as f:
    f.write(textcache.dumps(manifest))


def loader(folder, run_seed=0, shuffle_default=True, **args):
  spec = LoaderSpec("train", "text", {"path": str(folder), **args})
  return make_loader(spec, seed=run_seed, shuffle_default=shuffle_default)


def _epoch(ld, epoch=0):
  rows = ld.take(epoch * ld.records, ld.records)
  return rows["tokens"], rows["segments"], rows["positions"]


@settings(max_examples=40, deadline=None)
@given(shards=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=8), min_size=1,
                       max_size=3),
       seq=st.integers(1, 24), pack=st.sampled_from(["concat", "docs"]), shuffle=st.booleans(),
       seed=st.integers(0, 3), offsets=st.sampled_from(["fixed", "random"]),
       epoch=st.integers(0, 2))
def test_packing_properties(tmp_path_factory, shards, seq, pack, shuffle, seed, offsets, epoch):
  folder = tmp_path_factory.mktemp("cache")
  write_cache(folder, shards)
  lengths = [n for s in shards for n in s]
  starts = np.concatenate([[1], 1 + np.cumsum(lengths)])  # each document's first token
  total = sum(lengths)
  ld = loader(folder, run_seed=seed, seq=seq, batch=1, pack=pack, shuffle=shuffle,
              offsets=offsets)
  tokens, segments, positions = _epoch(ld, epoch)
  # Every document's tokens appear exactly once in an epoch.
  assert sorted(tokens[segments > 0].tolist()) == list(range(1, total + 1))
  for t, s, p in zip(tokens, segments, positions):
    used = s > 0
    n = int(used.sum())
    assert used[:n].all() and not used[n:].any()  # padding only at the end of a row
    assert (t[n:] == 0).all() and (p[n:] == 0).all()
    assert (np.diff(s[:n]) >= 0).all() and (np.diff(s[:n]) <= 1).all() and (n == 0 or s[0] == 1)
    for k in range(1, int(s.max()) + 1 if n else 1):
      piece = t[s == k]
      assert (np.diff(piece) == 1).all()  # in order, one document's consecutive tokens
      doc = np.searchsorted(starts, piece[0], side="right") - 1
      assert piece[-1] < starts[doc + 1]  # a piece stays inside its document
      assert (p[s == k] == np.arange(len(piece))).all()  # positions count from 0 in the piece
      if pack == "docs" and offsets == "fixed":
        assert (piece[0] - starts[doc]) % seq == 0  # a long document is cut every seq tokens
  if pack == "concat":
    assert ld.records == -(-total // seq)
  else:
    _assert_first_fit(lengths, seq, ld)


def _assert_first_fit(lengths, seq, ld):
  """Each piece lies in the first row that had room for it when it was placed."""
  ptr, piece_start, piece_len = ld._rows  # pylint: disable=protected-access
  row_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
  order = np.argsort(piece_start)
  fill = np.zeros(len(ptr) - 1, np.int64)
  for q in order:
    first = int(np.argmax(seq - fill >= piece_len[q]))
    assert row_of[q] == first
    fill[first] += piece_len[q]
  assert sum(piece_len) == sum(lengths)


def test_first_fit_fills_holes_in_order():
  ptr, starts, lens = first_fit(np.array([6, 7, 3, 2, 10, 1]), 8)
  rows = [list(zip(starts[ptr[r]:ptr[r + 1]], lens[ptr[r]:ptr[r + 1]]))
          for r in range(len(ptr) - 1)]
  assert rows == [[(0, 6), (16, 2)], [(6, 7), (28, 1)], [(13, 3), (26, 2)], [(18, 8)]]


def test_order_is_a_pure_function_of_seed_stream_position(tmp_path):
  write_cache(tmp_path, [[30] * 20])
  a = loader(tmp_path, run_seed=1, seq=16, batch=4)
  b = loader(tmp_path, run_seed=1, seq=16, batch=4)
  for i in (7, 0, 3, 40):
    for k in a.fields:
      np.testing.assert_array_equal(a.batch(i)[k], b.batch(i)[k])
  assert not np.array_equal(a.batch(0)["tokens"], loader(tmp_path, run_seed=2, seq=16, batch=4)
                            .batch(0)["tokens"])
  assert not np.array_equal(a.batch(0)["tokens"], loader(tmp_path, run_seed=1, seq=16, batch=4,
                                                          stream=1).batch(0)["tokens"])
  own = loader(tmp_path, run_seed=1, seq=16, batch=4, seed=5)
  assert not np.array_equal(a.batch(0)["tokens"], own.batch(0)["tokens"])
  a.next(), a.next()
  st_ = a.state()
  b.set_state(st_)
  np.testing.assert_array_equal(a.next()["tokens"], b.next()["tokens"])


def test_split_is_by_documents_and_counts(tmp_path):
  write_cache(tmp_path, [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]])
  train = loader(tmp_path, seq=8, batch=1, split=[0, 0.5], pack="docs", shuffle=False)
  valid = loader(tmp_path, seq=8, batch=1, split=[0.5, 1], pack="docs", shuffle=False)
  assert train.documents == 5 and valid.documents == 5
  assert train.tokens == 5 + 6 + 7 + 8 + 9 and valid.tokens == 10 + 11 + 12 + 13 + 14
  t_train, _, _ = _epoch(train)
  t_valid, _, _ = _epoch(valid)
  assert set(t_train[t_train > 0].tolist()).isdisjoint(t_valid[t_valid > 0].tolist())
  b = train.batch(0)
  assert train.count_tokens(b) == int((b["segments"] > 0).sum()) < b["tokens"].size
  d = train.describe()
  assert d["documents"] == 5 and d["vocab"] == 1 << 20 and 0 < d["padding"] < 1
  assert "5 documents, 35 tokens" in d["summary"]


def test_truncated_shard_is_e_load_003_naming_it(tmp_path):
  write_cache(tmp_path, [[50, 60], [70]])
  path = tmp_path / "shard-00001.bin"
  path.write_bytes(path.read_bytes()[:-10])
  with pytest.raises(SxError) as e:
    loader(tmp_path, seq=8, batch=2)
  assert e.value.code == "E-LOAD-003" and str(path) in str(e.value)
  assert "truncated" in str(e.value)


def test_missing_cache_and_bad_pack_are_coded(tmp_path):
  with pytest.raises(SxError) as e:
    loader(tmp_path / "nope", seq=8, batch=2)
  assert e.value.code == "E-LOAD-001" and "sexpgpu tokenize" in e.value.fix
  (tmp_path / "empty").mkdir()
  with pytest.raises(SxError) as e:
    loader(tmp_path / "empty", seq=8, batch=2)
  assert e.value.code == "E-LOAD-001" and "manifest" in str(e.value)
  write_cache(tmp_path / "c", [[10]])
  with pytest.raises(SxError) as e:
    loader(tmp_path / "c", seq=8, batch=2, pack="rows")
  assert e.value.code == "E-FORM-001" and ":pack" in str(e.value)
  with pytest.raises(SxError) as e:
    loader(tmp_path / "c", seq=8, batch=4)
  assert e.value.code == "E-LOAD-002"
  with pytest.raises(SxError) as e:
    loader(tmp_path / "c", seq=4, batch=2, vocab=1000)
  assert e.value.code == "E-LOAD-003" and "more than :vocab 1000" in str(e.value)
  assert loader(tmp_path / "c", seq=4, batch=2, vocab=1 << 20).vocab == 1 << 20


def _rows(ld, epoch):
  """An epoch's rows as a set of their non-padding token tuples."""
  tokens, segments, _ = _epoch(ld, epoch)
  return {tuple(t[s > 0]) for t, s in zip(tokens, segments)}


@pytest.mark.parametrize("pack", ["docs", "concat"])
@pytest.mark.parametrize("run_seed", [0, 1, 2])
def test_no_fixed_row_repeats_across_epochs(tmp_path, pack, run_seed):
  write_cache(tmp_path, [[130, 257, 141, 170, 199], [133, 150, 201, 177, 160, 143, 188]])
  fixed = loader(tmp_path, run_seed=run_seed, seq=16, batch=2, pack=pack, offsets="fixed")
  assert _rows(fixed, 0) == _rows(fixed, 1) == _rows(fixed, 2)  # what a model memorises
  ld = loader(tmp_path, run_seed=run_seed, seq=16, batch=2, pack=pack)  # random: the default
  assert ld.offsets == "random" and ld.records == fixed.records
  epochs = [_rows(ld, e) for e in range(3)]
  for a in range(3):
    for b in range(a + 1, 3):
      assert len(epochs[a] & epochs[b]) <= len(epochs[b]) // 4, (a, b)
  # A pass (shuffle_default False) cuts at offset 0, the same rows each time.
  assert loader(tmp_path, shuffle_default=False, seq=16, batch=2, pack=pack).offsets == "fixed"


def test_offsets_are_a_pure_function_of_seed_and_position(tmp_path):
  write_cache(tmp_path, [[300, 257, 410]])
  a = loader(tmp_path, run_seed=4, seq=16, batch=4, pack="docs")
  b = loader(tmp_path, run_seed=4, seq=16, batch=4, pack="docs")
  for i in (90, 3, 91, 0, 200):  # across epochs, out of order: no state but the position
    for k in a.fields:
      np.testing.assert_array_equal(a.batch(i)[k], b.batch(i)[k])
  other = loader(tmp_path, run_seed=4, seq=16, batch=4, pack="docs", seed=1)
  assert not np.array_equal(a.batch(0)["tokens"], other.batch(0)["tokens"])
  with pytest.raises(SxError) as e:
    loader(tmp_path, seq=16, batch=4, offsets="shifted")
  assert e.value.code == "E-FORM-001" and ":offsets" in str(e.value) and "random" in e.value.fix


EXP = """;; a text LM over a token cache, for the resume test
(require std/nn)
(require std/lm)
(defloader train (text "cache" :seq 17 :batch 4 :pack docs :split [0 0.8]))
(defloader valid (text "cache" :seq 17 :batch 4 :split [0.8 1]))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (transformer-lm (lm-inputs t) :vocab 400 :width 16 :layers 1 :heads 2) t)))
(defpass eval :data valid :every 4 :batches 1 :metrics [loss])
(defrun :loss loss :data train :steps 12 :microbatches 2 :optimizer (adamw :lr 0.01)
        :seed 3 :checkpoint-every 3 :keep 2)
"""


@pytest.fixture(scope="module")
def text_exp(tmp_path_factory):
  folder = tmp_path_factory.mktemp("textexp")
  paras = []
  for path in SHIPPED:
    paras += [p for p in open(path, encoding="utf-8").read().split("\n\n") if p.strip()]
  (folder / "docs.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in paras) + "\n")
  tokenize(Options((str(folder / "docs.jsonl"),), str(folder / "cache"), train_bpe=400),
           progress=False)
  (folder / "text.sx").write_text(EXP)
  return folder


def _run(folder, tag, *extra):
  return subprocess.Popen(
      sexpgpu_cmd("run", str(folder / "text.sx"), "--checkpoint-dir", str(folder / f"ck-{tag}"),
                  "--metrics", f"jsonl:{folder / f'{tag}.jsonl'}", "--json", *extra),
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


@pytest.mark.slow
def test_sigterm_then_resume_over_text_is_bitwise(text_exp):
  full = _run(text_exp, "full")
  out, err = full.communicate(timeout=600)
  assert full.returncode == 0, err
  full_summary = json.loads(out)
  k = int(np.random.default_rng().integers(2, 9))

  def start(attempt):
    shutil.rmtree(text_exp / "ck-cut", ignore_errors=True)
    (text_exp / "cut.jsonl").unlink(missing_ok=True)
    return _run(text_exp, "cut"), text_exp / "cut.jsonl"
  p, out, err, metrics = stop_at(start, k, signal.SIGTERM)
  assert p.returncode == 143, err
  assert json.loads(out)["steps"] < 12
  r = _run(text_exp, "cut", "--resume", "latest")
  out, err = r.communicate(timeout=600)
  assert r.returncode == 0, err
  resumed = json.loads(out)
  assert resumed["train_loss"] == full_summary["train_loss"]
  assert resumed["eval"] == full_summary["eval"]
  assert resumed["counters"] == full_summary["counters"]
  assert _losses(metrics) == _losses(text_exp / "full.jsonl")
  shutil.rmtree(text_exp / "ck-cut")


def test_check_prints_the_cache(text_exp, capsys, monkeypatch):
  from sexpgpu.cli.main import main
  monkeypatch.chdir(ROOT)
  code = main(["check", str(text_exp / "text.sx")])
  out, err = capsys.readouterr()
  assert code == 0, err
  line = next(x for x in out.splitlines() if x.strip().startswith("train: text"))
  assert ":segments int32[4,17]" in line and "documents" in line and "vocabulary" in line
  assert "padding" in line


@pytest.mark.slow
def test_readme_lines_tokenize_and_train_text_lm(tmp_path):
  shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")
  texts = sorted(glob.glob(str(tmp_path / "configs/data/*.txt")))
  r = subprocess.run(sexpgpu_cmd("tokenize", *texts, "-o", "cache/", "--train-bpe", "2048"),
                     cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  r = subprocess.run(sexpgpu_cmd("run", "configs/text-lm.sx", "--variant", "smoke", "--json"),
                     cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  summary = json.loads(r.stdout)
  assert summary["steps"] == 20 and summary["train_loss"] < 7.0
  # counter tokens counts what the loader's rows hold; padding is at most the row count's tail
  assert 0 < summary["counters"]["tokens"] <= 20 * 8 * 33

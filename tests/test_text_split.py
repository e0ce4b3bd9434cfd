"""The `text` loader's `:split` by tokens within documents (`:split-by`), and a text file read
by characters: the 90/10 split of one book, its edges, its defaults and its errors."""

import os

import numpy as np
import pytest

from sexpgpu.data import make_loader, textcache
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.errors import SxError


def write_cache(folder, lengths):
  """A one-shard cache whose tokens are 1, 2, 3 … in stream order (eos 0; each names its place).

  Args:
    folder: where.
    lengths: the documents' lengths.
  """
  os.makedirs(folder, exist_ok=True)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  np.arange(1, 1 + offsets[-1], dtype=np.uint32).tofile(os.path.join(folder, "shard-00000.bin"))
  offsets.tofile(os.path.join(folder, "shard-00000.idx"))
  entry = {"shard": "shard-00000", "source": "s.txt", "size": 0, "mtime": "0", "sha256": "",
           "documents": len(lengths), "tokens": int(offsets[-1])}
  manifest = {"format": textcache.FORMAT, "dtype": "uint32", "field": "text", "shards": [entry],
              "tokenizer": {"eos_id": 0, "vocab": 1 << 20, "eos": "<eos>"},
              "documents": len(lengths), "tokens": int(offsets[-1])}
  with open(os.path.join(folder, textcache.MANIFEST), "w") as f:
    f.write(textcache.dumps(manifest))
  return str(folder)


def loader(path, shuffle_default=False, **args):
  spec = LoaderSpec("train", "text", {"path": str(path), **args})
  return make_loader(spec, seed=0, shuffle_default=shuffle_default)


def stream(ld):
  """Every non-padding token of an epoch, in row order (fixed offsets, no shuffle)."""
  rows = ld.take(0, ld.records)
  return rows["tokens"][rows["segments"] > 0].tolist()


@pytest.fixture(scope="module")
def book(tmp_path_factory):
  """A cache of one document of 1000 tokens (a book)."""
  return write_cache(tmp_path_factory.mktemp("book"), [1000])


def test_one_book_splits_90_10_by_tokens(book):
  # nanoGPT's prepare.py: train = data[:int(n*0.9)], val = data[int(n*0.9):]
  train = loader(book, seq=9, batch=2, split=[0, 0.9])
  val = loader(book, seq=9, batch=2, split=[0.9, 1])
  assert train.split_by == val.split_by == "tokens"  # the default for a one-document cache
  assert stream(train) == list(range(1, 901)) and stream(val) == list(range(901, 1001))
  assert (train.tokens, val.tokens, train.documents, val.documents) == (900, 100, 1, 1)
  assert "split by tokens" in val.describe()["summary"]


def test_split_by_tokens_cuts_documents_at_the_edges(tmp_path):
  # five documents of 7, 3, 10, 4, 6 tokens (30); tokens 9 … 20 of the stream cut the second
  # and the third, and a segment starts at each document's first token inside the split
  folder = write_cache(tmp_path / "c", [7, 3, 10, 4, 6])
  ld = loader(folder, seq=30, batch=1, split=[0.3, 0.7], **{"split-by": "tokens"})
  row = ld.batch(0)
  n = 12  # floor(0.7·30) − floor(0.3·30)
  assert row["tokens"][0][:n].tolist() == list(range(10, 22))
  # tokens 10 (doc 2's last), 11–20 (doc 3), 21 (doc 4's first): three segments
  assert row["segments"][0][:n].tolist() == [1] + [2] * 10 + [3]
  assert row["positions"][0][:n].tolist() == [0] + list(range(10)) + [0]
  assert ld.documents == 3 and ld.tokens == n
  # :pack docs places the same pieces whole: every token once
  docs = loader(folder, seq=10, batch=1, split=[0.3, 0.7], pack="docs", **{"split-by": "tokens"})
  assert sorted(stream(docs)) == list(range(10, 22))


def test_many_documents_split_by_documents_by_default(tmp_path):
  folder = write_cache(tmp_path / "c", [5, 5, 5, 5])
  ld = loader(folder, seq=5, batch=1, split=[0.5, 1])
  assert ld.split_by == "documents" and stream(ld) == list(range(11, 21))
  by_tokens = loader(folder, seq=5, batch=1, split=[0.55, 1], **{"split-by": "tokens"})
  assert stream(by_tokens) == list(range(12, 21))  # floor(0.55·20) = 11: doc 3 loses a token


def test_split_by_documents_of_one_book_says_why_and_how(book):
  with pytest.raises(SxError) as e:
    loader(book, seq=9, batch=2, split=[0, 0.9], **{"split-by": "documents"})
  err = e.value
  assert err.code == "E-LOAD-002"
  assert "holds no document of the cache's 1" in err.message
  assert "counts whole documents" in err.message  # why
  assert ':split-by "tokens"' in err.fix  # how


def test_a_split_of_no_token(book):
  with pytest.raises(SxError) as e:
    loader(book, seq=9, batch=1, split=[0.5, 0.5005])  # floor(500.5) = 500
  assert e.value.code == "E-LOAD-002" and "holds no token of the cache's 1000" in e.value.message
  assert "widen :split" in e.value.fix


def test_split_by_takes_tokens_or_documents(book):
  with pytest.raises(SxError) as e:
    loader(book, seq=9, batch=1, **{"split-by": "token"})
  assert e.value.code == "E-FORM-001" and "tokens" in e.value.fix


def test_rows_are_a_pure_function_of_the_step(book):
  # resuming rebuilds the loader and asks for microbatch i: the same rows, shuffled or not
  a = loader(book, shuffle_default=True, seq=9, batch=3, split=[0, 0.9])
  b = loader(book, shuffle_default=True, seq=9, batch=3, split=[0, 0.9])
  for i in (0, 7, a.records // 3 + 2):  # the last one in the second epoch
    for k in a.fields:
      assert (a.batch(i)[k] == b.batch(i)[k]).all()
  # every token of the split is read once an epoch
  assert sorted(stream(loader(book, seq=9, batch=3, split=[0, 0.9]))) == list(range(1, 901))


TEXT = "To be, or not to be:\nthat is the question.\n\tÉté — 漢字 😀 end\n"


def test_a_text_file_is_read_by_characters(tmp_path):
  path = tmp_path / "book.txt"
  path.write_text(TEXT, encoding="utf-8")
  ld = loader(path, seq=len(TEXT) + 1, batch=1)
  chars = sorted(set(TEXT))
  assert ld.vocab == len(chars) + 1 and ld.eos == len(chars) and ld.split_by == "tokens"
  row = ld.batch(0)["tokens"][0].tolist()
  assert row == [chars.index(c) for c in TEXT] + [len(chars)]
  from tokenizers import Tokenizer
  tok = Tokenizer.from_str(ld.tokenizer_json)
  assert tok.decode(row[:-1]) == TEXT and ld.folder is None
  val = loader(path, seq=4, batch=1, split=[0.9, 1])
  n = len(TEXT) + 1
  assert val.tokens == n - int(0.9 * n)


def test_text_file_errors(tmp_path):
  with pytest.raises(SxError) as e:
    loader(tmp_path / "shakespeare" / "input.txt", seq=8, batch=1)
  assert e.value.code == "E-LOAD-001" and "text file" in e.value.message
  assert "prepare_shakespeare.py" in e.value.fix and str(tmp_path / "shakespeare") in e.value.fix
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(SxError) as e:
    loader(tmp_path / "empty.txt", seq=8, batch=1)
  assert e.value.code == "E-LOAD-002" and "empty" in e.value.message
  (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
  with pytest.raises(SxError) as e:
    loader(tmp_path / "latin1.txt", seq=8, batch=1)
  assert e.value.code == "E-TOK-001"
  (tmp_path / "small.txt").write_text("abc")
  with pytest.raises(SxError) as e:
    loader(tmp_path / "small.txt", seq=2, batch=1, vocab=3)
  assert e.value.code == "E-LOAD-003" and "more than :vocab 3" in e.value.message

"""`sexpgpu tokenize --chars`: a character-level tokenizer.json that `tokenizers` loads (ids in
sorted order of the characters, nanoGPT's shakespeare_char), its cache, and `sample` taking a
text prompt and printing text for a model trained on it."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from sexpgpu.cli.main import main
from sexpgpu.data import make_loader, textcache
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.errors import SxError
from sexpgpu.tools.tokenize import Options, tokenize

BOOK = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" \
       "All:\tSpeak, speak.  Ünïcödé — 漢字 😀\r\n" * 3
NOTES = ['{"text": "to be\\nor not"}', '{"text": "ZZZ ~ end"}']


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """A book (.txt) and two documents (.jsonl), their texts in the cache's order."""
  d = tmp_path_factory.mktemp("chars-src")
  (d / "a-book.txt").write_bytes(BOOK.encode("utf-8"))  # \r\n kept: bytes as written
  (d / "b-notes.jsonl").write_text("\n".join(NOTES) + "\n", encoding="utf-8")
  texts = [BOOK, "to be\nor not", "ZZZ ~ end"]
  return d, texts


@pytest.fixture(scope="module")
def cache(sources, tmp_path_factory):
  d, _ = sources
  out = tmp_path_factory.mktemp("chars") / "cache"
  assert main(["tokenize", str(d / "a-book.txt"), str(d / "b-notes.jsonl"), "-o", str(out),
               "--chars"]) == 0
  return out


def test_ids_are_the_sorted_characters_and_eos_is_last(sources, cache):
  _, texts = sources
  chars = sorted(set("".join(texts)))
  tok = Tokenizer.from_file(str(cache / "tokenizer.json"))  # the library loads it as is
  assert tok.get_vocab_size() == len(chars) + 1
  assert [tok.token_to_id(c) for c in chars] == list(range(len(chars)))
  assert tok.token_to_id("<|endoftext|>") == len(chars)
  manifest = json.loads((cache / "manifest.json").read_text())
  assert manifest["tokenizer"]["vocab"] == len(chars) + 1
  assert manifest["tokenizer"]["trained"]["chars"] is True
  assert (manifest["documents"], manifest["tokens"]) == (3, sum(len(t) + 1 for t in texts))


@pytest.mark.parametrize("text", [BOOK, "  two  spaces\n\n\nnewlines\t", "漢字😀é", " "])
def test_encode_decode_round_trip(cache, text):
  tok = Tokenizer.from_file(str(cache / "tokenizer.json"))
  ids = tok.encode(text).ids
  assert len(ids) == len(text) and tok.decode(ids) == text


def test_the_cache_holds_each_character_then_eos(sources, cache):
  _, texts = sources
  chars = sorted(set("".join(texts)))
  want = [i for t in texts for i in [chars.index(c) for c in t] + [len(chars)]]
  got = np.concatenate([np.fromfile(cache / f"shard-0000{k}.bin", np.uint16) for k in (0, 1)])
  assert got.tolist() == want


def test_the_text_loader_reads_a_book_file_as_chars_would(tmp_path):
  # the loader's own character tokenization of a .txt equals tokenize --chars of it
  (tmp_path / "book.txt").write_text(BOOK, encoding="utf-8", newline="")
  tokenize(Options(sources=(str(tmp_path / "book.txt"),), output=str(tmp_path / "c"),
                   chars=True))
  args = {"seq": 8, "batch": 2, "split": [0.9, 1]}
  a = make_loader(LoaderSpec("v", "text", {"path": str(tmp_path / "c"), **args}), seed=0,
                  shuffle_default=False)
  b = make_loader(LoaderSpec("v", "text", {"path": str(tmp_path / "book.txt"), **args}),
                  seed=0, shuffle_default=False)
  assert (a.vocab, a.eos, a.tokens) == (b.vocab, b.eos, b.tokens)
  assert (a.batch(0)["tokens"] == b.batch(0)["tokens"]).all()
  assert (tmp_path / "c" / "tokenizer.json").read_text() == b.tokenizer_json


def test_a_second_run_continues(sources, cache, capsys):
  d, _ = sources
  before = (cache / "tokenizer.json").read_bytes()
  assert main(["tokenize", str(d / "a-book.txt"), str(d / "b-notes.jsonl"), "-o", str(cache),
               "--chars"]) == 0
  assert "2 sources (2 already in the cache)" in capsys.readouterr().err
  assert (cache / "tokenizer.json").read_bytes() == before


def test_chars_is_one_of_the_three_choices(sources, tmp_path):
  d, _ = sources
  with pytest.raises(SxError) as e:
    tokenize(Options(sources=(str(d / "a-book.txt"),), output=str(tmp_path / "x"),
                     train_bpe=300, chars=True))
  assert e.value.code == "E-FORM-001" and "given --train-bpe and --chars" in e.value.message
  assert not (tmp_path / "x").exists()  # refused before anything is written


def test_unknown_characters_are_found():
  tok = textcache.char_tokenizer(["a", "b", "\n"])
  assert textcache.char_unknown(tok, "ab\nc a\t") == ["\t", " ", "c"]
  assert tok.encode("abc").ids == [0, 1]  # what the check guards against: c dropped


# --- sample on a character model --------------------------------------------------------------

MODEL = """
(require std/nn)
(require std/lm)
(defloader train (text "book.txt" :seq 17 :batch 2 :split [0 0.9]))
(defn lm [tokens] (transformer-lm tokens :vocab 64 :width 16 :layers 1 :heads 2))
(defn loss [batch]
  (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 2 :optimizer (adam :lr 1e-3) :checkpoint-every 2)
"""


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
  """A two-step character model on a text file, and its checkpoint folder."""
  d = tmp_path_factory.mktemp("char-model")
  (d / "book.txt").write_text(BOOK * 4, encoding="utf-8")
  (d / "char.sx").write_text(MODEL)
  ckpt = d / "runs"
  assert main(["run", str(d / "char.sx"), "--checkpoint-dir", str(ckpt)]) == 0
  return d, ckpt


def test_sample_takes_text_and_prints_text(char_model, capsys):
  d, ckpt = char_model
  capsys.readouterr()
  assert main(["sample", str(d / "char.sx"), "--resume", "latest", "--checkpoint-dir",
               str(ckpt), "--prompt", "Speak, 漢字\n", "--tokens", "5", "--json",
               "--temperature", "0"]) == 0
  out = json.loads(capsys.readouterr().out)
  chars = sorted(set(BOOK))
  assert out["prompt_ids"] == [chars.index(c) for c in "Speak, 漢字\n"]
  assert len(out["ids"]) == 5 and isinstance(out["text"], str)
  # the text is the ids' characters (the end-of-document id, a special token, decodes to "")
  assert out["text"] == "".join(chars[i] for i in out["ids"] if i < len(chars))


def test_sample_refuses_a_character_the_model_never_saw(char_model, capsys):
  d, ckpt = char_model
  assert main(["sample", str(d / "char.sx"), "--resume", "latest", "--checkpoint-dir",
               str(ckpt), "--prompt", "Speak, Qxq"]) == 1
  err = capsys.readouterr().err
  assert "error[E-FORM-001]" in err and "'Q' 'q' 'x'" in err and "Traceback" not in err

"""`sexpgpu check FILE --print batch [--loader NAME]`: one microbatch of every loader kind,
each field's type and first rows, text where a tokenizer is known, and the synthetic tasks'
row layouts the reference documents (reverse: [x, 1, reversed x] with :mask on the answer)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.data import KINDS
from sexpgpu.errors import SxError
from sexpgpu.run.batchtext import batch_text
from sexpgpu.run.compile import compile_file
from sexpgpu.tools.tokenize import Options, tokenize

DATA = os.path.join(ROOT, "configs", "data")

EXP = """(require std/nn)
(require std/lm)
(defloader mk (markov :vocab 8 :seq 9 :batch 3 :seed 1))
(defloader mk2 (markov :vocab 8 :seq 9 :batch 3 :seed 2))
(defloader cp (copy :vocab 8 :seq 9 :batch 3))
(defloader rev (reverse :vocab 8 :seq 11 :batch 3))
(defloader srt (sort :vocab 8 :seq 9 :batch 3))
(defloader ad (add :digits 3 :batch 3))
(defloader tok (tokens "toks.bin" :dtype u16 :seq 9 :batch 3))
(defloader byt (bytes "{corpus}" :seq 40 :batch 3))
(defloader arr (arrays "arr.npz" :fields [x y] :batch 3))
(defloader mx (mix (0.5 mk) (0.5 mk2) :batch 3))
(defloader txt (text "cache" :seq 33 :batch 3))
(defloader cht (chat "{chat}" :tokenizer "{chat_tok}" :seq 97 :batch 2 :vocab 384))
(defloader prs (pairs "pairs.jsonl" :tokenizer "{chat_tok}" :seq 16 :batch 2 :shuffle false))
(defn loss [batch] (let [t (get batch :tokens)]
  (next-token-loss (transformer-lm (lm-inputs t) :vocab 8 :width 8 :layers 1 :heads 2) t)))
(defrun :loss loss :data mk :steps 1 :optimizer (adamw :lr 1e-3))
"""


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
  folder = tmp_path_factory.mktemp("batches")
  np.arange(200, dtype=np.uint16).tofile(folder / "toks.bin")
  np.savez(folder / "arr.npz", x=np.arange(30, dtype=np.float32).reshape(10, 3) / 4,
           y=np.arange(10, dtype=np.int32))
  paras = [p for p in open(os.path.join(DATA, "corpus.txt"), encoding="utf-8").read().split("\n")
           if p.strip()]
  (folder / "docs.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in paras) + "\n")
  pairs = [{"prompt": "Say hi.", "chosen": " Hello there.", "rejected": " Go away."}] * 3
  (folder / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
  tokenize(Options((str(folder / "docs.jsonl"),), str(folder / "cache"), train_bpe=300),
           progress=False)
  path = folder / "batches.sx"
  path.write_text(EXP.format(corpus=os.path.join(DATA, "corpus.txt"),
                             chat=os.path.join(DATA, "chat.jsonl"),
                             chat_tok=os.path.join(DATA, "chat-tok", "tokenizer.json")))
  return str(path), compile_file(str(path))


def _rows(text: str, field: str) -> list[list[int]]:
  """The printed rows of `field` (integers)."""
  lines = text.splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith(f"  :{field} "))
  out = []
  for line in lines[at + 1:]:
    if not line.startswith("    ") or line.startswith("       text"):
      if line.startswith("  :") or not line.startswith("    "):
        break
      continue
    out.append([int(w) for w in line.split(": ", 1)[1].split(" …")[0].split()])
  return out


def test_every_loader_kind_prints_its_fields_and_first_rows(exp):
  _, c = exp
  kinds = {c.loaders[n].kind for n in c.loaders}
  assert kinds == set(KINDS)  # every kind the language has is in the experiment
  for name, ld in c.loaders.items():
    text = batch_text(c, name)
    lines = text.splitlines()
    assert lines[0].startswith(f"batch: loader {name} ({ld.kind}) microbatch 0: "
                               f"{ld.batch_size} records")
    batch = ld.batch(0)
    for field, (shape, dtype) in ld.fields.items():
      assert f"  :{field} {np.dtype(dtype).name}[{','.join(map(str, shape))}]" in lines
    first = next(iter(ld.fields))
    if np.dtype(ld.fields[first][1]).kind in "iub" and batch[first].ndim == 2:
      want = [[int(v) for v in row[:32]] for row in batch[first][:2]]
      assert _rows(text, first) == want, name


def test_reverse_rows_are_x_separator_reversed_x_with_the_mask_on_the_answer(exp):
  _, c = exp
  text = batch_text(c, "rev")
  tokens, mask = _rows(text, "tokens"), _rows(text, "mask")
  assert len(tokens) == 2 and len(mask) == 2
  for row, m in zip(tokens, mask):
    x = row[:5]  # :seq 11: L = (11 - 1) // 2 = 5
    assert all(2 <= v < 8 for v in x) and row[5] == 1 and row[6:11] == x[::-1]
    assert m == [0] * 6 + [1] * 5


def test_add_rows_are_a_plus_b_equals_the_sum(exp):
  _, c = exp
  for row in _rows(batch_text(c, "ad"), "tokens"):
    digits = lambda ts: int("".join(str(t - 3) for t in ts))  # noqa: E731
    assert row[3] == 1 and row[7] == 2 and digits(row[:3]) + digits(row[4:7]) == digits(row[8:12])


def test_text_bytes_and_chat_rows_are_decoded(exp):
  _, c = exp
  corpus = open(os.path.join(DATA, "corpus.txt"), encoding="utf-8").read()
  byt = [line for line in batch_text(c, "byt").splitlines() if "text (UTF-8): " in line]
  assert len(byt) == 2 and all(eval(line.split(": ", 1)[1]) in corpus for line in byt)
  txt = [line for line in batch_text(c, "txt").splitlines() if "text (tokenizer): " in line]
  assert len(txt) == 2
  words = [w for line in txt for w in eval(line.split(": ", 1)[1]).split() if w.isalpha()]
  assert words and sum(w in corpus for w in words) >= len(words) // 2
  cht = [line for line in batch_text(c, "cht").splitlines() if "text (tokenizer): " in line]
  assert len(cht) == 2 and all("<|im_start|>" in line for line in cht)
  prs = [line for line in batch_text(c, "prs").splitlines() if "text (tokenizer): " in line]
  assert len(prs) == 4  # two rows of :chosen, two of :rejected
  assert all(eval(line.split(": ", 1)[1]).startswith("Say hi. Hello there.") for line in prs[:2])
  assert all(eval(line.split(": ", 1)[1]).startswith("Say hi. Go away.") for line in prs[2:])
  assert "text (" not in batch_text(c, "rev")  # no tokenizer: ids only


def test_the_default_loader_is_the_runs_and_an_unknown_one_is_e_name_001(exp):
  _, c = exp
  assert batch_text(c).splitlines()[0].startswith("batch: loader mk (markov)")
  with pytest.raises(SxError) as e:
    batch_text(c, "rve")
  assert e.value.code == "E-NAME-001" and e.value.where == "--loader rve"
  assert e.value.fix.startswith("did you mean `rev`?")


def test_the_cli_prints_a_batch_and_refuses_loader_without_it(exp, capsys):
  from sexpgpu.cli.main import main
  path, c = exp
  capsys.readouterr()
  code = main(["check", path, "--print", "batch", "--loader", "rev"])
  out, err = capsys.readouterr()
  assert code == 0, err
  assert out == batch_text(c, "rev")
  code = main(["check", path, "--loader", "rev"])
  out, err = capsys.readouterr()
  assert code == 1 and "error[E-FORM-001]: --loader rev names the loader of " \
      "--print batch" in err
  assert "Traceback" not in err

"""A model trained on a file's bytes (`bytes` loader) takes a text prompt and prints text:
`sample` encodes the prompt as its UTF-8 bytes and decodes the continuation as UTF-8, as the
`tokenizers` ByteLevel decoder does (a character cut at the end prints as U+FFFD)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sexpgpu.cli.main import main
from sexpgpu.data.textcache import byte_tokenizer

SX = """
(require std/lm)
(require std/gpt2)
(defloader train (bytes "text.txt" :seq 9 :batch 2))
(defn lm [tokens]
  (gpt2 tokens :vocab 256 :width 16 :layers 1 :heads 2 :context 32))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""


def test_the_byte_tokenizer_round_trips_any_text_as_its_utf8_bytes():
  tok = byte_tokenizer()
  for text in ["plain ascii\n", "héllo wörld ✓ 日本語 🙂", "  two  spaces\ttab\r\n", ""]:
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
  assert tok.decode(list("日".encode("utf-8"))[:2]) == "\ufffd"  # a cut character
  assert tok.get_vocab_size() == 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  tmp = tmp_path_factory.mktemp("bytes")
  (tmp / "text.txt").write_text("Once upon a time, a café by the sea. " * 8, encoding="utf-8")
  path = str(tmp / "s.sx")
  with open(path, "w") as f:
    f.write(SX)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(5, c.params).items()}
  return path, write_step0(c, params, str(tmp / "ck"))


def test_a_bytes_model_takes_a_text_prompt_and_prints_utf8(model, capsys):
  path, step = model
  prompt = "café ✓"
  args = ["sample", path, "--resume", step, "--prompt", prompt, "--tokens", "6",
          "--temperature", "0"]
  assert main([*args, "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["prompt_ids"] == list(prompt.encode("utf-8"))
  want = bytes(out["ids"]).decode("utf-8", "replace")
  assert out["text"] == want
  assert main(args) == 0
  assert capsys.readouterr().out == bytes(out["prompt_ids"] + out["ids"]).decode(
      "utf-8", "replace") + "\n"


def test_the_notebook_api_samples_as_the_command_does(model):
  import sexpgpu
  from sexpgpu.errors import SxError
  path, step = model
  exp = sexpgpu.compile(path)
  got = exp.sample(step, "café ✓", tokens=6, temperature=0)
  assert got.prompt_ids == list("café ✓".encode("utf-8"))
  assert got.text == bytes(got.ids).decode("utf-8", "replace")
  slid = exp.sample(step, "café ✓", tokens=6, temperature=0, window="recompute")
  assert slid.path == "recompute" and slid.ids == got.ids  # inside the window: the same
  with pytest.raises(SxError) as e:
    exp.sample(step, "café", window="sideways")
  assert e.value.code == "E-FORM-001" and e.value.where == "window"

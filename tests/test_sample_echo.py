"""`sexpgpu sample` prints the prompt before the continuation (`--no-echo`: the continuation
alone), as token ids or as text; `sample` and `export` with `--resume latest` find the run's
checkpoints where `run` wrote them without `--checkpoint-dir` (SEXPGPU_CHECKPOINT_DIR)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sexpgpu.cli.main import main

SX = """
(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (gpt2 tokens :vocab 24 :width 16 :layers 1 :heads 2 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""
CHARS = "abcdefghijklmnopqrstuvwx"  # a character per id of the model's 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  from tokenizers import Tokenizer, decoders, models
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  tmp = tmp_path_factory.mktemp("echo")
  path = str(tmp / "s.sx")
  with open(path, "w") as f:
    f.write(SX)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(5, c.params).items()}
  tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(CHARS)}, []))
  tok.decoder = decoders.Fuse()
  tok.save(str(tmp / "tokenizer.json"))
  return path, write_step0(c, params, str(tmp / "ck")), str(tmp)


def _sample(capsys, *args) -> tuple[str, dict]:
  """The printed text and the --json object of the same greedy continuation."""
  assert main(["sample", *args, "--tokens", "5", "--temperature", "0"]) == 0
  text = capsys.readouterr().out
  assert main(["sample", *args, "--tokens", "5", "--temperature", "0", "--json"]) == 0
  return text, json.loads(capsys.readouterr().out)


def test_ids_are_echoed_before_the_continuation_and_no_echo_omits_them(model, capsys):
  path, step, _ = model
  text, out = _sample(capsys, path, "--resume", step, "--prompt", "3 1 4")
  assert len(out["ids"]) == 5
  assert text == "3 1 4 " + " ".join(map(str, out["ids"])) + "\n"
  quiet, _ = _sample(capsys, path, "--resume", step, "--prompt", "3 1 4", "--no-echo")
  assert quiet == " ".join(map(str, out["ids"])) + "\n" == out["text"] + "\n"


def test_a_text_prompt_is_echoed_as_text(model, capsys):
  path, step, tmp = model
  tok = os.path.join(tmp, "tokenizer.json")
  text, out = _sample(capsys, path, "--resume", step, "--prompt", "cab", "--tokenizer", tok)
  assert out["prompt_ids"] == [2, 0, 1]
  assert text == "cab" + "".join(CHARS[i] for i in out["ids"]) + "\n"
  quiet, _ = _sample(capsys, path, "--resume", step, "--prompt", "cab", "--tokenizer", tok,
                     "--no-echo")
  assert quiet == out["text"] + "\n" and len(out["text"]) == 5


def test_resume_latest_takes_the_runs_location_without_checkpoint_dir(model, capsys,
                                                                     monkeypatch, tmp_path):
  path, _, tmp = model
  monkeypatch.setenv("SEXPGPU_CHECKPOINT_DIR", os.path.join(tmp, "ck"))
  assert main(["sample", path, "--resume", "latest", "--prompt", "3 1 4", "--tokens", "5",
               "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["step"] == 0 and out["prompt_ids"] == [3, 1, 4]
  target = str(tmp_path / "m.safetensors")
  assert main(["export", path, "--resume", "latest", "-o", target]) == 0
  assert os.path.getsize(target) > 0
  capsys.readouterr()
  monkeypatch.delenv("SEXPGPU_CHECKPOINT_DIR")  # no location at all: said, with the fix
  assert main(["sample", path, "--resume", "latest", "--prompt", "1", "--tokens", "5"]) == 1
  err = capsys.readouterr().err
  assert "error[E-CKPT-001]" in err and "--checkpoint-dir" in err

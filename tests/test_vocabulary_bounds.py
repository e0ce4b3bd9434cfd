"""A loader whose ids reach past the model's vocabulary (its logits) is E-LOAD-003 when the
experiment compiles, at `check` too, and a loader within the vocabulary compiles."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_source

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _tiny(loader_vocab: str, metric_loader: str | None = None) -> str:
  text = open(TINY, encoding="utf-8").read()
  text = text.replace("(defloader train (markov :vocab vocab",
                      f"(defloader train (markov :vocab {loader_vocab}")
  if metric_loader is not None:
    text = text.replace("(defloader valid (markov :vocab vocab",
                        f"(defloader valid (markov :vocab {metric_loader}")
  return text


def test_a_loader_past_the_models_vocabulary_is_e_load_003_when_it_compiles():
  with pytest.raises(SxError) as e:
    compile_source(_tiny("(* 2 vocab)"), "exp.sx", base_dir=os.path.dirname(TINY))
  err = e.value
  assert err.code == "E-LOAD-003"
  assert "ids up to 63 (a vocabulary of 64)" in err.message and "32 rows" in err.message
  assert ("loader", "exp.sx:14:18") in err.notes
  assert "a vocabulary of 64" in err.fix and ":vocab of 32" in err.fix


def test_a_pass_loader_past_the_logits_is_refused_too():
  with pytest.raises(SxError) as e:
    compile_source(_tiny("vocab", metric_loader="33"), "exp.sx", base_dir=os.path.dirname(TINY))
  assert e.value.code == "E-LOAD-003" and "loader `valid`" in e.value.message
  assert "(a vocabulary of 33)" in e.value.message


def test_a_loader_within_the_vocabulary_compiles():
  c = compile_source(_tiny("16"), "exp.sx", base_dir=os.path.dirname(TINY))
  assert c.loaders["train"].vocab == 16


def test_check_of_a_model_smaller_than_its_data_is_an_error_not_a_nan(tmp_path, capsys):
  p = tmp_path / "exp.sx"
  p.write_text(_tiny("(* 2 vocab)"))
  code = main(["check", str(p)])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-LOAD-003]" in err and "Traceback" not in err
  assert f"= loader: {p}:14:18" in err

"""Results a newcomer would trust: a model smaller than its data's vocabulary is refused when
it compiles, and a bundle with its data carries a text loader's token cache."""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_file, compile_source

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


# -- bundles with a text loader --------------------------------------------------------------

TEXT_EXP = """
(require std/nn)
(require std/lm)
(defloader train (text "cache" :seq 9 :batch 2 :pack docs))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (transformer-lm (lm-inputs t) :vocab 300 :width 16 :layers 1 :heads 2) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :seed 3)
"""


@pytest.fixture(scope="module")
def text_exp(tmp_path_factory):
  from sexpgpu.tools.tokenize import Options, tokenize
  folder = tmp_path_factory.mktemp("textbundle")
  corpus = open(os.path.join(ROOT, "tests", "data", "corpus.txt"), encoding="utf-8").read()
  paras = [p for p in corpus.split("\n\n") if p.strip()] * 3
  (folder / "docs.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in paras) + "\n")
  tokenize(Options((str(folder / "docs.jsonl"),), str(folder / "cache"), train_bpe=300),
           progress=False)
  (folder / "text.sx").write_text(TEXT_EXP)
  return folder


def test_a_bundle_with_data_carries_a_text_loaders_cache(text_exp, tmp_path, monkeypatch):
  from sexpgpu.tools.bundle import make_bundle, open_bundle, read_manifest
  out = str(tmp_path / "t.sxb")
  make_bundle(str(text_exp / "text.sx"), out, with_data=True)
  files = read_manifest(out)["files"]
  cache = sorted(os.path.relpath(os.path.join(r, n), text_exp).replace(os.sep, "/")
                 for r, _, ns in os.walk(text_exp / "cache") for n in ns)
  assert "cache/manifest.json" in cache and "cache/tokenizer.json" in cache
  assert sorted(f for f in files if f.startswith("cache/")) == cache
  assert all(files[f]["kind"] == "data" for f in cache)
  assert read_manifest(out)["data_not_bundled"] == []
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cachedir"))
  exp, _, _ = open_bundle(out)
  assert compile_file(exp).loaders["train"].records > 0  # the cache read from the bundle


def test_a_bundle_without_data_names_the_cache_it_left_out(text_exp, tmp_path, capsys):
  out = str(tmp_path / "t.sxb")
  assert main(["bundle", str(text_exp / "text.sx"), "-o", out]) == 0
  assert "loader train: cache not bundled (add --with-data)" in capsys.readouterr().err


def test_the_standard_library_names_the_require_that_brings_a_name():
  from sexpgpu.lang.program import std_libraries_of
  assert std_libraries_of("gpt2") == ["std/gpt2"] and std_libraries_of("llama") == ["std/llama"]
  assert std_libraries_of("transformer-lm") == ["std/lm"]
  assert std_libraries_of("get") == [] and std_libraries_of("no-such-name") == []

"""docs/language.md is generated from the language's declarations and kept in step with them:
a builtin, a loader keyword or a std function declared without a doc line fails it."""

import os

import pytest

from conftest import ROOT
from sexpgpu.data import KINDS
from sexpgpu.data.spec import Key, LoaderDef
from sexpgpu.front import prims
from sexpgpu.front.values import Builtin
from sexpgpu.lang import program
from sexpgpu.tools import langdoc


def test_page_is_what_the_tables_generate():
  with open(langdoc.DOC_PATH, encoding="utf-8") as f:
    assert f.read() == langdoc.generate(), "run: python -m sexpgpu.tools.langdoc"


def test_a_new_op_without_an_entry_fails(monkeypatch):
  monkeypatch.setitem(prims.BUILTINS, "frobnicate", prims.BUILTINS["relu"])
  with pytest.raises(KeyError, match="frobnicate"):
    langdoc.generate()


def test_a_builtin_is_documented_by_its_own_declaration(monkeypatch):
  monkeypatch.setitem(prims.BUILTINS, "frobnicate", Builtin(
      "frobnicate", prims.BUILTINS["dim"].fn, "(frobnicate X)", "a static frobnication"))
  assert "| `frobnicate` | `(frobnicate X)` | a static frobnication |" in langdoc.generate()
  assert prims.BUILTINS["dim"].usage == "(dim X AXIS)"  # declared where it is implemented


def test_a_new_loader_keyword_without_a_doc_line_fails(monkeypatch):
  markov = KINDS["markov"]
  monkeypatch.setitem(KINDS, "markov", LoaderDef(
      "markov", markov.doc, markov.keywords + (("temperature", Key("", "int", 1)),),
      markov.builder))
  with pytest.raises(KeyError, match="loader keyword `temperature`"):
    langdoc.generate()


def test_every_std_function_is_listed_with_its_doc_string():
  rows = {n: (f, doc) for f, n, _, _, doc in langdoc._std_functions()}
  assert "attention" in rows and all(doc for _, doc in rows.values())
  assert rows["rmsnorm"] == ("std/nn.sx", "RMS normalization over the last axis, with a "
                                          "learned scale")
  text = open(langdoc.DOC_PATH, encoding="utf-8").read()
  assert "| `transformer-lm` | std/lm.sx | tokens :vocab" in text
  assert "| `lm-inputs` | std/lm.sx | tokens | tokens without the last position |" in text


def test_a_std_function_without_a_doc_string_fails(monkeypatch, tmp_path):
  (tmp_path / "odd.sx").write_text('(defn documented [x] "twice x" (* x 2))\n'
                                   '(defn bare [x] (* x 2))\n(defn only [x] "a value")\n')
  monkeypatch.setattr(program, "STD_DIR", str(tmp_path))
  assert [(n, doc) for _, n, _, _, doc in langdoc._std_functions()] == [
      ("documented", "twice x"), ("bare", ""), ("only", "")]  # a string alone is the value
  with pytest.raises(KeyError, match="std function `bare`.*std function `only`"):
    langdoc.generate()


def test_a_doc_string_is_no_part_of_the_value():
  from sexpgpu.front.experiment import evaluate
  from sexpgpu.lang.select import select
  src = ('(defn f [x]\n  "twice x,\n   over two lines"\n  (* x 2))\n(defn g [x] (* x 2))\n'
         '(defn h [] "a string alone is the value")\n(def a (f 3))\n(def b (g 3))\n(def c (h))\n')
  p = program.load_text(src + "(defloader d (markov :vocab 8 :seq 5 :batch 2 :seed 1))\n"
                        "(defrun :loss f :data d :steps 1 :optimizer (adamw :lr 1e-3))\n", "doc.sx")
  env = evaluate(p, select(p)).env.vars
  assert (env["a"], env["b"], env["c"]) == (6, 6, "a string alone is the value")


def test_readme_links_the_reference():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    assert "(docs/language.md)" in f.read()

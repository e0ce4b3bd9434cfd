"""docs/language.md is generated from the code's tables and kept in step with them."""

import os

import pytest

from conftest import ROOT
from sexpgpu.data import KINDS
from sexpgpu.front import prims
from sexpgpu.tools import langdoc


def test_page_is_what_the_tables_generate():
  with open(langdoc.DOC_PATH, encoding="utf-8") as f:
    assert f.read() == langdoc.generate(), "run: python -m sexpgpu.tools.langdoc"


def test_a_new_op_without_an_entry_fails(monkeypatch):
  monkeypatch.setitem(prims.BUILTINS, "frobnicate", prims.BUILTINS["relu"])
  with pytest.raises(KeyError, match="frobnicate"):
    langdoc.generate()


def test_a_new_loader_keyword_without_an_entry_fails(monkeypatch):
  table = KINDS["markov"].arg_table
  monkeypatch.setattr(KINDS["markov"], "arg_table",
                      type(table)(table.required, {**table.optional, "temperature": 1.0}))
  with pytest.raises(KeyError, match="temperature"):
    langdoc.generate()


def test_every_std_function_is_listed():
  names = [n for _, n, _, _ in langdoc._std_functions()]
  assert set(names) == set(langdoc.STD) and "attention" in names
  text = open(langdoc.DOC_PATH, encoding="utf-8").read()
  assert "| `transformer-lm` | std/lm.sx | tokens :vocab" in text


def test_readme_links_the_reference():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    assert "(docs/language.md)" in f.read()

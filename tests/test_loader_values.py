"""Generated from the loaders' own tables: every name a keyword takes (`:pack docs`) is the one
the language reference lists, each is accepted by `check`, and any other is refused at its
place with the names it may be."""

import os
import re

import pytest

from conftest import ROOT
from sexpgpu.data import KINDS
from test_loader_keywords import _compile_error, _source

CHOICES = sorted({(kind, key, name) for kind, decl in KINDS.items()
                  for key, names in decl.choices.items() for name in names})


def _reference() -> dict[str, list[str]]:
  """The reference's `Loader keywords` table: keyword → the names its row lists."""
  text = open(os.path.join(ROOT, "docs", "language.md"), encoding="utf-8").read()
  table = text.split("Loader keywords:", 1)[1].split("\n## ", 1)[0]
  out = {}
  for row in re.findall(r"^\| `:([a-z-]+)` \| (.*) \|$", table, re.M):
    if "; one of " in row[1]:
      out[row[0]] = re.findall(r"`([^`]+)`", row[1].rsplit("; one of ", 1)[1])
  return out


def test_the_reference_lists_exactly_the_names_the_loaders_take():
  tables = {}
  for decl in KINDS.values():
    for key, names in decl.choices.items():
      tables.setdefault(key, [])
      tables[key] += [n for n in names if n not in tables[key]]
  assert {"pack", "offsets", "dtype"} <= set(tables)
  assert _reference() == tables


@pytest.mark.parametrize("kind,key,name", CHOICES)
def test_each_listed_name_is_accepted(kind, key, name):
  err = _compile_error(_source(kind, f" :{key} {name}"))
  assert err is None or err.code == "E-LOAD-001", err  # past the keywords: the missing file


@pytest.mark.parametrize("kind,key", sorted({(k, key) for k, key, _ in CHOICES}))
def test_any_other_name_is_refused_at_its_place_with_the_names(kind, key):
  err = _compile_error(_source(kind, f" :{key} bogus"))
  assert err is not None and err.code == "E-FORM-001", err
  text = err.render()
  assert "--> keywords.sx:3:" in text and f"`:{key}` is bogus" in text
  for name in KINDS[kind].choices[key]:
    assert f":{key} {name}" in err.fix

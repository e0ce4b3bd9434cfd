"""Messages read as English: an article that fits its noun, no Python `None` shown as a flag's
value."""

import os

import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.cli.main import main

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def test_a_knob_of_another_type_says_an_integer():
  with pytest.raises(sexpgpu.SxError) as e:
    sexpgpu.compile(TINY, set={"layers": "two"})
  assert e.value.code == "E-KNOB-002"
  assert "is not an integer (knob layers)" in str(e.value)
  assert "give layers an integer value" in e.value.fix
  assert " a integer" not in e.value.render()


def test_a_bundle_made_without_a_variant_says_so(tmp_path, capsys):
  out = str(tmp_path / "tiny.sxb")
  assert main(["bundle", TINY, "-o", out]) == 0
  capsys.readouterr()
  assert main(["run", out, "--variant", "smoke"]) == 1
  err = capsys.readouterr().err
  assert "error[E-VARIANT-001]: the bundle was made with no --variant; --variant smoke " in err
  assert "None" not in err

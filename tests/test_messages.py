"""Messages read as English: an article that fits its noun, no Python `None` shown as a flag's
value, a JSON value's type in JSON's words."""

import os

import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.tools.textsources import Source, documents

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


@pytest.mark.parametrize("line,says", [('{"text": 3}', "a number"), ('{"text": {"a": 1}}',
                                       "an object"), ('{"text": null}', "null")])
def test_a_jsonl_field_of_another_type_names_it_in_json_words(line, says):
  with pytest.raises(sexpgpu.SxError) as e:
    documents(Source("a.jsonl", 1, "0", "jsonl"), line.encode(), "text")
  assert f"line 1 has {says} `text`, expected a string" in str(e.value)

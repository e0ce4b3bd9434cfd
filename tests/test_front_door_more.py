"""Inputs that still misled or reached a traceback: a name the standard library has, a knob
named like a primitive, schedules out of range, integers on the command line, stacking that
does not divide the microbatches, and long source lines in an error."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_source

CONFIGS = os.path.join(ROOT, "configs")


def _config(name: str, old: str | None = None, new: str = "") -> str:
  text = open(os.path.join(CONFIGS, name), encoding="utf-8").read()
  if old is not None:
    assert old in text
    text = text.replace(old, new)
  return text


def _compile_error(text: str) -> SxError:
  with pytest.raises(SxError) as e:
    compile_source(text, "exp.sx", base_dir=CONFIGS)
  return e.value


# --- names the standard library defines ----------------------------------------------------

def test_a_std_function_without_its_require_names_the_require():
  err = _compile_error(_config("gpt2-small.sx", "(require std/gpt2)", ""))
  assert err.code == "E-NAME-001" and err.message == "`gpt2` is not defined"
  assert err.fix == "(require std/gpt2) brings `gpt2`"
  assert "did you mean" not in str(err)


def test_a_name_no_library_defines_keeps_did_you_mean():
  text = _config("tiny-lm.sx", "(next-token-loss (lm", "(next-token-los (lm")
  err = _compile_error(text)
  assert err.code == "E-NAME-001" and err.fix.startswith("did you mean `next-token-loss`")


def test_a_knob_named_like_a_primitive_std_calls_is_e_name_002_at_the_defknob():
  text = _config("moe-lm.sx", '(defknob experts-per-token 2', '(defknob top-k 2')
  text = text.replace(":k experts-per-token", ":k top-k")
  err = _compile_error(text)
  assert err.code == "E-NAME-002"
  assert err.message == ("the knob `top-k` hides the primitive `top-k`, which is called at "
                         "std/moe.sx:25:20")
  assert str(err.location) == "exp.sx:16:1" and "rename the knob" in err.fix


def test_a_def_named_like_a_primitive_is_e_name_002_at_the_call():
  text = _config("tiny-lm.sx", "(defn lm [tokens]", "(def matmul 3)\n(defn lm [tokens]")
  text = text.replace("(next-token-loss (lm (lm-inputs t)) t)",
                      "(next-token-loss (lm (lm-inputs t)) (matmul t t))")
  err = _compile_error(text)
  assert err.code == "E-NAME-002" and "the def `matmul` hides the primitive" in err.message
  assert str(err.location) == "std/nn.sx:5:12"  # std's linear is the first to call it


def test_a_knob_named_like_an_uncalled_primitive_and_a_local_binding_still_compile():
  # ssm-lm's knob `expand` is never called; a let's local `max` is the user's own business
  compile_source(_config("ssm-lm.sx"), "exp.sx", base_dir=CONFIGS)
  text = _config("tiny-lm.sx", "(let [t (get batch :tokens)]", "(let [t (get batch :tokens) max 3]")
  text = text.replace("(next-token-loss (lm (lm-inputs t)) t)", "(max (lm (lm-inputs t)) t)")
  err = _compile_error(text)
  assert err.code == "E-TYPE-001" and "`max` is not a function" in err.message

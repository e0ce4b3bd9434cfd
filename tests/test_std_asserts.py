"""A function refuses a keyword's value with `assert`: the standard library's :z-loss, :qk-norm,
:act, :drop, :remat and :eps checks, each told at the user's call (file, line, the value's
column), never inside std; and `assert` itself written wrong."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_source

CONFIGS = os.path.join(ROOT, "configs")
TINY = open(os.path.join(CONFIGS, "tiny-lm.sx"), encoding="utf-8").read()
GPT2 = open(os.path.join(CONFIGS, "gpt2-small.sx"), encoding="utf-8").read()
LOSS = "(next-token-loss (lm (lm-inputs t)) t)"
LM = "(transformer-lm tokens :vocab vocab :width width :layers layers :heads heads)"


def _error(text: str, variant: str | None = None) -> SxError:
  with pytest.raises(SxError) as e:
    compile_source(text, "exp.sx", base_dir=CONFIGS, variant=variant)
  return e.value


def _col(text: str, needle: str, skip: str = "") -> str:
  """`exp.sx:LINE:COL` of the first `needle` in text (past its prefix `skip`)."""
  at = text.index(skip + needle) + len(skip)
  line = text.count("\n", 0, at) + 1
  return f"exp.sx:{line}:{at - (text.rfind(chr(10), 0, at) + 1) + 1}"


def test_a_negative_z_loss_is_refused_at_the_users_value():
  text = TINY.replace(LOSS, "(next-token-loss (lm (lm-inputs t)) t :z-loss -0.5)")
  err = _error(text)
  assert err.code == "E-ARG-001"
  assert err.message == ":z-loss is a number ≥ 0 (the penalty's weight), or nil for none"
  assert str(err.location) == _col(text, "-0.5") and err.fix == ":z-loss 1e-4"
  notes = dict(err.notes)
  assert notes["in"].startswith("(next-token-loss") and notes["checked at"].startswith("std/lm.sx:")


def test_a_z_loss_carried_by_a_knob_points_at_the_knobs_name_in_the_call():
  text = TINY.replace('(defknob lr 0.01 "peak learning rate")',
                      '(defknob lr 0.01 "peak learning rate")\n(defknob zl -1.0)')
  text = text.replace(LOSS, "(next-token-loss (lm (lm-inputs t)) t :z-loss zl)")
  err = _error(text)
  assert err.code == "E-ARG-001" and str(err.location) == _col(text, "zl)")


def test_a_valid_z_loss_and_qk_norm_still_compile():
  text = TINY.replace(LOSS, "(next-token-loss (lm (lm-inputs t)) t :z-loss 0.0)")
  text = text.replace(":heads heads))", ":heads heads :qk-norm true :act relu2))")
  c = compile_source(text, "exp.sx", base_dir=CONFIGS)
  assert any(p.endswith("q_norm/scale") for p in c.params)


@pytest.mark.parametrize("keyword,value,message", [
    (":qk-norm", "1", ":qk-norm is true or false"),
    (":act", '"gelu"', ":act is an activation function, not a value"),
    (":drop", "1.5", ":drop is a rate in [0, 1)"),
    (":remat", "1", ":remat is true or false"),
])
def test_transformer_lm_refuses_a_keyword_at_the_users_call(keyword, value, message):
  text = TINY.replace(LM, LM[:-1] + f" {keyword} {value})")
  err = _error(text)
  assert (err.code, err.message) == ("E-ARG-001", message)
  assert str(err.location) == _col(text, value, skip=f"{keyword} ")
  assert dict(err.notes)["checked at"].startswith("std/lm.sx:")


@pytest.mark.slow  # builds gpt2 twice
def test_gpt2_refuses_a_non_boolean_qk_norm_and_a_zero_eps():
  text = GPT2.replace(":remat true))", ":remat true :qk-norm 1))")
  err = _error(text, "smoke")
  assert err.code == "E-ARG-001" and err.message == ":qk-norm is true or false"
  assert str(err.location) == _col(text, "1", skip=":qk-norm ")
  assert err.fix == ":qk-norm true"
  assert dict(err.notes)["checked at"].startswith("std/gpt2.sx:")
  err = _error(GPT2.replace(":remat true))", ":remat true :eps 0))"), "smoke")
  assert err.code == "E-ARG-001" and err.message == ":eps is a number > 0"


def test_a_users_own_assert_points_at_the_users_call_of_their_function():
  text = TINY.replace("(defn lm [tokens]",
                      '(defn scaled [x :by 1.0]\n'
                      '  (assert (> by 0) ":by must be positive" :fix ":by 2.0")\n'
                      "  (* x by))\n(defn lm [tokens]")
  text = text.replace(LOSS, "(next-token-loss (scaled (lm (lm-inputs t)) :by -2.0) t)")
  err = _error(text)
  assert (err.code, err.message, err.fix) == ("E-ARG-001", ":by must be positive", ":by 2.0")
  assert str(err.location) == _col(text, "-2.0")


@pytest.mark.parametrize("assert_form,code", [
    ("(assert true)", "E-FORM-001"),
    ('(assert true "m" :fiks "x")', "E-FORM-002"),
    ('(assert t "m")', "E-TYPE-001"),
    ("(bool? 1 2)", "E-FORM-001"),
])
def test_assert_written_wrong(assert_form, code):
  text = TINY.replace("(let [t (get batch :tokens)]",
                      f"(let [t (get batch :tokens) _ {assert_form}]")
  err = _error(text)
  assert err.code == code and str(err.location).startswith("exp.sx:21:")


def test_moe_refuses_more_experts_a_token_than_there_are_at_the_knob_in_the_users_call():
  text = open(os.path.join(CONFIGS, "moe-lm.sx"), encoding="utf-8").read()
  with pytest.raises(SxError) as e:
    compile_source(text, "exp.sx", base_dir=CONFIGS, sets=[("experts-per-token", "9")])
  err = e.value
  assert err.code == "E-ARG-001"
  assert err.message == ":k is the experts each token goes to, 1 to :experts"
  assert str(err.location) == _col(text, "experts-per-token", skip=":k ")
  assert dict(err.notes)["checked at"].startswith("std/moe.sx:")

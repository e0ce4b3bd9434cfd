"""The standard library in its own namespace: a user's `block` (a knob or a function) next to
`(require std/lm)` wins in the user's file, std's names stay reachable qualified (`lm/block`),
and std's own references are untouched by the user's definitions."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_source

CONFIGS = os.path.join(ROOT, "configs")
TINY = open(os.path.join(CONFIGS, "tiny-lm.sx"), encoding="utf-8").read()


def _tiny(old: str | None = None, new: str = "") -> str:
  text = TINY
  if old is not None:
    assert old in text
    text = text.replace(old, new)
  return text


def _compile(text: str):
  return compile_source(text, "exp.sx", base_dir=CONFIGS)


@pytest.fixture(scope="module")
def plain():
  return _compile(_tiny())


def _shapes(c) -> dict[str, tuple[int, ...]]:
  return {path: tuple(p.full_shape) for path, p in c.params.items()}


def test_a_user_knob_named_block_compiles_and_leaves_std_lm_as_it_was(plain):
  c = _compile(_tiny('(defknob lr 0.01 "peak learning rate")',
                     '(defknob lr 0.01 "peak learning rate")\n(defknob block 64 "a user knob")'))
  assert c.selection.knobs["block"].value == 64
  assert _shapes(c) == _shapes(plain)  # transformer-lm still calls std/lm's block


def test_a_user_function_named_block_wins_in_the_users_file(plain):
  # the user's block scales by 2 and has a parameter of its own; std's transformer-lm keeps
  # calling std/lm's block (its norm1/norm2/attention/mlp parameters are all still there)
  text = _tiny("(defn lm [tokens]",
               "(defn block [x] (* x (param gain [(dim x -1)] :init ones)))\n"
               "(defn lm [tokens]")
  text = text.replace("(transformer-lm tokens :vocab vocab :width width :layers layers "
                      ":heads heads))",
                      "(let [y (transformer-lm tokens :vocab vocab :width width :layers layers "
                      ":heads heads)] (block y)))")
  c = _compile(text)
  shapes = _shapes(c)
  extra = {p: s for p, s in shapes.items() if p not in _shapes(plain)}
  assert list(extra.values()) == [(32,)] and list(extra)[0].endswith("block/gain")
  assert {p: s for p, s in shapes.items() if p not in extra} == _shapes(plain)


def test_a_user_rmsnorm_does_not_reach_std_lms_calls(plain):
  # std/lm calls std/nn's rmsnorm; a user's rmsnorm without a parameter must not replace it
  c = _compile(_tiny("(defn lm [tokens]", "(defn rmsnorm [x] x)\n(defn lm [tokens]"))
  assert _shapes(c) == _shapes(plain)


def test_std_names_are_reachable_qualified_beside_the_users_own(plain):
  # the user's block and std/lm's, called as lm/block, in one file
  text = _tiny("(defn lm [tokens]", "(defknob block 64)\n(defn lm [tokens]")
  text = text.replace("(transformer-lm tokens", "(lm/transformer-lm tokens")
  c = _compile(text)
  assert _shapes(c) == _shapes(plain)
  c2 = _compile(_tiny("(transformer-lm tokens", "(nn/dense (lm/transformer-lm tokens")
                .replace(":heads heads))", ":heads heads) vocab))"))
  assert len(c2.params) == len(plain.params) + 1


def test_two_user_definitions_of_one_name_are_still_e_name_002():
  text = _tiny("(defn lm [tokens]", "(defknob block 64)\n(defn block [x] x)\n(defn lm [tokens]")
  with pytest.raises(SxError) as e:
    _compile(text)
  assert e.value.code == "E-NAME-002"
  assert e.value.message == "`block` is defined twice (first at exp.sx:17:10)"
  assert str(e.value.location) == "exp.sx:18:7"


def test_a_qualified_name_without_its_require_names_the_require():
  text = _tiny("(require std/lm)\n", "")
  text = text.replace("(next-token-loss (lm", "(lm/next-token-loss (lm")
  with pytest.raises(SxError) as e:
    _compile(text)
  assert e.value.code == "E-NAME-001"
  assert e.value.message == "`lm/next-token-loss` is not defined"
  assert e.value.fix == "(require std/lm) brings `lm/next-token-loss`"


def test_a_qualified_name_the_library_lacks_is_e_name_001():
  with pytest.raises(SxError) as e:
    _compile(_tiny("(transformer-lm tokens", "(lm/transformer tokens"))
  assert e.value.code == "E-NAME-001" and "`lm/transformer` is not defined" in e.value.message
  assert "lm/transformer-lm" in e.value.fix


def test_calling_a_user_knob_named_like_a_std_function_names_the_qualified_one():
  text = _tiny("(defn lm [tokens]", "(defknob block 64)\n(defn lm [tokens]")
  text = text.replace("(transformer-lm tokens :vocab vocab :width width :layers layers "
                      ":heads heads))", "(block (transformer-lm tokens :vocab vocab :width "
                      "width :layers layers :heads heads)))")
  with pytest.raises(SxError) as e:
    _compile(text)
  assert e.value.code == "E-NAME-002" and str(e.value.location) == "exp.sx:19:4"
  assert e.value.message == ("`block` here is your knob, not a function: in your files your "
                             "own `block` hides std/lm.sx's, which is `lm/block`")
  assert e.value.fix == "call (lm/block ...), or rename the knob"


# --- which require brings a name -----------------------------------------------------------

def test_the_standard_library_names_the_require_that_brings_a_name():
  from sexpgpu.lang.program import std_libraries_of
  assert std_libraries_of("gpt2") == ["std/gpt2"] and std_libraries_of("llama") == ["std/llama"]
  assert std_libraries_of("transformer-lm") == ["std/lm"]
  assert std_libraries_of("get") == [] and std_libraries_of("no-such-name") == []


# --- names the standard library defines ----------------------------------------------------

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


def test_a_std_function_without_its_require_names_the_require():
  err = _compile_error(_config("gpt2-small.sx", "(require std/gpt2)", ""))
  assert err.code == "E-NAME-001" and err.message == "`gpt2` is not defined"
  assert err.fix == "(require std/gpt2) brings `gpt2`"
  assert "did you mean" not in str(err)


def test_a_name_no_library_defines_keeps_did_you_mean():
  text = _config("tiny-lm.sx", "(next-token-loss (lm", "(next-token-los (lm")
  err = _compile_error(text)
  assert err.code == "E-NAME-001" and err.fix.startswith("did you mean `next-token-loss`")


def test_a_knob_named_like_a_primitive_std_calls_leaves_std_alone():
  # the standard library has its own namespace: std/moe's (top-k ...) is still the primitive
  text = _config("moe-lm.sx", '(defknob experts-per-token 2', '(defknob top-k 2')
  text = text.replace(":k experts-per-token", ":k top-k")
  compile_source(text, "exp.sx", base_dir=CONFIGS)


def test_a_def_named_like_a_primitive_is_e_name_002_at_the_call():
  text = _config("tiny-lm.sx", "(defn lm [tokens]", "(def matmul 3)\n(defn lm [tokens]")
  text = text.replace("(next-token-loss (lm (lm-inputs t)) t)",
                      "(next-token-loss (lm (lm-inputs t)) (matmul t t))")
  err = _compile_error(text)
  assert err.code == "E-NAME-002" and "the def `matmul` hides the primitive" in err.message
  assert str(err.location) == "exp.sx:23:42"  # the user's call: std's own calls see no def


def test_a_knob_named_like_an_uncalled_primitive_and_a_local_binding_still_compile():
  # ssm-lm's knob `expand` is never called; a let's local `max` is the user's own business
  compile_source(_config("ssm-lm.sx"), "exp.sx", base_dir=CONFIGS)
  text = _config("tiny-lm.sx", "(let [t (get batch :tokens)]", "(let [t (get batch :tokens) max 3]")
  text = text.replace("(next-token-loss (lm (lm-inputs t)) t)", "(max (lm (lm-inputs t)) t)")
  err = _compile_error(text)
  assert err.code == "E-TYPE-001" and "`max` is not a function" in err.message

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


# --- optimizer and schedule values ---------------------------------------------------------

@pytest.mark.parametrize("optimizer,message", [
    ("(adamw :lr (warmup-cosine :peak 0.01 :warmup -5))",
     "warmup-cosine :warmup is the number -5; it must be an integer from 0 to 2147483647"),
    ("(adamw :lr (warmup-linear :peak 0.01 :warmup -9223372036854775808))",
     "warmup-linear :warmup is the number -9223372036854775808; it must be an integer from 0 "
     "to 2147483647"),
    ("(adamw :lr (rsqrt :peak 0.01 :warmup 2.5))",
     "rsqrt :warmup is the number 2.5; it must be an integer from 0 to 2147483647"),
    ('(adamw :lr (warmup-cosine :peak "x"))',
     'warmup-cosine :peak is the string "x"; it must be a number from 0 to 3.4e38 '
     "(float32's largest)"),
    ("(adamw :lr (warmup-cosine :peak 0.01 :steps 0))",
     "warmup-cosine :steps is the number 0; it must be an integer from 1 to 2147483647"),
    ("(adamw :lr -1)", "adamw :lr is the number -1; it must be a number from 0 to 3.4e38 "
     "(float32's largest)"),
    ("(adamw :lr (constant -0.5))", "adamw :lr is the number -0.5; it must be a number from 0 "
     "to 3.4e38 (float32's largest)"),
    ("(adam :lr 0.01 :b1 1)", "adam :b1 is the number 1; it must be a number at least 0 and "
     "below 1"),
    ('(adamw :lr 0.01 :b2 "x")', 'adamw :b2 is the string "x"; it must be a number at least 0 '
     "and below 1"),
    ("(sgd :lr 0.01 :clip 0)", "sgd :clip is the number 0; it must be a number above 0 and at "
     "most 3.4e38 (float32's largest)"),
    ("(sgd :lr 0.01 :nesterov 1)", "sgd :nesterov is the number 1; it is true or false"),
    ("(adafactor :lr 0.01 :min-dim-size-to-factor 0)", "adafactor :min-dim-size-to-factor is "
     "the number 0; it must be an integer from 1 to 2147483647"),
])
def test_an_optimizer_value_out_of_range_is_e_run_002_at_the_value(optimizer, message):
  text = _config("tiny-lm.sx", "(adamw :lr lr :weight-decay 0.0)", optimizer)
  err = _compile_error(text)
  assert err.code == "E-RUN-002" and err.message == message
  assert err.location.line == 27 and err.location.file == "exp.sx"
  key = message.split(" :")[1].split(" ")[0]
  value_col = err.location.col - 1
  line = text.split("\n")[26]
  assert line[:value_col].rstrip().endswith(":" + key)


def test_optimizer_values_in_range_reach_optax_as_written():
  from sexpgpu.lower.optim import make_optimizer
  text = _config("tiny-lm.sx", "(adamw :lr lr :weight-decay 0.0)",
                 "(adamw :lr (warmup-cosine :peak 0.01 :warmup 4.0 :floor 0.1) :b1 0 :b2 0.5)")
  c = compile_source(text, "exp.sx", base_dir=CONFIGS)
  assert dict(c.exp.optimizer.get("lr").args)["warmup"] == 4
  assert type(dict(c.exp.optimizer.get("lr").args)["warmup"]) is int
  _, sched = make_optimizer(c.exp.optimizer, 20)
  assert [round(float(sched(i)), 6) for i in (0, 2, 4)] == [0.0, 0.005, 0.01]


# --- numbers and values on the command line ------------------------------------------------

def _cli(capsys, *args):
  from sexpgpu.cli.main import main
  code = main(list(args))
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err
  return code, out, err


@pytest.mark.parametrize("args,message,fix", [
    (["--eval-every", "0x10"], "--eval-every is `0x10`; it must be a decimal integer", "16"),
    (["--steps=1_000"], "--steps is `1_000`; it must be a decimal integer", "1000"),
    (["--steps", "0o17"], "--steps is `0o17`; it must be a decimal integer", "15"),
    (["--steps", "9" * 30], "--steps is `" + "9" * 30 + "`; it must be a decimal integer", "100"),
    (["--steps", "-h"], "--steps needs a value; found the flag `-h`", "--steps=-h"),
    (["--variant", "--help"], "--variant needs a value; found the flag `--help`", "--variant="),
    (["--set", "--steps=3"], "--set needs a value; found the flag `--steps=3`", "--set="),
])
def test_a_flags_value_is_decimal_and_never_another_flag(capsys, args, message, fix):
  tiny = os.path.join(CONFIGS, "tiny-lm.sx")
  code, out, err = _cli(capsys, "check", tiny, *args)
  assert code == 1 and out == ""
  assert "error[E-FORM-001]: sexpgpu check: " + message in err
  assert "= fix: " in err and fix in err.split("= fix: ")[1]
  assert "usage:" not in err + out


def test_a_float_flag_refuses_nan_and_infinity(capsys, tmp_path):
  code, out, err = _cli(capsys, "watch", str(tmp_path / "status.json"), "--interval", "nan")
  assert code == 1 and "--interval is `nan`; it must be a finite decimal number" in err
  code, out, err = _cli(capsys, "watch", str(tmp_path / "status.json"), "--timeout=inf")
  assert code == 1 and "--timeout is `inf`; it must be a finite decimal number" in err


def test_help_still_answers_where_a_flag_stands_and_negative_numbers_are_values(capsys):
  tiny = os.path.join(CONFIGS, "tiny-lm.sx")
  code, out, _ = _cli(capsys, "check", tiny, "--steps", "3", "-h")
  assert code == 0 and out.startswith("usage: sexpgpu check")
  code, _, err = _cli(capsys, "check", tiny, "--steps", "-5")
  assert code == 1 and "error[E-KNOB-003]: knob steps = -5 is below its minimum 0" in err
  from sexpgpu.cli.main import parse_flags, _run_flags
  fv = _run_flags()
  assert parse_flags(fv, ["--steps", "+12", "--eval-every=007", "x.sx"], "run") == ["x.sx"]
  assert (fv.steps, fv.eval_every) == (12, 7)


# --- a fixed stacking degree ---------------------------------------------------------------

def test_a_stacking_degree_that_does_not_divide_is_e_env_001_before_any_compile(
    capsys, monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_STACKING", "3")
  monkeypatch.chdir(tmp_path)
  code, out, err = _cli(capsys, "run", os.path.join(CONFIGS, "tiny-lm.sx"), "--steps", "2",
                        "--metrics", f"jsonl:{tmp_path / 'm.jsonl'}")
  assert code == 1
  assert ("error[E-ENV-001]: SEXPGPU_STACKING=3 does not divide the 2 microbatches each rank "
          "runs in a step\n  --> SEXPGPU_STACKING\n   = fix: unset it (auto), or use a divisor: "
          "SEXPGPU_STACKING=2, SEXPGPU_STACKING=1\n") in err


def test_check_refuses_the_stacking_degree_that_run_refuses(capsys, monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_STACKING", "3")
  for argv in (("check",), ("check", "--print", "plan")):
    code, out, err = _cli(capsys, *argv, os.path.join(CONFIGS, "tiny-lm.sx"))
    assert code == 1, argv
    assert "error[E-ENV-001]: SEXPGPU_STACKING=3 does not divide the 2 microbatches" in err
  monkeypatch.setenv("SEXPGPU_STACKING", "2")
  code, out, err = _cli(capsys, "check", os.path.join(CONFIGS, "tiny-lm.sx"))
  assert code == 0, err


def test_check_fixed_names_every_divisor():
  from sexpgpu.run.plan import check_fixed
  check_fixed(3, 6)
  with pytest.raises(SxError) as e:
    check_fixed(4, 6)
  assert e.value.fix.endswith("SEXPGPU_STACKING=6, SEXPGPU_STACKING=3, SEXPGPU_STACKING=2, "
                              "SEXPGPU_STACKING=1")
  with pytest.raises(SxError) as e:
    check_fixed(2, 1)
  assert "the 1 microbatch each rank" in e.value.message


# --- long source lines in an error ---------------------------------------------------------

def _caret_under(rendered: str) -> tuple[str, str]:
  """The quoted source line and the text its caret marks."""
  lines = rendered.split("\n")
  i = next(i for i, l in enumerate(lines) if l.strip().startswith("|") and "^" in l)
  src, caret = lines[i - 1], lines[i]
  src_text = src.split(" | ", 1)[1]
  marks = caret.split("| ", 1)[1]
  start = len(marks) - len(marks.lstrip(" "))
  return src_text, src_text[start:start + len(marks.strip())]


def test_a_long_line_is_cut_around_the_column_and_the_caret_stays_on_the_name():
  filler = " ".join(["(+ 1 2)"] * 60)
  text = _config("tiny-lm.sx", "(next-token-loss (lm (lm-inputs t)) t)",
                 f"(do {filler} (next-token-los (lm (lm-inputs t)) t) {filler})")
  err = _compile_error(text)
  src, marked = _caret_under(str(err))
  assert marked == "next-token-los"
  assert src.startswith("...") and src.endswith("...") and len(src) == 106
  assert err.location.col > 400  # the column is still the true one


def test_the_start_and_end_of_a_long_line_are_cut_on_one_side_only():
  from sexpgpu.errors import Loc, register_source
  line = "(def a " + "1" * 300 + ") ; " + "x" * 200
  register_source("long.sx", line + "\r\n")
  first = SxError("E-FORM-001", "m", location=Loc("long.sx", 1, 2, 1, 5))
  src, marked = _caret_under(str(first))
  assert marked == "def" and src == line[:100] + "..."
  last = SxError("E-FORM-001", "m", location=Loc("long.sx", 1, len(line) - 9))
  src, marked = _caret_under(str(last))
  assert src == "..." + line[-100:] and marked == "x" * 10
  short = SxError("E-FORM-001", "m", location=Loc("long.sx", 1, 8, 1, 11))
  assert "1 | " + line[:100] + "...\n" in str(short)


# --- cross-entropy over a mask with no true position ---------------------------------------

def test_cross_entropy_over_an_all_false_mask_is_nan_chunked_or_not():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from sexpgpu.ir.ops import OPS, LowerCtx
  from sexpgpu.lower.registry import lowering
  ctx = LowerCtx()
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 40)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 40, (2, 5)), jnp.int32)
  none = jnp.zeros((2, 5), bool)
  plain = OPS["cross-entropy"].lower(ctx, OPS["matmul"].lower(ctx, h, w), y, none)
  chunked = jax.jit(lambda h, w: lowering("chunked-cross-entropy", "cpu")(
      ctx, h, w, y, none, chunks=3))(h, w)
  assert np.isnan(float(plain)) and np.isnan(float(chunked))
  one = none.at[0, 0].set(True)  # one true position: its own loss, chunked as not
  a = OPS["cross-entropy"].lower(ctx, OPS["matmul"].lower(ctx, h, w), y, one)
  b = lowering("chunked-cross-entropy", "cpu")(ctx, h, w, y, one, chunks=3)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  assert np.isfinite(float(a))


# --- a keyword given twice ------------------------------------------------------------------

def test_a_keyword_given_twice_is_e_form_001_naming_both_places():
  err = _compile_error(_config("tiny-lm.sx", "(defrun :loss loss", "(defrun :seed 3 :loss loss"))
  assert err.code == "E-FORM-001"
  assert err.message == "keyword :seed is given twice (first at exp.sx:26:9)"
  assert str(err.location) == "exp.sx:28:24" and err.fix == "keep one :seed"
  err = _compile_error(_config("tiny-lm.sx", ":batch 4 :seed 7))", ":batch 4 :batch 8 :seed 7))"))
  assert err.code == "E-FORM-001" and "keyword :batch is given twice" in err.message


def test_absls_flagfile_is_no_flag_of_sexpgpu(capsys, tmp_path, monkeypatch):
  """absl would read any file as flags: the environment of /proc/self/environ became the
  experiment's path, printed whole in the error."""
  monkeypatch.setenv("SXTESTSECRET", "hunter2")
  for flag in ("--flagfile=/proc/self/environ", "-flagfile=/proc/self/environ",
               "--undefok=steps"):
    code, out, err = _cli(capsys, "check", flag)
    assert code == 1 and "hunter2" not in err + out
    assert f"error[E-FORM-001]: sexpgpu check has no flag --{flag.lstrip('-').split('=')[0]}" in err

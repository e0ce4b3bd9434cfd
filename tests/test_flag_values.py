"""Command-line flag values: decimal integers only, never another flag, finite floats, in
range with the range and a valid example told, `-h` answered wherever it stands, negative
numbers taken as values, and absl's --flagfile/--undefok no flags of sexpgpu."""

from __future__ import annotations

import os

import pytest

from conftest import ROOT
from test_std_namespace import CONFIGS

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


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


def test_absls_flagfile_is_no_flag_of_sexpgpu(capsys, tmp_path, monkeypatch):
  """absl would read any file as flags: the environment of /proc/self/environ became the
  experiment's path, printed whole in the error."""
  monkeypatch.setenv("SXTESTSECRET", "hunter2")
  for flag in ("--flagfile=/proc/self/environ", "-flagfile=/proc/self/environ",
               "--undefok=steps"):
    code, out, err = _cli(capsys, "check", flag)
    assert code == 1 and "hunter2" not in err + out
    assert f"error[E-FORM-001]: sexpgpu check has no flag --{flag.lstrip('-').split('=')[0]}" in err


# --- a flag's value out of range gets a range and a valid example ----------------------------

@pytest.mark.parametrize("args,example", [
    (["check", TINY, "--steps", "9" * 20], "--steps 100 (from 0 to 2147483647)"),
    (["check", TINY, "--eval-every", "-" + "9" * 20], "--eval-every 100 (from 0 to 2147483647)"),
    (["check", TINY, "--steps", "0x10"], "--steps 16 (from 0 to 2147483647)"),
    (["check", TINY, "--target", "cuda", "--devices", "9" * 20],
     "--devices 100 (from 1 to 2147483647)"),
    (["sweep", TINY, "--parallel", "0"], "--parallel 1 (from 1 to 9223372036854775807)"),
    (["tokenize", "x.txt", "-o", "cache", "--workers", "-5"],
     "--workers 100 (from 1 to 9223372036854775807)"),
])
def test_a_flag_out_of_range_is_told_its_range_and_a_valid_example(capsys, args, example):
  code, out, err = _cli(capsys, *args)
  bad = args[-1]
  assert code == 1 and out == "" and "error[E-FORM-001]" in err
  fix = err.split("= fix: ")[1].strip()
  assert fix == "write " + example and f"{args[-2]} {bad}" not in fix

"""Every input gets an answer: an error code with its place and a fix, or a run."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.cli.main import main

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def cli(capsys, *args):
  """Runs `sexpgpu ARGS` in this process: (exit code, stdout, stderr)."""
  code = main(list(args))
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err
  return code, out, err


def tiny(tmp_path, old=None, new=None, name="exp.sx"):
  text = open(TINY, encoding="utf-8").read()
  if old is not None:
    assert old in text
    text = text.replace(old, new)
  p = tmp_path / name
  p.write_text(text, encoding="utf-8")
  return str(p)


# --- files ---------------------------------------------------------------------------------

def test_binary_file_is_a_read_error(tmp_path, capsys):
  p = tmp_path / "bin.sx"
  p.write_bytes(b"(defknob a 1)\n\xff\xfe\x00\x01")
  code, _, err = cli(capsys, "check", str(p))
  assert code == 1 and "error[E-READ-003]" in err and "not UTF-8" in err
  assert f"{p}:2:1" in err


def test_byte_order_mark_is_skipped(tmp_path, capsys):
  p = tmp_path / "bom.sx"
  p.write_bytes(b"\xef\xbb\xbf" + open(TINY, "rb").read())
  code, out, err = cli(capsys, "check", str(p))
  assert code == 0, err
  assert out.startswith("check:")


def test_directory_is_not_an_experiment(tmp_path, capsys):
  (tmp_path / "x.sx").mkdir()
  code, _, err = cli(capsys, "check", str(tmp_path / "x.sx"))
  assert code == 1 and "error[E-REQ-001]" in err and "is a directory" in err


def test_required_directory(tmp_path, capsys):
  (tmp_path / "lib.sx").mkdir()
  p = tiny(tmp_path, "(require std/lm)", '(require std/lm)\n(require "lib.sx")')
  code, _, err = cli(capsys, "check", p)
  assert code == 1 and "error[E-REQ-001]" in err


def test_nesting_5000_deep_is_a_read_error(tmp_path, capsys):
  p = tmp_path / "deep.sx"
  p.write_text("(def x " + "(" * 5000 + ")" * 5000 + ")")
  code, _, err = cli(capsys, "check", str(p))
  assert code == 1 and "error[E-READ-001]" in err and "nest more than 1000" in err


def test_relu_500_deep_builds(tmp_path, capsys):
  p = tiny(tmp_path, "(next-token-loss (lm (lm-inputs t)) t)",
           "(next-token-loss " + "(relu " * 500 + "(lm (lm-inputs t))" + ")" * 500 + " t)")
  code, out, err = cli(capsys, "check", p)
  assert code == 0, err


def test_recursion_without_end_is_an_error(tmp_path, capsys):
  p = tiny(tmp_path, "(defn loss [batch]", "(defn f [x] (f x))\n(defn loss [batch] (f 1)")
  code, _, err = cli(capsys, "check", p)
  assert code == 1 and "error[E-FORM-001]" in err and "too deeply" in err
  assert "exp.sx:" in err


# --- numbers -------------------------------------------------------------------------------

def test_huge_integer_literal(tmp_path, capsys):
  p = tiny(tmp_path, "(defknob seq 16", "(defknob big 99999999999999999999)\n(defknob seq 16")
  code, _, err = cli(capsys, "check", p)
  assert code == 1 and "error[E-READ-003]" in err and "64 bits" in err


def test_float_literal_beyond_range(tmp_path, capsys):
  p = tiny(tmp_path, "(defknob lr 0.01", "(defknob lr 1e400")
  code, _, err = cli(capsys, "check", p)
  assert code == 1 and "error[E-READ-003]" in err and "finite" in err


@pytest.mark.parametrize("value", ["99999999999999999999", "-99999999999999999999"])
def test_huge_set_integer(capsys, value):
  code, _, err = cli(capsys, "check", TINY, "--set", f"seed={value}")
  assert code == 1 and "error[E-KNOB-002]" in err and f"--set seed={value}" in err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999", "1e308"])
def test_non_finite_set_is_refused(capsys, value):
  code, _, err = cli(capsys, "check", TINY, "--set", f"lr={value}")
  assert code == 1 and "error[E-KNOB-002]" in err and "finite" in err


def test_negative_seed(capsys):
  code, _, err = cli(capsys, "check", TINY, "--set", "seed=-1")
  assert code == 1 and "error[E-KNOB-003]" in err


@pytest.mark.parametrize("flag", [["--steps", "-1"], ["--eval-every", "-2"]])
@pytest.mark.parametrize("command", ["check", "run"])
def test_negative_steps_and_eval_every(capsys, command, flag):
  code, _, err = cli(capsys, command, TINY, *flag)
  assert code == 1 and "error[E-KNOB-003]" in err and f"--{flag[0][2:]} {flag[1]}" in err


# --- knob values the model cannot take ------------------------------------------------------

def test_width_zero_without_min(tmp_path, capsys):
  p = tiny(tmp_path, ' :min 8', '')
  code, _, err = cli(capsys, "check", p, "--set", "width=0")
  assert code == 1 and "error[E-KNOB-003]" in err and "knob width = 0" in err
  assert "--> --set width=0" in err


def test_width_must_divide_by_heads(capsys):
  code, _, err = cli(capsys, "check", TINY, "--set", "width=43")
  assert code == 1 and "error[E-KNOB-003]" in err
  assert "knob width = 43 must divide by heads = 4" in err
  assert "--> --set width=43" in err and "44" in err


def test_width_in_the_file_must_divide_by_heads(tmp_path, capsys):
  p = tiny(tmp_path, "(defknob width 64", "(defknob width 42")
  code, _, err = cli(capsys, "check", p)
  assert code == 1 and "must divide by heads = 4" in err
  assert f"--> {p}:6:1" in err  # the defknob, not std/nn.sx


def test_negative_width_is_placed_at_the_user(tmp_path, capsys):
  p = tiny(tmp_path, ' :min 8', '')
  code, _, err = cli(capsys, "check", p, "--set", "width=-5")
  assert code == 1 and "--> --set width=-5" in err
  assert err.splitlines()[1].strip() == "--> --set width=-5"
  assert "passed at: " + p in err


# --- data ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.zeros((8, 2), np.complex128), np.array(["a"] * 8)])
def test_npz_of_complex_or_strings(tmp_path, capsys, bad):
  np.savez(tmp_path / "d.npz", x=bad, y=np.zeros(8, np.int64))
  p = tmp_path / "e.sx"
  p.write_text('(defloader train (arrays "d.npz" :fields [x y] :batch 4))\n'
               '(defn loss [b] (mean (get b :x)))\n'
               '(defrun :loss loss :data train :steps 1 :optimizer (sgd :lr 0.1))\n')
  code, _, err = cli(capsys, "check", str(p))
  assert code == 1 and "error[E-LOAD-001]" in err and bad.dtype.name in err


def test_npz_of_small_integers_loads(tmp_path, capsys):
  np.savez(tmp_path / "d.npz", x=np.ones((8, 2), np.float16), y=np.zeros(8, np.uint8))
  p = tmp_path / "e.sx"
  p.write_text('(defloader train (arrays "d.npz" :fields [x y] :batch 4))\n'
               '(defn loss [b] (mean (cast (get b :x) f32)))\n'
               '(defrun :loss loss :data train :steps 1 :optimizer (sgd :lr 0.1))\n')
  code, out, err = cli(capsys, "check", str(p))
  assert code == 0, err


# --- tools ---------------------------------------------------------------------------------

def test_plot_of_a_binary_file(tmp_path, capsys):
  p = tmp_path / "m.jsonl"
  p.write_bytes(bytes(range(256)) * 4)
  code, _, err = cli(capsys, "plot", str(p), "-o", str(tmp_path / "c.png"))
  assert code == 1 and "error[E-METRICS-001]" in err and "is not UTF-8 text" in err


def test_watch_of_a_missing_file_ends(tmp_path, capsys):
  t0 = time.monotonic()
  code, _, err = cli(capsys, "watch", str(tmp_path / "none.json"), "--wait", "0.5")
  assert code == 1 and time.monotonic() - t0 < 10
  assert "waiting up to 0.5s" in err and "error[E-METRICS-001]" in err and "does not exist" in err


def test_sweep_takes_status(tmp_path, capsys):
  code, out, err = cli(capsys, "sweep", TINY, "--variant", "smoke", "--set", "lr=0.01",
                       "--steps", "1", "--eval-every", "0", "--status", str(tmp_path / "st"),
                       "--emit", "skypilot", str(tmp_path / "tasks"))
  assert code == 0, err


@pytest.mark.slow  # a run in a subprocess
def test_json_is_compact(capsys):
  code, out, err = cli(capsys, "run", TINY, "--variant", "smoke", "--steps", "1",
                       "--eval-every", "0", "--json")
  assert code == 0, err
  line = out.strip().splitlines()[-1]
  assert line.startswith('{"kind":"summary","steps":1,"train_loss":') and ", " not in line
  assert json.loads(line)["steps"] == 1


@pytest.mark.slow  # a bundle run in a subprocess
def test_bundle_without_data_finds_it_beside_the_archive(tmp_path, capsys):
  sxb = tmp_path / "made" / "run.sxb"
  code, _, err = cli(capsys, "bundle", "configs/classifier.sx" if os.getcwd() == ROOT else
                     os.path.join(ROOT, "configs", "classifier.sx"), "--variant", "smoke",
                     "-o", str(sxb))
  assert code == 0, err
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  shutil.copy(sxb, elsewhere / "run.sxb")
  code, _, err = cli(capsys, "run", str(elsewhere / "run.sxb"), "--steps", "1",
                     "--eval-every", "0")
  assert code == 1 and "error[E-LOAD-001]" in err and "--with-data" in err
  assert "data/blobs.npz" in err
  shutil.copy(os.path.join(ROOT, "configs", "data", "blobs.npz"), elsewhere / "blobs.npz")
  code, _, err = cli(capsys, "run", str(elsewhere / "run.sxb"), "--steps", "1",
                     "--eval-every", "0")
  assert code == 0, err


# --- pipes ---------------------------------------------------------------------------------

@pytest.mark.slow  # a run with its standard error closed, as a subprocess
def test_closed_standard_error_is_no_crash(tmp_path):
  """`sexpgpu run ... 2>&1 | head -1`: the run goes on and ends `done`, checkpoint written."""
  status = tmp_path / "s.json"
  cmd = sexpgpu_cmd("run", TINY, "--variant", "smoke", "--steps", "30", "--eval-every", "10",
                    "--status", str(status), "--checkpoint-dir", str(tmp_path / "ck"))
  # (with --json the summary would be lost with the pipe: that is E-METRICS-001, exit 1,
  # tests/test_json_summary.py)
  p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  first = p.stdout.readline()
  p.stdout.close()  # what `head -1` does after its line
  code = p.wait(timeout=300)
  assert first.startswith(b"run: ")
  assert code == 0
  st = json.loads(status.read_text())
  assert st["state"] == "done" and st["step"] == 30
  assert st["checkpoint"] and st["checkpoint"]["step"] == 30


@pytest.mark.parametrize("value", ["4294967296", "9223372036854775807"])
def test_integer_knob_beyond_int32(capsys, value):
  """Found by benchmarks/fuzz.py: such a layer count overflowed inside a jitted call."""
  code, _, err = cli(capsys, "run", TINY, "--variant", "smoke", "--steps", "1",
                     "--set", f"layers={value}")
  assert code == 1 and "error[E-KNOB-003]" in err and "32-bit" in err


def test_seed_may_be_64_bit(capsys):
  code, _, err = cli(capsys, "check", TINY, "--set", "seed=9223372036854775807")
  assert code == 0, err


def test_a_shape_past_int32_is_refused_at_its_place_before_lowering():
  from sexpgpu.errors import SxError
  from sexpgpu.run.compile import compile_source
  text = open(TINY, encoding="utf-8").read().replace(
      "(transformer-lm tokens :vocab vocab :width width :layers layers :heads heads)",
      "(let [h (transformer-lm tokens :vocab vocab :width width :layers layers :heads heads)]"
      " (+ h (mean (matmul h (param huge [vocab 2147483648] :init zeros)))))")
  with pytest.raises(SxError) as e:
    compile_source(text, "tiny-lm.sx", base_dir=os.path.dirname(TINY))
  assert e.value.code == "E-SHAPE-001" and "2147483648" in e.value.render()
  assert e.value.location is not None

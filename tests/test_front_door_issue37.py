"""Issue 37's smaller findings: a pass past its loader's split, a long pass that says how far
it is and stops on a signal, flag values out of range, a checkpoint location that already
holds the slug, a step folder a full disk leaves, and a layout refused for its microbatches."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.run import output, passes

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")

_PASS_EXP = """(require std/nn)
(require std/lm)
(defloader train (markov :vocab 32 :seq 17 :batch 4 :seed 7))
(defloader valid VALID)
(defn lm [tokens] (transformer-lm tokens :vocab 32 :width 32 :layers 1 :heads 4))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defpass eval :data valid :every 2 :batches BATCHES :metrics [loss])
(defrun :loss loss :data train :steps 2 :microbatches 2 :optimizer (adamw :lr 0.01) :seed 1)
"""
_FILE_LOADER = '(tokens "t.bin" :dtype u16 :seq 17 :batch 4 :split [0.5 1.0])'
_MARKOV_LOADER = "(markov :vocab 32 :seq 17 :batch 4 :seed 7 :stream 1)"


def _pass_exp(tmp_path, batches, loader=_FILE_LOADER) -> str:
  """An experiment whose pass reads `batches` from `loader`; t.bin holds 1000 tokens, so the
  split [0.5 1.0] holds 29 windows of 17: 7 whole microbatches of 4."""
  (np.arange(1000) % 32).astype(np.uint16).tofile(tmp_path / "t.bin")
  p = tmp_path / "exp.sx"
  p.write_text(_PASS_EXP.replace("VALID", loader).replace("BATCHES", str(batches)))
  return str(p)


def _cli(capsys, *args):
  code = main(list(args))
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err
  return code, out, err


# --- finding 6: a pass's :batches against its loader's split --------------------------------

def test_a_pass_past_its_loaders_split_is_e_load_005_at_its_batches(tmp_path, capsys):
  exp = _pass_exp(tmp_path, 100000000)
  ckpt = tmp_path / "ckpt"
  code, _, err = _cli(capsys, "run", exp, "--checkpoint-dir", str(ckpt))
  assert code == 1 and "error[E-LOAD-005]" in err
  assert "reads :batches 100000000 microbatches of 4 from loader `valid`" in err
  assert "whose split holds 29 records: 7 whole microbatches" in err
  assert f"--> {exp}:7:45" in err and f"= loader: {exp}:4:18" in err
  assert "= fix: :batches 7 reads the split of `valid` once" in err
  assert "step 0" not in err  # refused before anything was computed
  assert [p.name for p in ckpt.rglob("*") if p.is_file() or p.name.isdigit()] == []
  code, _, checked = _cli(capsys, "check", exp)  # check refuses what run would
  assert code == 1 and checked.splitlines()[:2] == err.splitlines()[:2]


def test_a_pass_of_its_whole_split_runs_and_one_more_is_refused(tmp_path):
  c = sexpgpu.compile(_pass_exp(tmp_path, 7))
  s = c.run(steps=2)
  assert s.steps == 2 and np.isfinite(s.eval["eval/loss"])
  with pytest.raises(sexpgpu.SxError) as e:
    sexpgpu.compile(_pass_exp(tmp_path, 8))
  assert e.value.code == "E-LOAD-005" and "7 whole microbatches" in e.value.message


def test_batches_past_an_int32_are_refused_where_they_are_written(tmp_path, capsys):
  exp = _pass_exp(tmp_path, 2**31, _MARKOV_LOADER)
  code, _, err = _cli(capsys, "check", exp)
  assert code == 1 and "error[E-TYPE-001]" in err and f"--> {exp}:7:45" in err
  assert ":batches 2147483648 is past the most a pass reads, 2147483647" in err
  assert "= fix: :batches from 1 to 2147483647, such as :batches 100" in err


def test_a_long_pass_on_an_endless_loader_says_how_far_it_is(tmp_path, capfd, monkeypatch):
  # every batch past the first is "long" here: a line after each but the last
  monkeypatch.setattr(passes, "PASS_PROGRESS_SECONDS", 0.0)
  s = sexpgpu.compile(_pass_exp(tmp_path, 5, _MARKOV_LOADER)).run(steps=2, quiet=False)
  err = capfd.readouterr().err
  lines = [ln for ln in err.splitlines() if ln.startswith("eval: batch ")]
  # two passes (step 0 and step 2), four lines each
  assert [ln.split(",")[0] for ln in lines] == [
      f"eval: batch {i}/5 at step {st}" for st in (0, 2) for i in range(1, 5)]
  assert all("batches/s, about " in ln and ln.endswith(" left") for ln in lines)
  assert s.steps == 2 and np.isfinite(s.eval["eval/loss"])


def test_a_stop_during_a_long_pass_ends_it_without_numbers(tmp_path, capfd, monkeypatch):
  monkeypatch.setattr(passes, "PASS_PROGRESS_SECONDS", 0.0)
  real = output.err
  sent = []

  def err_then_stop(line):
    real(line)
    if line.startswith("eval: batch 3/") and not sent:
      sent.append(line)
      os.kill(os.getpid(), signal.SIGINT)  # recorded by the run's handler

  monkeypatch.setattr(output, "err", err_then_stop)
  exp = _pass_exp(tmp_path, 100000000, _MARKOV_LOADER)
  s = sexpgpu.compile(exp).run(steps=2, quiet=False, checkpoint_dir=str(tmp_path / "ckpt"))
  err = capfd.readouterr().err
  assert sent and s.stopped_by == "SIGINT" and s.steps == 0
  assert ("eval: stopped by SIGINT after 3 of 100000000 batches at step 0; the pass's numbers "
          "are not written") in err
  assert "eval/loss" not in s.eval
  # the checkpoint says its step's passes were cut short: a resume runs them again (and
  # then the curriculum's decision), where a resume of a whole step skips them
  sent.clear()
  again = sexpgpu.compile(exp).run(steps=2, quiet=False, checkpoint_dir=str(tmp_path / "ckpt"),
                                   resume="latest")
  err = capfd.readouterr().err
  assert sent and again.stopped_by == "SIGINT" and again.steps == 0
  assert "eval: batch 1/100000000 at step 0" in err
  assert "eval: stopped by SIGINT after 3 of 100000000 batches at step 0" in err


# --- finding 14 (a): a flag's value out of range gets a range and a valid example -------------

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


# --- planning: a layout refused for its microbatches is not one that does not fit -----------

def test_no_layout_because_the_microbatches_do_not_divide_is_e_dp_003(capsys):
  code, out, err = _cli(capsys, "check", TINY, "--target", "cuda", "--gpu", "H100", "--devices",
                        "64", "--set", "sharding=auto")
  assert code == 1 and out == "" and "error[E-DP-003]" in err and "E-MEM-001" not in err
  assert "on 64 devices divides the 2 microbatches over its data-parallel ranks" in err
  assert "fsdp:16,tensor:4 +remat (16 ranks, " in err  # the layouts that would fit, named
  fix = err.split("= fix: ")[1].strip()
  assert fix == ("--set microbatches=16 (fsdp:16,tensor:4 +remat then runs 1 on each of its 16 "
                 "data-parallel ranks), or --devices 8 (data:2,tensor:4) or 4 (data:2,tensor:2) "
                 "or 2 (replicate)")


def test_the_microbatches_fix_plans(capsys):
  code, out, _ = _cli(capsys, "check", TINY, "--target", "cuda", "--gpu", "H100", "--devices",
                      "64", "--set", "sharding=auto", "--set", "microbatches=16")
  assert code == 0 and "on 64 × H100" in out and "\n    chosen    " in out
  code, out, _ = _cli(capsys, "check", TINY, "--target", "cuda", "--gpu", "H100", "--devices",
                      "8", "--set", "sharding=auto")
  assert code == 0 and "plan on paper" in out


def test_a_model_too_big_for_any_layout_is_still_e_mem_001(capsys):
  code, _, err = _cli(capsys, "check", os.path.join(ROOT, "configs", "llama3-70b.sx"), "--target",
                      "cuda", "--gpu", "H100", "--devices", "8", "--set", "sharding=auto")
  assert code == 1 and "error[E-MEM-001]: no layout of :sharding auto fits" in err
  assert "E-DP-003" not in err


# --- finding 14 (b): a run without --resume into a location holding its slug -----------------

FAULTS = os.path.join(ROOT, "tests", "data", "faults.sx")  # checkpoints every 4 steps


def _files(folder):
  return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # runs and checkpoints in subprocesses
def test_a_run_without_resume_into_its_own_checkpoints_is_refused_touching_nothing(
    tmp_path, capsys):
  ck = tmp_path / "ck"
  code, _, err = _cli(capsys, "run", FAULTS, "--steps", "8", "--checkpoint-dir", str(ck))
  assert code == 0, err
  before = _files(ck / "faults")
  code, _, err = _cli(capsys, "run", FAULTS, "--steps", "8", "--checkpoint-dir", str(ck))
  assert code == 1 and "error[E-CKPT-006]" in err
  assert (f"{ck}/faults already holds run faults's checkpoints (steps 4, 8), and this run "
          "does not resume") in err
  assert (f"= fix: --resume latest continues from step 8; to start over, give another "
          f"--checkpoint-dir or SEXPGPU_RUN_SLUG, or remove {ck}/faults") in err
  assert "step 0" not in err and _files(ck / "faults") == before  # nothing rewritten
  # what the fix says works: the run continues, and another slug starts beside it
  code, _, err = _cli(capsys, "run", FAULTS, "--steps", "12", "--checkpoint-dir", str(ck),
                      "--resume", "latest")
  assert code == 0 and "resume latest=" in err
  code, _, err = _cli(capsys, "run", FAULTS, "--steps", "4", "--checkpoint-dir", str(ck),
                      "--set", "width=8")
  assert code == 0, err
  assert sorted(p.name for p in ck.iterdir()) == ["faults", "faults-width=8"]


# --- finding 14 (c): a full disk's partial step folder goes with the run that hit it --------

@pytest.mark.slow  # runs and checkpoints in subprocesses
def test_a_full_disk_leaves_no_partial_step_and_keeps_the_good_one(tmp_path):
  """The checkpoint folder is a 300 KiB tmpfs: step 4 fits, step 8 does not (as
  tests/test_ckpt_faults.py's full disk). The failed save's folder is gone when the run
  exits; step 4 is as it was written."""
  import subprocess

  from conftest import sexpgpu_cmd
  from sexpgpu.ckpt import manifest
  disk, kept = tmp_path / "disk", tmp_path / "kept"
  disk.mkdir()
  probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs "
                          f"{disk}"], capture_output=True, timeout=30)
  if probe.returncode != 0:
    pytest.skip("no mount namespace for a small tmpfs (needs root and unshare)")
  cmd = " ".join(f"'{a}'" for a in sexpgpu_cmd("run", FAULTS, "--checkpoint-dir", str(disk)))
  script = (f"mount -t tmpfs -o size=300k tmpfs {disk} && {{ {cmd}; echo $? > {tmp_path / 'rc'}; "
            f"cp -a {disk} {kept}; }}")
  r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True,
                     text=True, timeout=300)
  assert (tmp_path / "rc").read_text().strip() == "1", r.stderr
  assert "error[E-CKPT-004]" in r.stderr and "the device is full" in r.stderr
  assert sorted(os.listdir(kept / "faults")) == ["4"]
  assert manifest.problem(str(kept / "faults" / "4")) is None


def test_a_failed_saves_leftovers_go_and_nothing_else(tmp_path):
  """What manifest.drop_partial removes: the failed step's tmp, partial and uncounted
  folders; never a complete step, another step's, or a folder with the user's files."""
  from sexpgpu.ckpt import manifest
  run = tmp_path / "run"
  for name, files in {"4": ["commit_success.txt", manifest.MANIFEST, "state/x"],
                      "8.orbax-checkpoint-tmp": ["state.orbax-checkpoint-tmp/x"],
                      "8.partial": ["state/x"], "8": ["state/x", "_CHECKPOINT_METADATA"],
                      "12.orbax-checkpoint-tmp": ["state.orbax-checkpoint-tmp/x"],
                      "80": ["state/x"], "notes": ["8.txt"]}.items():
    for f in files:
      (run / name / f).parent.mkdir(parents=True, exist_ok=True)
      (run / name / f).write_text("x")
  removed = manifest.drop_partial(str(run), 8, (".orbax-checkpoint-tmp",), (".partial",))
  assert removed == ["8", "8.orbax-checkpoint-tmp", "8.partial"]
  assert sorted(os.listdir(run)) == ["12.orbax-checkpoint-tmp", "4", "80", "notes"]
  (run / "8").mkdir()
  (run / "8" / "mine.txt").write_text("the user's")
  assert manifest.drop_partial(str(run), 8, (".orbax-checkpoint-tmp",), (".partial",)) == []

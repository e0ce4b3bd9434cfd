"""Exact resume: stopped by a signal at step k, resumed with --resume latest, bitwise equal."""

import json
import os
import shutil
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sexpgpu
from conftest import ROOT, sexpgpu_cmd
from stopping import stop_at

EXP = os.path.join(ROOT, "tests", "data", "curriculum.sx")


def _start(tmp, metrics, *extra):
  return subprocess.Popen(
      sexpgpu_cmd("run", EXP, "--checkpoint-dir", str(tmp / "ck"), "--metrics",
                  f"jsonl:{metrics}", "--json", *extra),
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _events(path, kind):
  return [e for e in (json.loads(line) for line in open(path)) if e["kind"] == kind]


def _losses(path):
  return {e["step"]: e["train/loss"] for e in _events(path, "step")}


def _final_state(step_dir):
  from sexpgpu.ckpt import restore_checkpoint
  exp = sexpgpu.compile(EXP)
  st = exp.init()
  abstract = jax.eval_shape(lambda: {"params": st.params, "opt": st.opt_state,
                                     "step": jnp.int32(0), "skipped": jnp.int32(0)})
  state, meta = restore_checkpoint(step_dir, abstract)
  return state, meta


@pytest.fixture(scope="module")
def full(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("full")
  p = _start(tmp, tmp / "m.jsonl")
  out, err = p.communicate(timeout=600)
  assert p.returncode == 0, err
  return tmp, json.loads(out)


# One run stopped three times, each by another signal at another point (before its first
# periodic checkpoint, between two, past the curriculum's switch), each stop resumed with
# --resume latest: four runs hold what three stop-and-resume pairs held, and a resumed run
# stopped again besides.
CHAIN = [(2, signal.SIGTERM, 143), (12, signal.SIGINT, 130), (30, signal.SIGHUP, 129)]


@pytest.mark.slow  # stopped by a signal and resumed, three times: four runs
def test_signal_then_resume_is_bitwise(full, tmp_path):
  """Each stop exits with its signal's code and a checkpoint, its steps the uninterrupted
  run's; each resume starts from that checkpoint; the end (losses, evaluations, counters,
  stage, the final state) is the uninterrupted run's, bitwise."""
  full_tmp, full_summary = full
  whole = _losses(full_tmp / "m.jsonl")
  ck = tmp_path / "ck"
  last = 0  # the step the previous stop saved
  for seg, (k, sig, code) in enumerate(CHAIN):
    resume = ("--resume", "latest") if last else ()
    if last:
      shutil.copytree(ck, tmp_path / f"ck{seg}")  # a second try resumes from the same one

    def start(attempt, seg=seg, resume=resume):
      shutil.rmtree(ck, ignore_errors=True)
      if resume:
        shutil.copytree(tmp_path / f"ck{seg}", ck)
      metrics = tmp_path / f"m{seg}-{attempt}.jsonl"
      return _start(tmp_path, metrics, *resume), metrics
    p, out, err, metrics = stop_at(start, max(k, last + 2), sig)
    assert p.returncode == code, err
    stopped = json.loads(out)
    assert stopped["stopped_by"] == signal.Signals(sig).name
    assert stopped["checkpoint"] is not None and last < stopped["steps"] < 60
    assert "Traceback" not in err
    if last:
      assert f"resume latest={ck}/curriculum/{last}" in err
      assert [e["action"] for e in _events(metrics, "checkpoint")].count("restored") == 1
    assert _losses(metrics) == {s: whole[s] for s in range(last + 1, stopped["steps"] + 1)}
    last = stopped["steps"]
  metrics = tmp_path / "m-end.jsonl"
  r = subprocess.run(sexpgpu_cmd("run", EXP, "--checkpoint-dir", str(ck), "--metrics",
                                 f"jsonl:{metrics}", "--json", "--resume", "latest"),
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  assert f"resume latest={ck}/curriculum/{last}" in r.stderr
  resumed = json.loads(r.stdout)
  for key in ("train_loss", "eval", "counters", "stage"):
    assert resumed[key] == full_summary[key], key
  assert _losses(metrics) == {s: whole[s] for s in range(last + 1, 61)}
  assert [e["action"] for e in _events(metrics, "checkpoint")].count("restored") == 1
  a, _ = _final_state(full_summary["checkpoint"])
  b, meta = _final_state(resumed["checkpoint"])
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert meta["stage"] == full_summary["stage"] == 1


def _cli(capsys, *args):
  """`sexpgpu ARGS` in this process (an error before the first step needs no process of its
  own): (exit code, standard error)."""
  from sexpgpu.cli.main import main
  code = main(list(args))
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  return code, err


def test_resume_latest_without_location_is_e_ckpt_001(capsys, monkeypatch):
  monkeypatch.delenv("SEXPGPU_CHECKPOINT_DIR", raising=False)
  code, err = _cli(capsys, "run", EXP, "--resume", "latest")
  assert code == 1 and "error[E-CKPT-001]" in err


@pytest.mark.slow  # reads the full 60-step run
def test_resume_of_another_experiment_is_e_ckpt_002(full, tmp_path, capsys):
  full_tmp, full_summary = full
  code, err = _cli(capsys, "run", EXP, "--set", "lr=0.02", "--resume", full_summary["checkpoint"])
  assert code == 1 and "error[E-CKPT-002]" in err, err
  assert "lr 0.01 → 0.02" in err


def test_unreadable_checkpoint_is_e_ckpt_003(tmp_path, capsys):
  bad = tmp_path / "curriculum" / "5"
  bad.mkdir(parents=True)
  (bad / "garbage").write_text("no checkpoint here")
  code, err = _cli(capsys, "run", EXP, "--resume", str(bad))
  assert code == 1 and "error[E-CKPT-003]" in err, err


def test_unwritable_location_is_e_ckpt_004_before_the_first_step(tmp_path, capsys):
  f = tmp_path / "file.txt"
  f.write_text("x")
  code, err = _cli(capsys, "run", EXP, "--checkpoint-dir", str(f / "sub"))
  assert code == 1 and "error[E-CKPT-004]" in err, err
  assert "step 0/" not in err


@pytest.mark.slow  # reads the full 60-step run
def test_rank_count_differs_is_e_dp_002(full, tmp_path, capsys):
  import shutil
  full_tmp, full_summary = full
  src = full_summary["checkpoint"]
  dst = tmp_path / "curriculum" / "60"
  shutil.copytree(src, dst)
  from sexpgpu.ckpt import read_meta
  meta = read_meta(str(dst))
  meta_files = [os.path.join(d, f) for d, _, fs in os.walk(dst) for f in fs
                if json.dumps(meta["fingerprint"]) in open(os.path.join(d, f), "rb").read()
                .decode("latin-1")]
  assert meta_files
  for path in meta_files:
    text = open(path).read().replace('"ranks": 1', '"ranks": 2').replace('"ranks":1', '"ranks":2')
    open(path, "w").write(text)
  from sexpgpu.ckpt import manifest
  manifest.write(str(dst), 60)  # as a two-rank run would have written it: it verifies
  code, err = _cli(capsys, "run", EXP, "--resume", str(dst))
  assert code == 1 and "error[E-DP-002]" in err, err


def _ckpt_tmp_dirs(run_dir):
  if not os.path.isdir(run_dir):
    return []
  return [d for d in os.listdir(run_dir) if "tmp" in d]


@pytest.mark.slow  # kill -9 and resume
def test_kill_9_during_a_checkpoint_write_then_resume_latest(tmp_path):
  args = ["--set", "width=384", "--set", "checkpoint-every=3", "--steps", "30", "--eval-every",
          "0", "--json"]
  full = subprocess.run(sexpgpu_cmd("run", EXP, *args), cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert full.returncode == 0, full.stderr
  ck = tmp_path / "ck"
  run_dir = ck / "curriculum-checkpoint-every=3-width=384"
  p = subprocess.Popen(sexpgpu_cmd("run", EXP, *args, "--checkpoint-dir", str(ck)), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  hit = False
  while time.time() < deadline and p.poll() is None:
    done = [d for d in os.listdir(run_dir) if d.isdigit()] if run_dir.exists() else []
    if done and _ckpt_tmp_dirs(run_dir):  # a later save is being written right now
      p.send_signal(signal.SIGKILL)
      hit = True
      break
    time.sleep(0.0005)
  p.communicate(timeout=60)
  assert hit, "the run ended before a checkpoint write could be interrupted"
  r = subprocess.run(sexpgpu_cmd("run", EXP, *args, "--checkpoint-dir", str(ck), "--resume",
                                 "latest"), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  a, b = json.loads(full.stdout), json.loads(r.stdout)
  for key in ("train_loss", "counters", "stage"):
    assert a[key] == b[key]


@pytest.mark.slow  # a stopped run
def test_a_second_signal_during_the_final_checkpoint_keeps_it_whole(tmp_path):
  ck = tmp_path / "ck"
  m = tmp_path / "m.jsonl"
  # no periodic save (every 1000 > 200 steps): the only checkpoint written is the final one
  p = subprocess.Popen(sexpgpu_cmd("run", EXP, "--set", "width=384", "--steps", "200",
                                   "--set", "checkpoint-every=1000",
                                   "--checkpoint-dir", str(ck), "--metrics", f"jsonl:{m}",
                                   "--json"),
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  run_dir = ck / "curriculum-checkpoint-every=1000-width=384"
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None:
    if m.exists() and _events(m, "step"):
      break
    time.sleep(0.005)
  p.send_signal(signal.SIGTERM)
  hit = False
  while time.time() < deadline and p.poll() is None:
    if _ckpt_tmp_dirs(run_dir):  # the final checkpoint is being written right now
      p.send_signal(signal.SIGTERM)
      hit = True
      break
    time.sleep(0.0005)
  out, err = p.communicate(timeout=300)
  assert hit, "the run ended before its final checkpoint's write could be interrupted"
  assert p.returncode == 143, err
  step_dir = json.loads(out)["checkpoint"]
  from sexpgpu.ckpt import CheckpointStore, read_meta
  assert CheckpointStore(str(ck), "curriculum-checkpoint-every=1000-width=384", 3).latest() \
      == step_dir
  assert read_meta(step_dir)["step"] == json.loads(out)["steps"]


@pytest.mark.slow  # runs and resumes
def test_resume_from_an_older_step_says_its_later_steps_are_replaced(tmp_path, capsys):
  """A rollback (--resume of an older step folder of the run's own location) says which
  later steps its saves replace; --resume latest says nothing of the kind. (The three runs
  in this process: what is checked is the line the command prints, not a process's exit.)"""
  tiny = os.path.join(ROOT, "configs", "tiny-lm.sx")
  base = ["run", tiny, "--variant", "smoke", "--set", "checkpoint-every=2", "--eval-every", "0",
          "--checkpoint-dir", str(tmp_path / "ck")]
  code, err = _cli(capsys, *base, "--steps", "6")
  assert code == 0, err
  run_dir = tmp_path / "ck" / "tiny-lm-smoke-checkpoint-every=2"
  assert sorted(int(d) for d in os.listdir(run_dir) if d.isdigit())[-3:] == [2, 4, 6]
  code, err = _cli(capsys, *base, "--steps", "6", "--resume", str(run_dir / "2"))
  assert code == 0, err
  said = [line for line in err.splitlines() if line.startswith("resume: ")]
  assert said == [f"resume: from step 2 of {run_dir}, which holds later steps 4, 6: each is "
                  "replaced when this run saves that step"], err
  code, err = _cli(capsys, *base, "--steps", "6", "--resume", "latest")
  assert code == 0 and "resume: " not in err, err
  assert "resume latest=" in err  # it did resume: the line is left out, not the resume

"""Random draws in the graph under a real run: a run stopped by SIGTERM at a random step and
resumed is bitwise equal to the one not stopped (tests/test_model_families.py runs it twice)."""

import json
import os
import random
import signal
import subprocess

import pytest

from conftest import ROOT, sexpgpu_cmd
from stopping import stop_at

pytestmark = pytest.mark.slow  # kill and resume at a random step

EXP = os.path.join(ROOT, "configs", "mlm.sx")
# 120 steps of ~2 ms: the signal, sent at a step from 3 to 9, finds the run still going (with
# 12 steps every try of a CI run ended before it)
ARGS = ("--variant", "smoke", "--steps", "120", "--set", "batch-size=8", "--set", "seq=16",
        "--set", "width=16", "--eval-every", "60", "--json")


def _run(tmp, *extra):
  return subprocess.Popen(
      sexpgpu_cmd("run", EXP, *ARGS, "--checkpoint-dir", str(tmp / "ck"), "--metrics",
                  f"jsonl:{tmp / 'm.jsonl'}", *extra),
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(tmp):
  events = [json.loads(line) for line in open(tmp / "m.jsonl")]
  return {e["step"]: e["train/loss"] for e in events if e["kind"] == "step"}


def test_a_masked_lm_stopped_at_a_random_step_resumes_bitwise(tmp_path):
  runs = []
  (tmp_path / "a").mkdir()
  p = _run(tmp_path / "a")
  out, err = p.communicate(timeout=600)
  assert p.returncode == 0, err
  runs.append(json.loads(out))
  k = random.Random(os.getpid()).randint(3, 9)

  def start(attempt):
    folder = tmp_path / f"stopped{attempt}"
    folder.mkdir()
    return _run(folder), folder / "m.jsonl"
  p, out, err, metrics = stop_at(start, k, signal.SIGTERM)
  stopped = metrics.parent
  assert p.returncode == 143, err
  r = _run(stopped, "--resume", "latest")
  out, err = r.communicate(timeout=600)
  assert r.returncode == 0, err
  resumed = json.loads(out)
  assert resumed["train_loss"] == runs[0]["train_loss"] and resumed["eval"] == runs[0]["eval"]
  assert _losses(stopped) == _losses(tmp_path / "a")

"""`sexpgpu sweep`: a 2×2 grid stopped by SIGTERM, restarted, resumed without retraining."""

import csv
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import ROOT, sexpgpu_cmd

EXP = os.path.join(ROOT, "configs", "tiny-lm.sx")
GRID = ["--variant", "smoke", "--steps", "40", "--eval-every", "20", "--set", "lr=0.01,0.003",
        "--set", "width=32,48", "--set", "checkpoint-every=5"]


def _events(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _sweep(tmp, *extra, **kw):
  return subprocess.Popen(sexpgpu_cmd("sweep", EXP, *GRID, "--checkpoint-dir", str(tmp / "ck"),
                                      "--status-dir", str(tmp / "sw"), "--parallel", "2",
                                      *extra),
                          cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow  # a 2x2 grid of runs stopped and resumed
def test_sweep_stopped_then_resumed(tmp_path):
  p = _sweep(tmp_path)
  first = tmp_path / "sw" / "tiny-lm-smoke-checkpoint-every=5-lr=0.01-width=32.jsonl"
  deadline = time.time() + 120
  while time.time() < deadline and p.poll() is None:
    if first.exists() and any(e.get("kind") == "step" and e["step"] >= 10
                              for e in _events(first)):
      break
    time.sleep(0.01)
  p.send_signal(signal.SIGTERM)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 143, err
  assert "Traceback" not in err
  lines = out.splitlines()
  # --parallel 2: the first two points were running, the other two never started
  assert len(lines) == 5 and lines[1].split()[-2] == "stopped", out
  assert lines[2].split()[-2] in ("stopped", "done"), out
  assert all(line.split()[-2] == "pending" for line in lines[3:]), out
  stopped = json.loads((tmp_path / "sw" / (first.name[:-6] + ".status.json")).read_text())
  assert stopped["state"] == "stopped" and stopped["step"] < 40

  p = _sweep(tmp_path, "--table", str(tmp_path / "out.csv"))
  out, err = p.communicate(timeout=240)
  assert p.returncode == 0, err
  assert "resume latest" in err
  with open(tmp_path / "out.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 4
  assert {(r["lr"], r["width"]) for r in rows} == {("0.01", "32"), ("0.01", "48"),
                                                   ("0.003", "32"), ("0.003", "48")}
  assert all(r["state"] == "done" and r["steps"] == "40" for r in rows)
  assert all(float(r["train/loss"]) > 0 and float(r["eval/loss"]) > 0 for r in rows)
  assert len(out.splitlines()) == 5

  # Every point trained each step once, except steps after its last checkpoint before the stop.
  for r in rows:
    evs = _events(tmp_path / "sw" / f"{r['slug']}.jsonl")
    steps = [e["step"] for e in evs if e["kind"] == "step"]
    assert sorted(set(steps)) == list(range(1, 41)), r["slug"]
    restored = [e["step"] for e in evs if e["kind"] == "checkpoint" and e["action"] == "restored"]
    dup = {s for s in steps if steps.count(s) > 1}
    if not restored:
      assert not dup, r["slug"]
      continue
    k = restored[0]
    i = next(i for i, e in enumerate(evs) if e["kind"] == "checkpoint"
             and e["action"] == "restored")
    before = [e["step"] for e in evs[:i] if e["kind"] == "step"]
    after = [e["step"] for e in evs[i:] if e["kind"] == "step"]
    # restored from a checkpoint-every step, or from the stop's own checkpoint at the last
    # step it trained (a point stopped after its first steps on a loaded machine)
    assert min(after) == k + 1 and (k % 5 == 0 or k == max(before))
    assert all(s > k for s in dup) and dup <= set(before)

  # A third sweep finds everything done and runs nothing.
  sizes = {f: os.path.getsize(tmp_path / "sw" / f) for f in os.listdir(tmp_path / "sw")}
  r = subprocess.run(sexpgpu_cmd("sweep", EXP, *GRID, "--checkpoint-dir", str(tmp_path / "ck"),
                                 "--status-dir", str(tmp_path / "sw")),
                     cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert r.stderr.count("skip (done)") == 4
  assert sizes == {f: os.path.getsize(tmp_path / "sw" / f) for f in os.listdir(tmp_path / "sw")}


def _cli(capsys, *args):
  """`sexpgpu ARGS` in this process (emitting tasks or refusing a grid starts no run):
  (exit code, standard error)."""
  from sexpgpu.cli.main import main
  capsys.readouterr()
  code = main(list(args))
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  return code, err


def test_emit_skypilot(tmp_path, capsys):
  code, err = _cli(capsys, "sweep", EXP, *GRID, "--checkpoint-dir", "s3://bucket/ck",
                   "--emit", "skypilot", str(tmp_path / "tasks"))
  assert code == 0, err
  files = sorted(os.listdir(tmp_path / "tasks"))
  assert len(files) == 4 and all(f.endswith(".yaml") for f in files)
  assert not os.path.exists(os.path.join(ROOT, "sweep", files[0][:-5] + ".status.json"))
  for f in files:
    text = (tmp_path / "tasks" / f).read_text()
    try:
      import yaml
    except ImportError:
      assert "resources:" in text and "run: |" in text
      continue
    task = yaml.safe_load(text)
    assert task["resources"]["accelerators"] == "H100:1"
    assert "pip install" in task["setup"]
    run = task["run"]
    assert run.startswith("SEXPGPU_DEVICE=cuda sexpgpu run configs/tiny-lm.sx --variant smoke")
    assert "--resume latest" in run and "--checkpoint-dir s3://bucket/ck" in run
    lr, width = f[:-5].split("-lr=")[1].split("-width=")
    assert f"--set lr={lr} --set width={width} --set checkpoint-every=5" in run
    assert task["envs"]["SEXPGPU_DEVICE"] == "cuda"
    assert "--trust-python" not in run  # not asked: the task trusts nothing more than here


def test_emitted_tasks_carry_the_sweeps_trust_in_python(tmp_path, capsys, monkeypatch):
  """SEXPGPU_TRUST_PYTHON=1 (or --trust-python) on the sweep reaches each task's run line:
  the task's machine has no variable of this shell's."""
  monkeypatch.setenv("SEXPGPU_TRUST_PYTHON", "1")
  code, err = _cli(capsys, "sweep", EXP, "--set", "lr=1e-3,2e-3", "--emit", "skypilot",
                   str(tmp_path / "tasks"))
  assert code == 0, err
  files = sorted(os.listdir(tmp_path / "tasks"))
  assert len(files) == 2
  for f in files:
    run = (tmp_path / "tasks" / f).read_text().split("run: |\n", 1)[1]
    assert "--trust-python --json" in run


def test_bad_grid_is_refused_before_anything_runs(tmp_path, capsys):
  code, err = _cli(capsys, "sweep", EXP, "--set", "nope=1,2", "--status-dir",
                   str(tmp_path / "sw"))
  assert code == 1 and "error[E-KNOB-001]" in err
  assert not (tmp_path / "sw").exists()

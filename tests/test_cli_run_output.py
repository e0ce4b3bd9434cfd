"""End to end: `sexpgpu run configs/tiny-lm.sx` as a subprocess, every line of its output."""

import json
import math
import os
import re
import subprocess

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd

LN32_F32 = float(np.float32(math.log(32)))


def _run(*args, env=None, cwd=ROOT):
  e = dict(os.environ)
  e.update(env or {})
  return subprocess.run(sexpgpu_cmd("run", *args), cwd=cwd, env=e, capture_output=True,
                        text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  metrics, status = d / "m.jsonl", d / "s.json"
  p = _run("configs/tiny-lm.sx", "--metrics", f"jsonl:{metrics}", "--status", str(status),
           "--json")
  return p, metrics, status


def test_standard_error_follows_the_seed(tiny):
  p, metrics, status = tiny
  assert p.returncode == 0, p.stderr
  lines = p.stderr.splitlines()
  assert lines[0] == (f"run: configs/tiny-lm.sx slug tiny-lm device cpu steps 20 microbatches 2 "
                      f"evals eval@10 diagnostics - precision f32 seed 1 checkpoints - resume - "
                      f"status {status}")
  assert lines[1] == f"metrics: jsonl:{metrics}"
  m = re.fullmatch(r"step 0/20 loss - \| eval/loss (\d+\.\d{5}) \| 0 records \| 0\.0s", lines[2])
  assert m, lines[2]
  # zero-initialised unembedding: the first pass reads ln 32, computed in f32
  assert abs(float(m.group(1)) - LN32_F32) < 1e-5
  assert re.fullmatch(r"step 10/20 loss \d+\.\d{5} \| eval/loss \d+\.\d{5} \| 80 records \| "
                      r"\d+\.\ds", lines[3]), lines[3]
  last = re.fullmatch(r"step 20/20 loss \d+\.\d{5} \| eval/loss (\d+\.\d{5}) \| 160 records \| "
                      r"\d+\.\ds", lines[4])
  assert last, lines[4]
  assert float(last.group(1)) < 0.8 * math.log(32)
  assert re.fullmatch(r"timing graph \d+\.\d{3}s device-open \d+\.\d{3}s", lines[5])
  assert re.fullmatch(r"timing kernels \d+ compiled in \d+\.\d{3}s, \d+ cache hits", lines[6])
  assert re.fullmatch(r"timing step-0 \d+\.\d{3}s eval-0 \d+\.\d{3}s", lines[7])
  assert re.fullmatch(r"timing steps 1\.\.20 median \d+\.\d{4}s p90 \d+\.\d{4}s", lines[8])
  assert re.fullmatch(r"timing eval 2 passes median \d+\.\d{4}s p90 \d+\.\d{4}s", lines[9])
  assert re.fullmatch(r"timing total \d+\.\d{3}s over 20 steps", lines[10])
  assert len(lines) == 11  # --json: no done block on standard error


def test_json_summary_and_events(tiny):
  p, metrics, status = tiny
  out = p.stdout.strip().splitlines()
  assert len(out) == 1
  s = json.loads(out[0])
  assert list(s)[:8] == ["kind", "steps", "train_loss", "eval", "counters", "stage", "metrics",
                         "status"]
  assert s["kind"] == "summary" and s["steps"] == 20 and s["stage"] == 0
  assert s["counters"] == {"records": 160, "tokens": 2720}
  assert s["metrics"] == str(metrics) and s["status"] == str(status)
  assert s["slug"] == "tiny-lm" and s["stopped_by"] is None
  events = [json.loads(line) for line in metrics.read_text().splitlines()]
  kinds = [e["kind"] for e in events]
  assert kinds[0] == "config" and kinds[-1] == "summary"
  assert kinds.count("step") == 20 and kinds.count("pass") == 3
  steps = [e for e in events if e["kind"] == "step"]
  assert [e["step"] for e in steps] == list(range(1, 21))
  for e in steps:
    for k in ("train/loss", "train/lr", "train/grad-norm", "time/step",
              "throughput/tokens-per-second", "counters"):
      assert k in e
    assert e["slug"] == "tiny-lm" and isinstance(e["time"], float)
  assert steps[-1]["train/loss"] == pytest.approx(s["train_loss"])
  cfg = events[0]
  assert cfg["knobs"]["steps"] == {"value": 20, "source": "file"}
  st = json.loads(status.read_text())
  assert st["state"] == "done" and st["step"] == 20 and st["counters"]["records"] == 160


def test_done_block_and_overrides():
  p = _run("configs/tiny-lm.sx", "--variant", "smoke", "--steps", "3", "--eval-every", "0")
  assert p.returncode == 0, p.stderr
  lines = p.stderr.splitlines()
  assert "steps 3 microbatches 2 evals eval@end" in lines[0]
  assert lines[1].startswith("step 3/3 loss ")
  done = lines[lines.index(next(line for line in lines if line.startswith("done:"))):]
  assert re.fullmatch(r"done: 3 steps, train/loss \d+\.\d{4}", done[0])
  assert re.fullmatch(r"  eval/loss \d+\.\d{4}", done[1])
  assert done[2:] == ["  counter records 24", "  counter tokens 408"]


def _step_losses(metrics):
  return [e["train/loss"] for e in map(json.loads, metrics.read_text().splitlines())
          if e["kind"] == "step"]


def test_determinism_two_runs_bitwise(tiny, tmp_path):
  """The module's run again, in a fresh process: every step's loss bitwise the same."""
  first, m = tiny[1], tmp_path / "m.jsonl"
  p = _run("configs/tiny-lm.sx", "--metrics", f"jsonl:{m}", "--json")
  assert p.returncode == 0, p.stderr
  assert len(_step_losses(first)) == 20
  assert _step_losses(m) == _step_losses(first)


@pytest.mark.slow  # two runs as subprocesses
def test_slug_from_selection_and_variable(tmp_path):
  m = tmp_path / "m.jsonl"
  p = _run("configs/tiny-lm.sx", "--variant", "smoke", "--set", "lr=3e-3", "--steps", "1",
           "--json")
  assert json.loads(p.stdout)["slug"] == "tiny-lm-smoke-lr=0.003"
  p = _run("configs/tiny-lm.sx", "--steps", "1", "--json", env={"SEXPGPU_RUN_SLUG": "my run"})
  assert json.loads(p.stdout)["slug"] == "my_run"


def test_user_error_is_rendered_without_traceback():
  p = _run("configs/tiny-lm.sx", "--set", "widht=3")
  assert p.returncode == 1
  assert p.stderr.startswith("error[E-KNOB-001]: unknown knob `widht`")
  assert "width" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_longer_run_approaches_the_entropy_rate_check_prints():
  c = subprocess.run(sexpgpu_cmd("check", "configs/tiny-lm.sx"), cwd=ROOT, capture_output=True,
                     text=True, timeout=300)
  rate = float(re.search(r"train: markov .* entropy rate (\d+\.\d+) nats/token", c.stdout).group(1))
  p = _run("configs/tiny-lm.sx", "--steps", "400", "--eval-every", "400", "--set", "lr=0.003",
           "--json")
  assert p.returncode == 0, p.stderr
  final = json.loads(p.stdout)["eval"]["eval/loss"]
  assert rate - 0.1 < final < rate + 0.3, (final, rate)

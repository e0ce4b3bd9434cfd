"""`sexpgpu watch` against a status file a thread advances; `sexpgpu plot` curves and markers."""

import io
import json
import os
import subprocess
import threading
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import pytest  # noqa: E402
from rich.console import Console  # noqa: E402

from conftest import ROOT, sexpgpu_cmd  # noqa: E402
from sexpgpu.errors import SxError  # noqa: E402
from sexpgpu.tools.plot import plot  # noqa: E402
from sexpgpu.tools.watch import watch  # noqa: E402
from sexpgpu.track.status import StatusFile  # noqa: E402


def _status(step, state, **kw):
  return {"slug": "tiny-lm-smoke", "pid": 1, "state": state, "step": step, "steps": 40,
          "stage": 0, "train_loss": 3.0 - step / 40, "last_pass": {"eval/loss": 2.5},
          "counters": {"records": step * 8}, "started_at": 0.0, "steps_per_second": 100.0,
          "eta_seconds": (40 - step) / 100, "checkpoint": None, "error": None, **kw}


def _console():
  return Console(record=True, width=160, file=io.StringIO(), force_terminal=False)


def test_watch_waits_then_follows_to_done(tmp_path):
  path = tmp_path / "run.status.json"

  def advance():
    time.sleep(0.2)  # the watcher starts before the file exists
    sf = StatusFile(str(path))
    sf.write(_status(0, "compiling"))
    for step in range(0, 41, 10):
      time.sleep(0.05)
      sf.write(_status(step, "running"))
    sf.write(_status(40, "done"))

  t = threading.Thread(target=advance)
  t.start()
  console = _console()
  code = watch(str(path), interval=0.02, console=console, timeout=30)
  t.join()
  text = console.export_text()
  assert code == 0
  assert "40/40" in text and "tiny-lm-smoke" in text and "eval/loss 2.5000" in text
  assert "done: tiny-lm-smoke step 40/40, train/loss 2.0000, eval/loss 2.5000" in text


@pytest.mark.parametrize("state,code,says", [
    ("failed", 1, "error[E-NUM-001]: the loss is not finite at step 7"),
    ("stopped", 2, "resume with --resume latest")])
def test_watch_exit_codes(tmp_path, state, code, says):
  path = tmp_path / "s.json"
  StatusFile(str(path)).write(_status(
      7, state, error={"code": "E-NUM-001", "message": "the loss is not finite at step 7"}
      if state == "failed" else None,
      checkpoint={"step": 5, "location": "/ck/tiny-lm-smoke/5"}))
  console = _console()
  assert watch(str(path), interval=0.01, console=console, timeout=5) == code
  assert says in console.export_text()


def test_watch_cli_exit_code(tmp_path):
  path = tmp_path / "s.json"
  StatusFile(str(path)).write(_status(40, "done"))
  r = subprocess.run(sexpgpu_cmd("watch", str(path), "--interval", "0.05"), cwd=ROOT,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert "done: tiny-lm-smoke step 40/40" in r.stdout


def _write_metrics(path, slug, resume_at=None, stage_at=None):
  evs = [{"kind": "config", "slug": slug, "time": 0}]
  for s in range(1, 31):
    evs.append({"kind": "step", "slug": slug, "time": s, "step": s, "train/loss": 3 - s / 30})
    if s % 10 == 0:
      evs.append({"kind": "pass", "slug": slug, "time": s, "step": s, "pass": "eval",
                  "metrics": {"eval/loss": 3.2 - s / 30}})
    if s == stage_at:
      evs.append({"kind": "stage", "slug": slug, "time": s, "step": s, "from": 0, "to": 1,
                  "reason": "(> step 12)"})
    if s == resume_at:
      evs.append({"kind": "checkpoint", "slug": slug, "time": s, "step": s - 3,
                  "action": "restored", "location": "/ck/x", "bytes": None, "seconds": 0.1})
  with open(path, "w") as f:
    f.write("".join(json.dumps(e) + "\n" for e in evs))
    f.write('{"kind": "step", "slu')  # a torn last line, as a live run can leave


def test_plot_curves_markers_and_size(tmp_path):
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  _write_metrics(a, "run-a", stage_at=12)
  _write_metrics(b, "run-b", resume_at=20)
  out = tmp_path / "curves.png"
  fig = plot([str(a), str(b)], ["train/loss", "eval/loss"], str(out))
  lines = [ln for ax in fig.axes for ln in ax.get_lines()]
  assert sum(ln.get_gid() == "curve" for ln in lines) == 4  # 2 slugs × 2 metrics
  assert sum(ln.get_gid() == "stage" for ln in lines) == 2  # run-a's switch, on each panel
  assert sum(ln.get_gid() == "resume" for ln in lines) == 2
  h, w = mpimg.imread(str(out)).shape[:2]
  assert (w, h) == (1000, 700)
  with pytest.raises(SxError) as e:
    plot([str(a)], ["nope/metric"])
  assert e.value.code == "E-METRICS-001"


def test_plot_cli(tmp_path):
  a = tmp_path / "a.jsonl"
  _write_metrics(a, "run-a")
  r = subprocess.run(sexpgpu_cmd("plot", str(a), "--metric", "train/loss", "-o",
                                 str(tmp_path / "c.png")), cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert mpimg.imread(str(tmp_path / "c.png")).shape[:2] == (350, 1000)
  r = subprocess.run(sexpgpu_cmd("plot", str(tmp_path / "missing.jsonl"), "-o",
                                 str(tmp_path / "d.png")), cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 1 and "error[E-METRICS-001]" in r.stderr
  assert not os.path.exists(tmp_path / "d.png")


def test_watch_to_a_pipe_writes_a_line_an_update_as_it_comes(tmp_path):
  path = tmp_path / "s.json"
  sf = StatusFile(str(path))
  sf.write(_status(10, "running", eta_seconds=80.4))
  p = subprocess.Popen(sexpgpu_cmd("watch", str(path), "--interval", "0.05"), cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  guard = threading.Timer(60, p.kill)  # a watcher that never writes fails the test, not hangs it
  guard.start()
  try:
    # Each line is read while the run is still going: nothing waits for the end.
    assert p.stdout.readline() == "step 10/40 loss 2.75 eval/loss 2.5000 eta 1m20s\n"
    sf.write(_status(20, "running", eta_seconds=3725))
    assert p.stdout.readline() == "step 20/40 loss 2.5 eval/loss 2.5000 eta 1h02m\n"
    assert p.poll() is None
    sf.write(_status(40, "done", eta_seconds=0))
    rest = p.stdout.read().splitlines()
    assert rest == ["step 40/40 loss 2 eval/loss 2.5000 eta 0s done",
                    "done: tiny-lm-smoke step 40/40, train/loss 2.0000, eval/loss 2.5000"]
    assert p.wait(timeout=30) == 0
  finally:
    guard.cancel()
    p.kill()
    p.wait()


def test_watch_bar_in_a_terminal_counts_steps(tmp_path):
  path = tmp_path / "s.json"
  StatusFile(str(path)).write(_status(40, "done"))
  console = Console(record=True, width=200, file=io.StringIO(), force_terminal=True)
  assert watch(str(path), interval=0.01, console=console, timeout=5) == 0
  assert "step 40/40" in console.export_text()

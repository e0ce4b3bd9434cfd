"""Tests for sexpgpu.track: metrics targets and the status file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from sexpgpu.errors import SxError
from sexpgpu.track import StatusFile, open_metrics, read_status
from sexpgpu.track import status as status_module
from test_cli_run_output import _run

SLUG = "my-run-smoke"


def _session(spec, steps, *, slug=SLUG, start=1, stopped_by=None,
             summary=True):
  """Emits a short session's events the way the training loop does."""
  m = open_metrics(spec, slug)
  m.emit("config", file="my-run.sx", fingerprint="abc", device="cpu",
         ranks=1, nodes=1,
         knobs={"lr": {"value": 0.003, "source": "override"},
                "steps": {"value": steps, "source": "file"}},
         resume=None)
  m.emit("annotation", name="memory-plan", text="plan fits", peak=1024)
  for step in range(start, steps + 1):
    m.emit("step", step=step, **{"train/loss": 3.0 / step,
                                 "train/lr": 0.003,
                                 "train/grad-norm": np.float32(0.5),
                                 "time/step": 0.01,
                                 "throughput/mfu": None,
                                 "counters": {"records": 8 * step}})
  m.emit("pass", step=steps, metrics={"eval/loss": 2.5}, **{"pass": "eval",
                                                            "time/pass": 0.2})
  m.emit("diagnostic", step=steps, name="w-norm", value=1.25)
  m.emit("checkpoint", step=steps, action="saved", location="/ck/10",
         bytes=4096, seconds=0.1)
  if summary:
    m.emit("summary", steps=steps, train_loss=3.0 / steps, stopped_by=stopped_by)
  m.close()
  return m


def _lines(path):
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


# -- no target -------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, "", "  "])
def test_no_target_writes_nothing(spec):
  m = open_metrics(spec, SLUG)
  assert m.describe() is None
  assert m.summary_path() is None
  event = m.emit("step", step=1, **{"train/loss": 1.0})
  assert event["kind"] == "step" and event["slug"] == SLUG
  m.close()
  m.close()


# -- jsonl -----------------------------------------------------------------


def test_jsonl_appends_across_sessions(tmp_path):
  path = tmp_path / "deep" / "run.jsonl"
  spec = f"jsonl:{path}"
  m = _session(spec, 3)
  assert m.describe() == spec
  assert m.summary_path() == str(path)
  _session(spec, 5, start=4)
  events = _lines(path)
  steps = [e["step"] for e in events if e["kind"] == "step"]
  assert steps == [1, 2, 3, 4, 5]
  assert [e["kind"] for e in events].count("config") == 2
  assert [e["kind"] for e in events].count("summary") == 2
  step = next(e for e in events if e["kind"] == "step")
  # kind first, the fields in order, then slug and time.
  assert list(step) == ["kind", "step", "train/loss", "train/lr",
                        "train/grad-norm", "time/step", "throughput/mfu",
                        "counters", "slug", "time"]
  assert step["train/grad-norm"] == 0.5
  assert step["slug"] == SLUG and isinstance(step["time"], float)


def test_jsonl_lines_are_flushed_and_compact(tmp_path):
  path = tmp_path / "run.jsonl"
  m = open_metrics(f"jsonl:{path}", SLUG)
  m.emit("step", step=1, **{"train/loss": 1.5})
  text = path.read_text()
  assert text.endswith("\n") and ", " not in text and ": " not in text
  assert json.loads(text)["train/loss"] == 1.5
  m.close()


def test_summary_keeps_its_own_slug_position(tmp_path):
  path = tmp_path / "run.jsonl"
  m = open_metrics(f"jsonl:{path}", SLUG)
  m.emit("summary", steps=2, metrics=str(path), status=None, slug=SLUG,
         stopped_by=None, checkpoint=None)
  m.close()
  (event,) = _lines(path)
  assert list(event) == ["kind", "steps", "metrics", "status", "slug",
                         "stopped_by", "checkpoint", "time"]


def test_emit_after_close_writes_nothing(tmp_path):
  path = tmp_path / "run.jsonl"
  m = open_metrics(f"jsonl:{path}", SLUG)
  m.close()
  m.emit("step", step=1)
  m.close()
  assert path.read_text() == ""


# -- tensorboard -----------------------------------------------------------


def test_tensorboard_scalars_per_step(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import (
      EventAccumulator)
  spec = f"tensorboard:{tmp_path / 'tb'}"
  m = _session(spec, 3)
  assert m.summary_path() == str(tmp_path / "tb")
  acc = EventAccumulator(str(tmp_path / "tb" / SLUG))
  acc.Reload()

  def values(tag):
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]

  assert values("train/loss") == [(1, 3.0), (2, 1.5), (3, 1.0)]
  assert values("train/grad-norm") == [(s, 0.5) for s in (1, 2, 3)]
  assert values("counters/records") == [(1, 8), (2, 16), (3, 24)]
  assert values("eval/loss") == [(3, 2.5)]
  assert values("time/pass/eval") == [(3, 0.2)]
  assert values("diag/w-norm") == [(3, 1.25)]
  assert values("checkpoint/bytes") == [(3, 4096)]
  scalar_tags = acc.Tags()["scalars"]
  assert "throughput/mfu" not in scalar_tags  # None is not plotted
  text_tags = acc.Tags()["tensors"]
  for tag in ("config", "annotation/memory-plan", "checkpoint", "summary"):
    assert any(t.startswith(tag) for t in text_tags), (tag, text_tags)


# -- mlflow ----------------------------------------------------------------


def _client(uri):
  from mlflow.tracking import MlflowClient
  return MlflowClient(tracking_uri=uri)


@pytest.mark.slow  # runs read back through mlflow's sqlite store
def test_mlflow_sqlite_one_experiment_per_slug(tmp_path):
  pytest.importorskip("sqlalchemy")
  uri = f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}"
  first = _session(f"mlflow:{uri}", 3)
  assert first.summary_path() == uri
  _session(f"mlflow:{uri}", 5, start=4, stopped_by="SIGTERM")
  client = _client(uri)
  experiment = client.get_experiment_by_name(SLUG)
  assert experiment is not None
  runs = client.search_runs([experiment.experiment_id],
                            order_by=["attributes.start_time ASC"])
  assert len(runs) == 2
  assert [r.info.status for r in runs] == ["FINISHED", "KILLED"]
  one = runs[0]
  assert one.data.params["lr"] == "0.003"
  assert one.data.tags["sexpgpu.fingerprint"] == "abc"
  assert "plan fits" in one.data.tags["annotation/memory-plan"]
  history = client.get_metric_history(one.info.run_id, "train/loss")
  assert [(h.step, h.value) for h in history] == [
      (1, 3.0), (2, 1.5), (3, 1.0)]
  evals = client.get_metric_history(one.info.run_id, "eval/loss")
  assert [(h.step, h.value) for h in evals] == [(3, 2.5)]
  second = client.get_metric_history(runs[1].info.run_id, "train/loss")
  assert [h.step for h in second] == [4, 5]


def test_mlflow_file_store_and_failed_run(tmp_path):
  uri = f"file:{tmp_path / 'mlruns'}"
  _session(f"mlflow:{uri}", 2, summary=False)
  client = _client(uri)
  experiment = client.get_experiment_by_name(SLUG)
  (run,) = client.search_runs([experiment.experiment_id])
  assert run.info.status == "FAILED"  # closed without a summary
  history = client.get_metric_history(run.info.run_id, "diag/w-norm")
  assert [(h.step, h.value) for h in history] == [(2, 1.25)]


def test_mlflow_not_installed(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "mlflow", None)
  monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
  with pytest.raises(SxError) as info:
    open_metrics(f"mlflow:file:{tmp_path}", SLUG, where="SEXPGPU_METRICS")
  assert info.value.code == "E-METRICS-001"
  assert info.value.where == "SEXPGPU_METRICS"
  assert info.value.fix == "pip install sexpgpu[mlflow]"


# -- several targets -------------------------------------------------------


def test_several_targets_at_once(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import (
      EventAccumulator)
  jsonl = tmp_path / "run.jsonl"
  uri = f"file:{tmp_path / 'mlruns'}"
  spec = f"tensorboard:{tmp_path / 'tb'}, mlflow:{uri},jsonl:{jsonl}"
  m = _session(spec, 2)
  assert m.describe() == (f"tensorboard:{tmp_path / 'tb'},mlflow:{uri},"
                          f"jsonl:{jsonl}")
  assert m.summary_path() == str(jsonl)
  assert [e["step"] for e in _lines(jsonl) if e["kind"] == "step"] == [1, 2]
  acc = EventAccumulator(str(tmp_path / "tb" / SLUG))
  acc.Reload()
  assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]
  client = _client(uri)
  (run,) = client.search_runs(
      [client.get_experiment_by_name(SLUG).experiment_id])
  assert run.info.status == "FINISHED"
  assert run.data.metrics["train/loss"] == 1.5


def test_first_target_when_no_jsonl(tmp_path):
  m = open_metrics(f"tensorboard:{tmp_path / 'a'},tensorboard:{tmp_path / 'b'}",
                   SLUG)
  assert m.summary_path() == str(tmp_path / "a")
  m.close()


@pytest.mark.slow  # a run in a subprocess with every target
def test_nothing_else_on_stderr(tmp_path):
  pytest.importorskip("sqlalchemy")
  spec = (f"jsonl:{tmp_path / 'r.jsonl'},tensorboard:{tmp_path / 'tb'},"
          f"mlflow:sqlite:///{tmp_path / 'm.db'}")
  code = ("import sys; sys.path.insert(0, 'tests'); import test_track; "
          f"test_track._session({spec!r}, 3)")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("MLFLOW_", "PYTEST"))}
  done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stderr == ""
  assert done.stdout == ""
  assert not os.path.exists(os.path.join(root, "mlruns"))


# -- bad specs -------------------------------------------------------------


def _bad_specs(tmp_path):
  a_file = tmp_path / "file.txt"
  a_file.write_text("x")
  return {
      "unknown scheme": "csv:/tmp/x.csv",
      "near scheme": "jsonll:/tmp/x.jsonl",
      "no scheme": str(tmp_path / "x.jsonl"),
      "empty path": "jsonl:",
      "blank path": "tensorboard:  ",
      "empty piece": f"jsonl:{tmp_path / 'a.jsonl'},,tensorboard:{tmp_path}",
      "trailing comma": f"jsonl:{tmp_path / 'a.jsonl'},",
      "twice": f"jsonl:{tmp_path / 'a.jsonl'},jsonl:{tmp_path / 'a.jsonl'}",
      "jsonl under a file": f"jsonl:{a_file / 'x.jsonl'}",
      "jsonl is a directory": f"jsonl:{tmp_path}",
      "tensorboard under a file": f"tensorboard:{a_file}",
      "mlflow store under a file": f"mlflow:file:{a_file}",
  }


@pytest.mark.parametrize("case", [
    "unknown scheme", "near scheme", "no scheme", "empty path", "blank path",
    "empty piece", "trailing comma", "twice", "jsonl under a file",
    "jsonl is a directory", "tensorboard under a file",
    "mlflow store under a file"])
def test_bad_spec_is_metrics_error(tmp_path, case):
  spec = _bad_specs(tmp_path)[case]
  with pytest.raises(SxError) as info:
    open_metrics(spec, SLUG, where="SEXPGPU_METRICS")
  error = info.value
  assert error.code == "E-METRICS-001"
  assert error.where == "SEXPGPU_METRICS"
  assert error.fix
  assert "  --> SEXPGPU_METRICS" in error.render()


def test_near_scheme_is_suggested():
  with pytest.raises(SxError) as info:
    open_metrics("tensorbord:/tmp/tb", SLUG)
  assert info.value.where == "--metrics"
  assert "`tensorboard`" in info.value.fix


# -- status file -----------------------------------------------------------


def test_status_replaced_atomically(tmp_path):
  path = str(tmp_path / "sub" / "run.status.json")
  status = StatusFile(path)
  status.write({"slug": SLUG, "pid": os.getpid(), "state": "compiling",
                "step": 0})
  stop = threading.Event()
  seen, failures = [], []

  def reader():
    while not stop.is_set():
      try:
        seen.append(read_status(path)["step"])
      except SxError as e:  # a partial file: not JSON
        failures.append(e)

  thread = threading.Thread(target=reader)
  thread.start()
  try:
    for step in range(1, 400):
      # Sizes vary, so a torn write would show as bad JSON.
      status.update(state="running", step=step,
                    counters={f"c{i}": i for i in range(step % 50)})
  finally:
    stop.set()
    thread.join()
  assert not failures
  assert seen and seen == sorted(seen)
  assert read_status(path)["step"] == 399
  assert os.listdir(tmp_path / "sub") == ["run.status.json"]


def test_status_fields_and_updated_at(tmp_path):
  path = tmp_path / "s.json"
  status = StatusFile(str(path))
  status.write({"slug": SLUG, "state": "compiling", "checkpoint": None,
                "error": None})
  first = read_status(str(path))
  assert first["state"] == "compiling" and first["updated_at"] > 0
  status.update(state="failed", error={"code": "E-NUM-001", "message": "nan"})
  last = read_status(str(path))
  assert last["slug"] == SLUG and last["state"] == "failed"
  assert last["error"]["code"] == "E-NUM-001"
  assert last["updated_at"] >= first["updated_at"]


def test_status_without_path_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  status = StatusFile(None)
  status.write({"state": "running"})
  status.update(step=3)
  assert status.maybe_update(0.0, step=4)
  assert status.last["step"] == 4 and status.last["state"] == "running"
  assert os.listdir(tmp_path) == []


def test_status_throttle(tmp_path):
  path = str(tmp_path / "s.json")
  status = StatusFile(path)
  assert status.maybe_update(100.0, state="running", step=1)
  assert not status.maybe_update(100.5, step=2)
  assert read_status(path)["step"] == 1
  assert status.maybe_update(100.6, force=True, state="evaluating")
  assert read_status(path)["step"] == 2  # the skipped field was kept
  assert not status.maybe_update(101.5, step=3)
  assert status.maybe_update(101.6, step=4)
  assert read_status(path)["step"] == 4
  assert status_module.THROTTLE_SECONDS == 1.0


def test_status_unwritable_is_an_error(tmp_path):
  a_file = tmp_path / "file.txt"
  a_file.write_text("x")
  status = StatusFile(str(a_file / "s.json"), where="SEXPGPU_STATUS")
  with pytest.raises(SxError) as info:
    status.write({"state": "running"})
  assert info.value.where == "SEXPGPU_STATUS"


def test_a_status_file_that_is_no_status_object_is_e_metrics_001(tmp_path):
  """read_status (sweep's reader) reads within a bound, never /dev/zero or a FIFO whole."""
  p = tmp_path / "s.json"
  p.write_text("[1, 2]")
  for path, why in ((str(p), "holds an array"), ("/dev/zero", "character device"),
                    (str(tmp_path / "none.json"), "not found")):
    with pytest.raises(SxError) as e:
      read_status(path)
    assert e.value.code == "E-METRICS-001" and why in e.value.message


# --- a run's metrics read back from tensorboard and mlflow ---------------------------------

@pytest.mark.slow  # a run read back through tensorboard and mlflow
def test_tensorboard_and_mlflow_targets_read_back(tmp_path):
  tb, ml = tmp_path / "tb", tmp_path / "ml.db"
  p = _run("configs/tiny-lm.sx", "--variant", "smoke", "--steps", "4", "--eval-every", "2",
           "--metrics", f"tensorboard:{tb},mlflow:sqlite:///{ml}")
  assert p.returncode == 0, p.stderr
  assert "WARNING" not in p.stderr and "Traceback" not in p.stderr
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(tb / "tiny-lm-smoke"))
  acc.Reload()
  assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
  assert [e.step for e in acc.Scalars("eval/loss")] == [0, 2, 4]
  import mlflow
  client = mlflow.tracking.MlflowClient(f"sqlite:///{ml}")
  exp = client.get_experiment_by_name("tiny-lm-smoke")
  run = client.search_runs([exp.experiment_id])[0]
  assert run.info.status == "FINISHED"
  assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
  assert run.data.params["layers"] == "1"

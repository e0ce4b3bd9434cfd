"""The `wandb:PROJECT[/RUN]` metrics target, read back from its offline files with wandb's own
reader (`wandb leet inspect --json`): every scalar at its step, the knobs with their sources,
the samples table, one run id across a resume, the exit code; and each error."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.errors import SxError
from sexpgpu.track import open_metrics
from sexpgpu.track.events import scalars
from sexpgpu.track.wandb_target import INSTALL_FIX, run_id

pytest.importorskip("wandb")

SX = """
(require std/lm)
(require std/gpt2)
(defknob lr 0.01 "peak learning rate")
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defloader valid (markov :vocab 24 :seq 9 :batch 2 :seed 7 :stream 1))
(defn lm [tokens]
  (gpt2 tokens :vocab 24 :width 16 :layers 1 :heads 2 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defpass eval :data valid :every 2 :batches 1 :metrics [loss])
(defsample story :fn lm :prompts ["1 2 3" "4"] :tokens 3 :every 2 :temperature 0)
(defrun :loss loss :data train :steps 4 :optimizer (adamw :lr lr) :precision f32 :seed 3)
"""
# `--set lr=0.02` makes the slug `wbtiny-lr=0.02`, which W&B cannot take as an id as it is.
SLUG = "wbtiny-lr=0.02"
ENVELOPE = ("_runtime", "_step", "_timestamp")


def _offline_env(tmp) -> dict:
  """Variables for a process that has no W&B credentials, keeps every W&B file under `tmp`,
  and could reach no server but a closed port on 127.0.0.1 if it tried."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("WANDB_") and k not in ("NETRC", "PYTEST_CURRENT_TEST")}
  env.update(WANDB_DIR=str(tmp / "wb"), WANDB_DATA_DIR=str(tmp / "wb-data"),
             WANDB_CACHE_DIR=str(tmp / "wb-cache"), WANDB_CONFIG_DIR=str(tmp / "wb-config"),
             WANDB_BASE_URL="http://127.0.0.1:9", NETRC=str(tmp / "no-netrc"))
  os.makedirs(env["WANDB_DIR"], exist_ok=True)
  return env


@pytest.fixture
def offline(tmp_path, monkeypatch):
  """This process without W&B credentials, its W&B files under tmp_path."""
  for name in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
    monkeypatch.delenv(name, raising=False)
  for name, value in _offline_env(tmp_path).items():
    if name.startswith("WANDB_") or name == "NETRC":
      monkeypatch.setenv(name, value)
  monkeypatch.setenv("WANDB_SILENT", "true")
  return tmp_path


def _records(run_dir) -> list[dict]:
  """The records of a run's .wandb file, as wandb's own reader prints them."""
  (log,) = glob.glob(os.path.join(run_dir, "*.wandb"))
  env = {**os.environ, "WANDB_CACHE_DIR": os.path.join(run_dir, "reader-cache")}
  done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", log, "--json"],
                        capture_output=True, text=True, timeout=120, env=env)
  assert done.returncode == 0, done.stderr
  return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _runs(wandb_dir) -> list[str]:
  """The offline run folders W&B wrote under WANDB_DIR, oldest first."""
  return sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*")))


def _history(records) -> dict[int, dict]:
  """Step → the history row logged at it (W&B's own keys left out)."""
  return {r["history"]["step"].get("num", 0):
          {k: v for k, v in r["history"]["item"].items() if k not in ENVELOPE}
          for r in records if r["type"] == "history"}


def _one(records, kind) -> dict:
  (found,) = [r[kind] for r in records if r["type"] == kind]
  return found


def _config(records) -> dict:
  out = {}
  for r in records:
    if r["type"] == "config":
      out.update(r["config"]["update"])
  return out


def _summary(records) -> dict:
  out = {}
  for r in records:
    if r["type"] == "summary":
      out.update(r["summary"].get("update", {}))
  return out


def _table_rows(run_dir, records, key) -> list[list]:
  """Every row of the incremental table `key`: the increments' files, as W&B listed them."""
  rows = []
  for r in records:
    for f in (r["files"]["files"] if r["type"] == "files" else []):
      if f["path"].startswith(f"media/table/{key}_"):
        with open(os.path.join(run_dir, "files", f["path"])) as table:
          rows += json.load(table)["data"]
  return rows


def _events(path, kind=None) -> list[dict]:
  with open(path) as f:
    return [e for e in map(json.loads, f) if kind is None or e["kind"] == kind]


# -- a run and its resume, through the CLI --------------------------------------------------


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
  """Four steps with a checkpoint, then `--resume latest` to six: one jsonl file beside one
  W&B run, written offline (no credentials) in two folders."""
  tmp = tmp_path_factory.mktemp("wbrun")
  sx = tmp / "wbtiny.sx"
  sx.write_text(SX)
  env = _offline_env(tmp)
  jsonl = tmp / "m.jsonl"
  common = [str(sx), "--set", "lr=0.02", "--checkpoint-dir", str(tmp / "ck"), "--metrics",
            f"wandb:proj,jsonl:{jsonl}"]
  done = []
  for extra in ([], ["--resume", "latest", "--steps", "6"]):
    p = subprocess.run(sexpgpu_cmd("run", *common, *extra), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    done.append(p)
  runs = _runs(env["WANDB_DIR"])
  assert len(runs) == 2, runs
  return {"procs": done, "jsonl": jsonl, "runs": runs,
          "records": [_records(r) for r in runs]}


@pytest.mark.slow  # reads a run and its resume through the CLI, W&B offline
def test_wandb_prints_nothing_of_its_own(sessions):
  for p in sessions["procs"]:
    lines = p.stderr.splitlines()
    assert lines[1] == f"metrics: wandb:proj,jsonl:{sessions['jsonl']}"
    # Only sexpgpu's own lines: configuration, metrics, progress, samples, timing, done.
    ours = ("run: ", "metrics: ", "step ", "story: ", "timing ", "done: ", "  ")
    assert [x for x in lines if not x.startswith(ours)] == []
    assert "Traceback" not in p.stderr and "WARNING" not in p.stderr
    assert p.stdout == ""


@pytest.mark.slow  # reads a run and its resume through the CLI, W&B offline
def test_every_scalar_is_in_the_history_at_its_step(sessions):
  """Each step, pass and checkpoint scalar of the jsonl stream, at its step, with its value;
  the first session's steps in the first folder, the resumed session's in the second."""
  first, second = (_history(r) for r in sessions["records"])
  events = _events(sessions["jsonl"])
  resumed_at = next(i for i, e in enumerate(events) if e["kind"] == "config" and i > 0)
  for session, history in ((events[:resumed_at], first), (events[resumed_at:], second)):
    wanted = [(e["step"], tag, v) for e in session for tag, v in scalars(e)]
    assert wanted
    for step, tag, value in wanted:
      assert history[step][tag] == pytest.approx(value, rel=1e-12), (step, tag)
  assert sorted(s for s, row in first.items() if "train/loss" in row) == [1, 2, 3, 4]
  assert sorted(s for s, row in second.items() if "train/loss" in row) == [5, 6]
  assert sorted(s for s, row in first.items() if "eval/loss" in row) == [0, 2, 4]


@pytest.mark.slow  # reads a run and its resume through the CLI, W&B offline
def test_the_config_holds_the_knobs_and_their_sources(sessions):
  cfg_event = _events(sessions["jsonl"], "config")[0]
  config = _config(sessions["records"][0])
  knobs = cfg_event["knobs"]
  assert {n: config[n] for n in knobs} == {n: k["value"] for n, k in knobs.items()}
  assert config["sexpgpu"]["sources"] == {n: k["source"] for n, k in knobs.items()}
  assert config["sexpgpu"]["sources"]["lr"] == "set" and config["lr"] == 0.02
  assert config["sexpgpu"]["fingerprint"] == cfg_event["fingerprint"]
  assert config["sexpgpu"]["versions"] == cfg_event["versions"]
  assert _config(sessions["records"][1])["sexpgpu"]["resume"].startswith("latest=")


@pytest.mark.slow  # reads a run and its resume through the CLI, W&B offline
def test_samples_and_annotations_are_tables(sessions):
  run_dir, records = sessions["runs"][0], sessions["records"][0]
  samples = [[e["step"], e["name"], e["prompt"], e["text"]]
             for e in _events(sessions["jsonl"], "sample") if e["step"] <= 4]
  assert [s[0] for s in samples] == [2, 2, 4, 4]
  assert sorted(_table_rows(run_dir, records, "samples")) == sorted(samples)
  notes = _table_rows(run_dir, records, "annotations")
  assert {"annotation/lowering", "annotation/memory", "checkpoint"} <= {n[1] for n in notes}
  assert [n for n in notes if n[1] == "checkpoint"][0][0] == 4


@pytest.mark.slow  # reads a run and its resume through the CLI, W&B offline
def test_a_resume_continues_the_same_run_id(sessions):
  first, second = sessions["records"]
  ids = [_one(r, "run")["run_id"] for r in (first, second)]
  assert ids[0] == ids[1] == run_id(SLUG) == "wbtiny-lr_0_02-" + ids[0][-8:]
  assert all(_one(r, "run")["display_name"] == SLUG and _one(r, "run")["project"] == "proj"
             for r in (first, second))
  assert _one(second, "run")["resume"] is True
  assert min(s for s in _history(second) if s > 0) == 4  # the restore, then steps 5 and 6
  assert [_one(r, "exit").get("exit_code", 0) for r in (first, second)] == [0, 0]
  assert _summary(second)["sexpgpu"]["steps"] == 6
  assert all(r.endswith(f"-{ids[0]}") for r in sessions["runs"])


# -- the target on its own ------------------------------------------------------------------


@pytest.mark.slow  # a run stopped by a signal
def test_a_stopped_session_finishes_with_the_signal_exit_code(offline):
  """A session stopped by SIGTERM: exit code 143 as the CLI's; eval events as scalars at
  their step; a checkpoint written after later steps goes at the latest step; RUN names it."""
  m = open_metrics("wandb:proj/my run", "ignored-slug")
  m.emit("config", knobs={"lr": {"value": 0.1, "source": "file"}})
  m.emit("step", step=1, **{"train/loss": 2.0})
  m.emit("eval", step=1, eval="harness", task="choice",
         metrics={"harness/choice/acc": 0.5, "harness/choice/acc_norm": 0.75},
         requests=40, skipped=1, **{"time/eval": 1.5})
  m.emit("step", step=2, **{"train/loss": 1.0})
  m.emit("checkpoint", step=1, action="saved", location="/ck/1", bytes=64, seconds=0.5)
  m.emit("summary", steps=2, train_loss=1.0, stopped_by="SIGTERM")
  m.close()
  (run_dir,) = _runs(offline / "wb")
  records = _records(run_dir)
  run = _one(records, "run")
  assert run["display_name"] == "my run" and run["run_id"] == run_id("my run")
  history = _history(records)
  assert history[1] == {"train/loss": 2.0, "harness/choice/acc": 0.5,
                        "harness/choice/acc_norm": 0.75, "time/eval/harness/choice": 1.5}
  assert history[2]["train/loss"] == 1.0 and history[2]["checkpoint/bytes"] == 64
  assert _one(records, "exit")["exit_code"] == 128 + signal.SIGTERM
  assert _summary(records)["sexpgpu"]["stopped_by"] == "SIGTERM"


def test_a_session_without_a_summary_failed(offline, monkeypatch):
  # A key with WANDB_MODE=offline stays offline: the run is still a folder here.
  monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
  monkeypatch.setenv("WANDB_MODE", "offline")
  m = open_metrics("wandb:proj", "broken")
  m.emit("step", step=1, **{"train/loss": 2.0})
  m.close()
  (run_dir,) = _runs(offline / "wb")
  assert _one(_records(run_dir), "exit")["exit_code"] == 1


def test_run_ids_are_what_wandb_takes_and_never_shared():
  assert run_id("tiny-lm_smoke") == "tiny-lm_smoke"
  mapped = [run_id(s) for s in ("lr=0.1", "lr_0.1", "lr_0_1", "x" * 65, "x" * 66, "é")]
  assert len(set(mapped)) == len(mapped)
  assert all(len(i) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in i)
             for i in mapped)
  assert run_id("lr=0.1") == run_id("lr=0.1") and run_id("lr_0_1") == "lr_0_1"


def test_an_eval_event_plots_its_metrics():
  event = {"kind": "eval", "step": 3, "eval": "h", "task": "cloze", "slug": "s", "time": 0.0,
           "metrics": {"h/cloze/bpb": 1.25, "h/cloze/note": "x"}, "requests": 9,
           "skipped": 0, "time/eval": 0.5}
  assert scalars(event) == [("h/cloze/bpb", 1.25), ("time/eval/h/cloze", 0.5)]


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,says", [
    ("wandb:a/b/c", "2 `/`"),
    ("wandb:/run", "names no W&B project"),
    ("wandb:proj/", "names no run"),
    ("wandb:pro#j", "contains #"),
    ("wandb:" + "p" * 129, "over W&B's 128"),
])
def test_a_bad_spec_is_e_metrics_001(spec, says):
  with pytest.raises(SxError) as info:
    open_metrics(spec, "s", where="SEXPGPU_METRICS")
  e = info.value
  assert e.code == "E-METRICS-001" and e.where == "SEXPGPU_METRICS"
  assert says in e.message and "wandb:PROJECT/RUN" in e.fix


def test_online_without_a_key_is_an_error_not_a_prompt(offline, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "online")
  with pytest.raises(SxError) as info:
    open_metrics("wandb:proj", "s")
  assert info.value.code == "E-METRICS-001" and "no API key" in info.value.message
  assert "wandb login" in info.value.fix and not _runs(offline / "wb")


def test_wandb_not_installed(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(SxError) as info:
    open_metrics("wandb:proj", "s")
  assert info.value.code == "E-METRICS-001" and "not installed" in info.value.message
  assert info.value.fix == INSTALL_FIX == "pip install 'sexpgpu[wandb]'"


def test_the_cli_renders_a_bad_wandb_target(tmp_path):
  p = subprocess.run(sexpgpu_cmd("run", "configs/tiny-lm.sx", "--metrics", "wandb:a/b/c"),
                     cwd=ROOT, env=_offline_env(tmp_path), capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 1
  assert p.stderr.startswith("error[E-METRICS-001]: metrics target `wandb:a/b/c`: ")
  assert "--metrics" in p.stderr and "Traceback" not in p.stderr

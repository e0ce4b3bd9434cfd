"""Checkpoints that lie or cannot be written: manifests refuse damage, latest falls back,
a failing save leaves the last good step named and the process exits at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.ckpt import CheckpointStore, resolve_resume, restore_checkpoint
from sexpgpu.ckpt.manifest import MANIFEST
from sexpgpu.errors import SxError
from test_flag_values import _cli

EXP = os.path.join(ROOT, "tests", "data", "faults.sx")
INTERNALS = ("<bound method", "pybind11", "TensorStore(", "tensorstore_spec", "Traceback")


def _state(seed):
  rng = np.random.default_rng(seed)
  return {"w": rng.standard_normal((64, 32)).astype(np.float32),
          "b": rng.standard_normal(32).astype(np.float32), "pos": np.int64(seed)}


def _saved(tmp_path, steps=(1, 2, 3)):
  store = CheckpointStore(str(tmp_path / "ck"), "run", keep=5)
  for s in steps:
    store.save(s, _state(s), {"step": s, "loaders": {"short": {"pos": 10 * s}}}, wait=True)
  store.close()
  return tmp_path / "ck" / "run"


def _largest(folder, under):
  files = [p for p in (folder / under).rglob("*") if p.is_file()]
  return max(files, key=lambda p: p.stat().st_size)


def _flip(path, at=None):
  data = bytearray(path.read_bytes())
  i = len(data) // 2 if at is None else at
  data[i] ^= 0x01
  path.write_bytes(bytes(data))


KINDS = {  # which file of a step folder, and how to find it
    "array data": lambda step: _largest(step, "state"),
    "meta": lambda step: step / "meta" / "metadata",
    "manifest": lambda step: step / MANIFEST,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_flipped_byte_is_refused_by_name_and_latest_falls_back(tmp_path, capsys, kind):
  run = _saved(tmp_path)
  bad = KINDS[kind](run / "3")
  _flip(bad)
  with pytest.raises(SxError) as e:
    restore_checkpoint(str(run / "3"), _state(0))
  text = str(e.value)
  assert e.value.code == "E-CKPT-003" and "does not verify" in text
  name = MANIFEST if kind == "manifest" else bad.relative_to(run / "3").as_posix()
  assert name in text, text
  assert not any(w in text for w in INTERNALS), text
  step_dir, line = resolve_resume("latest", str(tmp_path / "ck"), "run")
  assert step_dir == str(run / "2") and line == f"latest={run / '2'}"
  err = capsys.readouterr().err
  assert f"checkpoint: skipped {run / '3'}: " in err and name in err
  got, meta = restore_checkpoint(step_dir, _state(0))
  assert meta["loaders"] == {"short": {"pos": 20}}
  assert got["w"].tobytes() == _state(2)["w"].tobytes()


def test_a_truncated_array_file_names_the_file_without_internals(tmp_path):
  run = _saved(tmp_path, steps=(1,))
  bad = _largest(run / "1", "state")
  bad.write_bytes(bad.read_bytes()[:100])
  with pytest.raises(SxError) as e:
    restore_checkpoint(str(run / "1"), _state(0))
  text = str(e.value)
  assert e.value.code == "E-CKPT-003" and bad.relative_to(run / "1").as_posix() in text
  assert "bytes, its manifest says" in text
  assert not any(w in text for w in INTERNALS), text


def test_an_edited_meta_digit_is_refused(tmp_path):
  """The campaign's lie: a loader position changed by hand resumed with other losses."""
  run = _saved(tmp_path, steps=(1, 2))
  meta = run / "2" / "meta" / "metadata"
  meta.write_text(meta.read_text().replace('"pos": 20', '"pos": 21'))
  with pytest.raises(SxError) as e:
    restore_checkpoint(str(run / "2"), _state(0))
  assert "meta/metadata" in str(e.value)
  assert resolve_resume("latest", str(tmp_path / "ck"), "run")[0] == str(run / "1")


def test_no_step_verifies_is_an_error_not_a_fresh_start(tmp_path, capsys):
  run = _saved(tmp_path, steps=(1, 2))
  for s in ("1", "2"):
    _flip(run / s / "meta" / "metadata")
  with pytest.raises(SxError) as e:
    resolve_resume("latest", str(tmp_path / "ck"), "run")
  assert e.value.code == "E-CKPT-003" and "no checkpoint under" in str(e.value)
  assert capsys.readouterr().err.count("checkpoint: skipped") == 2


def test_a_step_without_manifest_does_not_count(tmp_path):
  run = _saved(tmp_path, steps=(1, 2))
  (run / "2" / MANIFEST).unlink()  # killed after orbax's rename, before the manifest
  assert CheckpointStore(str(tmp_path / "ck"), "run", keep=5).latest() == str(run / "1")


# -- through the command line ------------------------------------------------------------------


def _run(*args, env=None, timeout=300):
  return subprocess.run(sexpgpu_cmd("run", EXP, "--json", *args), cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env)


def _losses(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """faults.sx run to its end once, with its checkpoints: (their folder, its metrics), the
  reference the resumes below continue bitwise (a test that damages or resumes into the
  checkpoints works on its own copy)."""
  tmp = tmp_path_factory.mktemp("uninterrupted")
  full = _run("--checkpoint-dir", str(tmp / "ck"), "--metrics", f"jsonl:{tmp / 'a'}")
  assert full.returncode == 0, full.stderr
  return tmp / "ck", tmp / "a"


@pytest.mark.slow  # runs, damages and resumes
def test_resume_latest_skips_a_damaged_newest_step_and_resumes_exactly(tmp_path, uninterrupted):
  shutil.copytree(uninterrupted[0], tmp_path / "ck")
  shutil.copy(uninterrupted[1], tmp_path / "a")
  run = tmp_path / "ck" / "faults"
  _flip(_largest(run / "20", "state"))
  again = tmp_path / "ck2"
  shutil.copytree(tmp_path / "ck", again)
  bad = _run("--checkpoint-dir", str(again), "--resume", str(again / "faults" / "20"))
  assert bad.returncode == 1 and "error[E-CKPT-003]" in bad.stderr and "does not verify" in bad.stderr
  assert not any(w in bad.stderr for w in INTERNALS), bad.stderr
  r = _run("--checkpoint-dir", str(tmp_path / "ck"), "--resume", "latest", "--metrics",
           f"jsonl:{tmp_path / 'b'}")
  assert r.returncode == 0, r.stderr
  assert f"checkpoint: skipped {run / '20'}: state/" in r.stderr
  assert f"latest={run / '16'}" in r.stderr
  a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
  assert sorted(b) == [17, 18, 19, 20] and all(a[s] == b[s] for s in b)


def take_location_away(ck, tmp_path) -> None:
  """Moves the folder `ck` away and leaves a file in its place. The run may make `ck` again
  (its next save) between the two: that folder is moved away too, and the file goes in by a
  rename, which fails on a folder instead of writing into it."""
  blocker = tmp_path / "blocker"
  blocker.write_text("not a folder")
  for i in range(100):
    if ck.is_dir():
      os.rename(ck, tmp_path / f"gone-{i}")
    try:
      os.rename(blocker, ck)
      return
    except (IsADirectoryError, FileExistsError, NotADirectoryError):
      continue
  raise AssertionError(f"the run kept making {ck} again")


@pytest.mark.slow  # a run in a subprocess, timed to its exit
def test_a_save_that_cannot_be_written_exits_within_seconds(tmp_path):
  """The location is taken away mid-run: E-CKPT-004 naming what is intact, then exit at once
  (no thread left waiting on a save that cannot finish)."""
  ck = tmp_path / "ck"
  p = subprocess.Popen(sexpgpu_cmd("run", EXP, "--set", "steps=5000", "--checkpoint-dir", str(ck)),
                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  first = ck / "faults-steps=5000" / "4" / MANIFEST
  deadline = time.monotonic() + 240
  while not first.exists() and p.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
  assert first.exists(), p.communicate()[1] if p.poll() is not None else "no checkpoint"
  take_location_away(ck, tmp_path)
  t = time.monotonic()
  try:
    _, err = p.communicate(timeout=60)
  finally:
    if p.poll() is None:
      p.kill()
  assert time.monotonic() - t < 30, "the run kept going or hung after its save failed"
  assert p.returncode == 1 and "error[E-CKPT-004]" in err, err
  assert "previous: no complete checkpoint is left" in err  # checked: the folder is gone


def _can_mount_tmpfs(folder) -> bool:
  try:
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {folder}"],
                       capture_output=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return False
  return r.returncode == 0


@pytest.mark.slow  # runs, damages and resumes
def test_a_full_disk_names_the_intact_step_and_what_to_free(tmp_path, uninterrupted):
  """The checkpoint folder is a 300 KiB tmpfs: step 4 fits (188 KiB), step 8 does not.
  E-CKPT-004 says the device is full, names step 4 as checked against its manifest and what
  to free, without a library's wording; the failed save's folder is gone when the run exits,
  step 4 is as it was written, and it then resumes exactly."""
  disk, kept = tmp_path / "disk", tmp_path / "kept"
  disk.mkdir()
  if not _can_mount_tmpfs(disk):
    pytest.skip("no mount namespace for a small tmpfs (needs root and unshare)")
  cmd = " ".join(f"'{a}'" for a in sexpgpu_cmd("run", EXP, "--checkpoint-dir", str(disk)))
  script = (f"mount -t tmpfs -o size=300k tmpfs {disk} && {{ {cmd}; echo $? > {tmp_path / 'rc'}; "
            f"cp -a {disk} {kept}; }}")  # the tmpfs goes with the namespace: keep a copy
  t = time.monotonic()
  r = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True,
                     text=True, timeout=300)
  err = r.stderr
  assert (tmp_path / "rc").read_text().strip() == "1", err
  assert "error[E-CKPT-004]" in err and "the device is full" in err, err
  assert (f"previous: the last good checkpoint is step 4 at {disk}/faults/4, checked against "
          "its manifest") in err, err
  assert f"free space where {disk}/faults lies" in err and "--resume latest" in err
  assert not any(w in err for w in INTERNALS + ("OCDBT", "ocdbt", "RESOURCE_EXHAUSTED")), err
  assert time.monotonic() - t < 120
  # the failed save's folder went with the run that hit it: step 4 alone, as it was written
  from sexpgpu.ckpt import manifest
  assert sorted(os.listdir(kept / "faults")) == ["4"]
  assert manifest.problem(str(kept / "faults" / "4")) is None
  # what the message called intact is: a resume from the copy continues as a full run does
  again = _run("--checkpoint-dir", str(kept), "--resume", "latest", "--metrics",
               f"jsonl:{tmp_path / 'b'}")
  assert again.returncode == 0, again.stderr
  a, b = _losses(uninterrupted[1]), _losses(tmp_path / "b")
  assert min(b) == 5 and all(a[s] == b[s] for s in b)


# -- a metrics file cut off by a full disk ------------------------------------------------------


def test_a_cut_off_metrics_line_is_repaired_before_a_resume_appends(tmp_path, capsys):
  from sexpgpu.track.jsonl_target import JsonlTarget
  path = tmp_path / "m.jsonl"
  path.write_text('{"kind":"step","step":1}\n{"kind":"step","st')  # the disk filled mid-line
  t = JsonlTarget(f"jsonl:{path}", str(path), "s")
  t.write({"kind": "step", "step": 2})
  t.close()
  assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
  assert "ended in a cut-off line (18 bytes" in capsys.readouterr().err
  whole = path.read_text()
  JsonlTarget(f"jsonl:{path}", str(path), "s").close()  # a whole file is left as it is
  assert path.read_text() == whole and capsys.readouterr().err == ""


def test_a_metrics_write_that_fails_is_taken_back(tmp_path):
  """/dev/full: every write fails with ENOSPC; the file keeps its whole lines."""
  from sexpgpu.track.jsonl_target import JsonlTarget
  from sexpgpu.track.targets import TargetError
  if not os.path.exists("/dev/full"):
    pytest.skip("no /dev/full")
  t = JsonlTarget("jsonl:/dev/full", "/dev/full", "s")
  with pytest.raises(TargetError) as e:
    t.write({"kind": "step", "step": 1})
  assert "No space left on device" in str(e.value)
  t.close()


# --- a run without --resume into a location holding its slug --------------------------------

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


# --- a full disk's partial step folder goes with the run that hit it -------------------------

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

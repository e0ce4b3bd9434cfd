"""Checkpoints on s3:// (a moto server on 127.0.0.1): exact resume, a dying server, secrets."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stopping import stop_at
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.ckpt import remote
from s3server import KillableProxy, make_bucket, s3_env

pytestmark = pytest.mark.slow  # S3 on a moto server: kill, stop and resume

EXP = os.path.join(ROOT, "tests", "data", "curriculum.sx")
SECRET = "sexpgpuTestSecretKey0123456789"


@pytest.fixture(scope="module")
def moto(moto_endpoint):
  """The session's moto S3 server (conftest), with the bucket `runs`."""
  return make_bucket(moto_endpoint, "runs")


def _env(endpoint, tmp=None):
  e = dict(os.environ)
  e.update(s3_env(endpoint))
  e["AWS_SECRET_ACCESS_KEY"] = SECRET
  if tmp is not None:  # where the run stages its saves before uploading them
    e["TMPDIR"] = str(tmp)
  return e


def _run(args, endpoint, tmp=None, **kw):
  return subprocess.run(sexpgpu_cmd("run", EXP, *args), cwd=ROOT, env=_env(endpoint, tmp),
                        capture_output=True, text=True, timeout=600, **kw)


def _staging(tmp):
  return [p.name for p in tmp.iterdir() if p.name.startswith("sexpgpu-ckpt-staging-")]


def _steps(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


@pytest.fixture(scope="module")
def uninterrupted(moto, tmp_path_factory):
  """The experiment run to its end with checkpoints on s3://runs/full, staging its saves in
  a folder of its own: (the process, its metrics file, that folder)."""
  tmp = tmp_path_factory.mktemp("full")
  staging = tmp / "staging"
  staging.mkdir()
  full_m = tmp / "full.jsonl"
  full = _run(["--checkpoint-dir", "s3://runs/full", "--metrics", f"jsonl:{full_m}", "--json"],
              moto, staging)
  assert full.returncode == 0, full.stderr
  return full, full_m, staging


def test_sigterm_then_resume_latest_on_s3_is_exact(moto, tmp_path, uninterrupted):
  full, full_m, _ = uninterrupted

  def start(attempt):
    m = tmp_path / f"m{attempt}.jsonl"
    return subprocess.Popen(
        sexpgpu_cmd("run", EXP, "--checkpoint-dir", f"s3://runs/stop{attempt}", "--metrics",
                    f"jsonl:{m}", "--json", "--status", str(tmp_path / "s.json")),
        cwd=ROOT, env=_env(moto), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), m
  p, out, err, m = stop_at(start, 9, signal.SIGTERM)
  where = f"s3://runs/stop{m.stem[1:]}"
  assert p.returncode == 143, err
  stopped = json.loads(out)
  assert stopped["stopped_by"] == "SIGTERM"
  assert stopped["checkpoint"].startswith(f"{where}/curriculum/")
  assert json.load(open(tmp_path / "s.json"))["state"] == "stopped"
  r = _run(["--checkpoint-dir", where, "--metrics", f"jsonl:{m}", "--json",
            "--resume", "latest"], moto)
  assert r.returncode == 0, r.stderr
  assert f"resume latest={stopped['checkpoint']}" in r.stderr
  a, b = json.loads(full.stdout), json.loads(r.stdout)
  for key in ("train_loss", "eval", "counters", "stage"):
    assert a[key] == b[key]
  assert _steps(m) == _steps(full_m)
  for text in (full.stderr, full.stdout, err, out, r.stderr, r.stdout, m.read_text(),
               open(tmp_path / "s.json").read()):
    assert SECRET not in text


def test_resume_from_an_s3_step_dir(moto, tmp_path, uninterrupted):
  """The uninterrupted run's older kept checkpoint (step 56 of 60, :keep 2), resumed by its
  s3:// step folder: the run's last four steps and its end, exactly."""
  full, full_m, staging = uninterrupted
  assert _staging(staging) == []  # the run removed its staging folder when it ended
  step_dir = json.loads(full.stdout)["checkpoint"]
  assert step_dir.startswith("s3://runs/full/curriculum/") and step_dir.endswith("/60")
  m = tmp_path / "m.jsonl"
  r = _run(["--resume", step_dir[:-len("60")] + "56", "--metrics", f"jsonl:{m}", "--json"],
           moto)
  assert r.returncode == 0, r.stderr
  a, b = json.loads(full.stdout), json.loads(r.stdout)
  assert b["steps"] == 60
  for key in ("train_loss", "eval", "counters", "stage"):
    assert a[key] == b[key], key
  assert _steps(m) == {s: v for s, v in _steps(full_m).items() if s > 56}


def test_missing_bucket_is_found_before_the_first_step(moto):
  r = _run(["--checkpoint-dir", "s3://no-such-bucket/x"], moto)
  assert r.returncode == 1 and "error[E-CKPT-004]" in r.stderr, r.stderr
  assert "step 0/" not in r.stderr and SECRET not in r.stderr


def test_server_dies_during_a_save(moto, tmp_path):
  """The store's server goes away mid-run: a clear error, the earlier checkpoint intact."""
  proxy = KillableProxy(int(moto.rsplit(":", 1)[1]))
  m = tmp_path / "m.jsonl"
  env = _env(f"http://127.0.0.1:{proxy.port}")
  env["SEXPGPU_REMOTE_TIMEOUT"] = "3"  # the save is retried 3 s, then E-CKPT-004
  p = subprocess.Popen(sexpgpu_cmd("run", EXP, "--set", "width=512", "--steps", "400",
                                   "--set", "checkpoint-every=2", "--eval-every", "0",
                                   "--checkpoint-dir", "s3://runs/dying", "--metrics",
                                   f"jsonl:{m}", "--status", str(tmp_path / "s.json")),
                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None:
    if m.exists() and any(e["kind"] == "checkpoint" for e in map(json.loads, open(m))):
      break
    time.sleep(0.01)
  before = proxy.sent
  while time.time() < deadline and proxy.sent - before < 2_000_000 and p.poll() is None:
    time.sleep(0.002)
  proxy.kill()
  out, err = p.communicate(timeout=300)
  assert p.returncode == 1, err
  assert "error[E-CKPT-004]" in err and "s3://runs/dying/" in err, err
  assert "Traceback" not in err and SECRET not in err
  assert json.load(open(tmp_path / "s.json"))["state"] == "failed"
  saved = [e for e in map(json.loads, open(m)) if e["kind"] == "checkpoint"]
  assert saved
  probe = ("from sexpgpu.ckpt import CheckpointStore, read_meta\n"
           "d = CheckpointStore('s3://runs/dying', 'curriculum-checkpoint-every=2-width=512', 3).latest()\n"
           "print(read_meta(d)['step'])")
  r = subprocess.run([sys.executable, "-c", probe], env=_env(moto), capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert int(r.stdout) >= saved[0]["step"]


def test_kill_9_during_an_upload_then_resume_latest(moto, tmp_path):
  args = ["--set", "width=384", "--set", "checkpoint-every=3", "--steps", "30", "--eval-every",
          "0", "--json"]
  full = _run(args, moto)
  assert full.returncode == 0, full.stderr
  m = tmp_path / "m.jsonl"
  staging = tmp_path / "tmp"
  staging.mkdir()
  p = subprocess.Popen(sexpgpu_cmd("run", EXP, *args, "--checkpoint-dir", "s3://runs/killed",
                                   "--metrics", f"jsonl:{m}"),
                       cwd=ROOT, env=_env(moto, staging), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  import s3fs  # here, not at collection: every worker collects this module
  fs = s3fs.S3FileSystem(key="testing", secret=SECRET, client_kwargs={"endpoint_url": moto})
  run_dir = "s3://runs/killed/curriculum-checkpoint-every=3-width=384"
  deadline = time.time() + 300
  hit = False
  while time.time() < deadline and p.poll() is None:
    committed, uncommitted = remote.steps(fs, run_dir)
    if committed and uncommitted:  # a later step is on the store without its COMMIT: uploading
      p.send_signal(signal.SIGKILL)
      hit = True
      break
  p.communicate(timeout=60)
  assert hit, "the run ended before an upload could be interrupted"
  left = _staging(staging)  # what the killed process staged is left behind
  assert len(left) == 1 and left[0].startswith(f"sexpgpu-ckpt-staging-{p.pid}-"), left
  r = _run(args + ["--checkpoint-dir", "s3://runs/killed", "--resume", "latest"], moto, staging)
  assert r.returncode == 0, r.stderr
  assert _staging(staging) == []  # the next run removed it, and its own
  assert "resume latest=s3://runs/killed/" in r.stderr
  a, b = json.loads(full.stdout), json.loads(r.stdout)
  for key in ("train_loss", "counters", "stage"):
    assert a[key] == b[key]

"""One run per checkpoint location: the second stops before step 0 naming the holder (E-CKPT-005),
locally and on s3:// (moto on 127.0.0.1); a lock left by `kill -9` is taken over, saying so."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import ROOT, sexpgpu_cmd
from s3server import make_bucket, s3_env
from sexpgpu.ckpt import CheckpointStore
from sexpgpu.errors import SxError

EXP = os.path.join(ROOT, "tests", "data", "faults.sx")


@pytest.fixture(scope="module")
def moto(moto_endpoint):
  return make_bucket(moto_endpoint, "locks")


def _env(endpoint=None):
  e = dict(os.environ)
  if endpoint:
    e.update(s3_env(endpoint))
  return e


def _start(location, *extra, env=None):
  return subprocess.Popen(sexpgpu_cmd("run", EXP, "--json", "--checkpoint-dir", location, *extra),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)


def _two_at_once(location, env=None):
  a, b = _start(location, env=env), _start(location, env=env)
  outs = [p.communicate(timeout=300) for p in (a, b)]
  return [(p.returncode, out, err, p.pid) for p, (out, err) in zip((a, b), outs)]


def _check_one_trained(results):
  codes = sorted(r[0] for r in results)
  assert codes == [0, 1], [r[2] for r in results]
  (winner,) = [r for r in results if r[0] == 0]
  (loser,) = [r for r in results if r[0] == 1]
  err = loser[2]
  assert "error[E-CKPT-005]" in err and "is in use by another run" in err, err
  assert f"pid {winner[3]} on host {socket.gethostname()}" in err
  assert "step 1/" not in err and "Traceback" not in err  # stopped before step 0
  assert json.loads(winner[1])["steps"] == 20


@pytest.mark.slow  # two runs at once
def test_two_runs_at_once_on_a_local_folder(tmp_path):
  _check_one_trained(_two_at_once(str(tmp_path / "ck")))
  assert not (tmp_path / "ck" / "faults" / "LOCK").exists()  # released at the end


@pytest.mark.slow  # S3 on the session's moto server
def test_two_runs_at_once_on_s3(moto):
  _check_one_trained(_two_at_once("s3://locks/both", env=_env(moto)))


def test_a_store_refuses_a_location_held_by_another_process(tmp_path):
  """In-process view of the same: the holder's host, pid and start time are named."""
  loc = str(tmp_path / "ck")
  code = ("import sys, time; from sexpgpu.ckpt import CheckpointStore; "
          f"s = CheckpointStore({loc!r}, 'run', 2); s.check_writable(); print('held', flush=True); "
          "sys.stdin.read()")
  holder = subprocess.Popen([os.sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(SxError) as e:
      CheckpointStore(loc, "run", 2).check_writable()
    assert e.value.code == "E-CKPT-005" and f"pid {holder.pid} on host" in str(e.value)
    assert " started 20" in str(e.value)
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  store = CheckpointStore(loc, "run", 2)  # let go when the holder ends
  store.check_writable()
  store.close()


@pytest.mark.slow  # kill -9 then a second run (local and S3 on moto)
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_lock_left_by_kill_9_is_taken_over(tmp_path, moto, where):
  env = _env(moto) if where == "s3" else None
  location = "s3://locks/killed" if where == "s3" else str(tmp_path / "ck")
  p = _start(location, "--set", "steps=5000", env=env)
  first = "faults-steps=5000/4/" + ("COMMIT" if where == "s3" else "MANIFEST.json")
  if where == "s3":
    import s3fs
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto}, key="testing", secret="testing")
    there = lambda: fs.invalidate_cache() or fs.exists(f"locks/killed/{first}")
  else:
    there = lambda: os.path.exists(os.path.join(location, first))
  deadline = time.monotonic() + 240
  while p.poll() is None and time.monotonic() < deadline and not there():
    time.sleep(0.05)  # until the first checkpoint: the run holds its lock and trains
  assert p.poll() is None, p.communicate()[1]
  p.send_signal(signal.SIGKILL)
  p.communicate(timeout=60)
  r = subprocess.run(sexpgpu_cmd("run", EXP, "--json", "--checkpoint-dir", location, "--set",
                                 "steps=5000", "--steps", "3", "--resume", "latest"),
                     cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 0, r.stderr
  assert (f"checkpoint: took over the lock of {location}/faults-steps=5000 from pid {p.pid} "
          f"on host {socket.gethostname()}") in r.stderr
  assert "that process is gone" in r.stderr

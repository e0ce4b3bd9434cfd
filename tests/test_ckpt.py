"""Checkpoints: local and s3 (moto) saves, restores, retention, kills and errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from s3server import KillableProxy

from sexpgpu.ckpt import (CheckpointInfo, CheckpointStore, peek_meta, read_meta,
                          resolve_resume, restore_checkpoint)
from sexpgpu.ckpt.store import local_steps
from sexpgpu.errors import SxError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "sx-test-SECRET-7f3a9c"


def make_state(seed: int = 0, n: int = 64):
  """A training-like state: params, an adamw state, rng key data, int scalars."""
  rng = np.random.default_rng(seed)
  params = {"dense": {"w": jnp.asarray(rng.standard_normal((n, 32)), jnp.float32),
                      "b": jnp.asarray(rng.standard_normal((32,)), jnp.bfloat16)}}
  opt = optax.adamw(1e-3).init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, opt = optax.adamw(1e-3).update(grads, opt, params)
  return {"params": params, "opt": opt, "step": np.int64(17), "stage": 2,
          "rng": np.asarray(jax.random.key_data(jax.random.key(seed))),
          "loader": {"pos": np.int64(123456789012)}}


def assert_bitwise(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


# -- local --------------------------------------------------------------------


def test_local_roundtrip_bitwise(tmp_path):
  state = make_state()
  meta = {"fingerprint": "abc", "knobs": {"lr": 0.001}, "positions": [1, 2]}
  with CheckpointStore(str(tmp_path), "run", keep=3) as store:
    store.check_writable()
    assert store.run_dir == f"{tmp_path}/run"
    store.save(5, state, meta, wait=True)
    assert store.latest() == f"{tmp_path}/run/5"
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          state)
  got, got_meta = restore_checkpoint(f"{tmp_path}/run/5", abstract)
  assert got_meta == meta
  assert read_meta(f"{tmp_path}/run/5") == meta
  assert peek_meta(f"{tmp_path}/run/5") == meta  # as plain JSON, before any backend starts
  assert peek_meta(f"{tmp_path}/run/6") is None
  assert isinstance(got["opt"][0], optax.ScaleByAdamState)
  assert type(got["opt"]) is type(state["opt"])
  assert_bitwise(got, state)


def test_keep_two_newest(tmp_path):
  store = CheckpointStore(str(tmp_path), "run", keep=2)
  for step in (1, 2, 3, 4):
    store.save(step, make_state(step), {"step": step}, wait=False)
  info = store.wait()
  store.close()
  assert info.step == 4
  assert local_steps(f"{tmp_path}/run") == [3, 4]
  assert sorted(os.listdir(tmp_path / "run")) == ["3", "4"]


def test_async_save_then_wait(tmp_path):
  state = make_state(n=200_000)
  store = CheckpointStore(str(tmp_path), "run", keep=2)
  assert store.wait() is None
  store.save(10, state, {"a": 1}, wait=False)
  info = store.wait()
  assert isinstance(info, CheckpointInfo)
  assert (info.step, info.location) == (10, f"{tmp_path}/run/10")
  assert info.bytes > 200_000 * 32 * 2 and info.seconds > 0
  assert store.latest() == info.location
  store.save(10, state, {"a": 1}, wait=True)  # the same step again: a no-op
  store.close()
  got, _ = restore_checkpoint(info.location, state)
  assert_bitwise(got, state)


def test_latest_ignores_incomplete_dirs(tmp_path):
  store = CheckpointStore(str(tmp_path), "run", keep=5)
  store.save(3, make_state(), {}, wait=True)
  run = tmp_path / "run"
  (run / "7.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)
  (run / "8" / "state").mkdir(parents=True)  # no commit_success.txt
  (run / "notes").mkdir()
  assert store.latest() == f"{run}/3"
  assert resolve_resume("latest", str(tmp_path), "run") == (f"{run}/3", f"latest={run}/3")
  with pytest.raises(SxError) as e:
    restore_checkpoint(f"{run}/8", make_state())
  assert e.value.code == "E-CKPT-003" and "not a complete checkpoint" in e.value.message
  store.close()


KILL_CHILD = textwrap.dedent("""
  import sys, numpy as np
  from sexpgpu.ckpt import CheckpointStore
  w = np.random.default_rng(0).standard_normal(50_000_000, dtype=np.float32)
  store = CheckpointStore(sys.argv[1], "run", keep=2)
  step = 0
  while True:
    step += 1
    store.save(step, {"w": w, "step": np.int64(step)}, {"step": step}, wait=True)
    print("saved", step, flush=True)
""")


@pytest.mark.slow  # kill -9 during a save
def test_sigkill_mid_save_leaves_last_complete(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO)
  run = tmp_path / "run"
  for attempt in range(3):
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().split() == ["saved", "1"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not _tmp_dirs(run):
      time.sleep(0.002)
    time.sleep(0.05 * attempt)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate()
    assert err == ""  # orbax and absl say nothing on standard error
    if _tmp_dirs(run):
      break
  assert _tmp_dirs(run), "the kill never landed mid-write"
  store = CheckpointStore(str(tmp_path), "run", keep=2)
  latest = store.latest()
  step = int(os.path.basename(latest))
  abstract = {"w": jax.ShapeDtypeStruct((50_000_000,), np.float32),
              "step": jax.ShapeDtypeStruct((), np.int64)}
  got, meta = restore_checkpoint(latest, abstract)
  assert meta == {"step": step} and int(got["step"]) == step
  want = np.random.default_rng(0).standard_normal(50_000_000, dtype=np.float32)
  assert np.asarray(got["w"]).tobytes() == want.tobytes()
  store.save(step + 1, {"w": want[:10], "step": np.int64(step + 1)}, {}, wait=True)
  assert store.latest() == f"{run}/{step + 1}"
  store.close()


def _tmp_dirs(run):
  try:
    return [n for n in os.listdir(run) if "tmp" in n]
  except FileNotFoundError:
    return []


def test_resume_latest_without_location():
  with pytest.raises(SxError) as e:
    resolve_resume("latest", None, "run")
  assert e.value.code == "E-CKPT-001"
  assert e.value.where == "--resume latest" and "--checkpoint-dir" in e.value.fix


def test_resume_latest_none_and_run_dir(tmp_path):
  assert resolve_resume("latest", str(tmp_path), "run") == (None, "latest=none")
  store = CheckpointStore(str(tmp_path), "run", keep=3)
  store.save(1, make_state(), {}, wait=True)
  store.save(2, make_state(), {}, wait=True)
  store.close()
  step2 = f"{tmp_path}/run/2"
  assert resolve_resume(f"{tmp_path}/run/1", None, "x") == (f"{tmp_path}/run/1",) * 2
  assert resolve_resume(f"{tmp_path}/run", None, "x") == (step2, step2)
  again = CheckpointStore(str(tmp_path), "run", keep=3)
  again.save(2, make_state(), {"v": 2}, wait=True)  # an earlier run's step 2 is replaced
  again.close()
  assert read_meta(step2) == {"v": 2}


def test_gs_without_gcsfs():
  try:
    import gcsfs  # noqa: F401
    pytest.skip("gcsfs is installed; no gcs emulator here")
  except ImportError:
    pass
  with pytest.raises(SxError) as e:
    CheckpointStore("gs://bucket/p", "run", keep=1)
  assert e.value.code == "E-CKPT-004" and "gcsfs" in e.value.fix


def test_unreadable_checkpoints(tmp_path):
  garbage = tmp_path / "garbage"
  garbage.mkdir()
  (garbage / "commit_success.txt").write_text("ok")
  (garbage / "state").mkdir()
  (garbage / "state" / "_METADATA").write_bytes(os.urandom(100))
  for bad in (str(garbage), str(tmp_path / "missing")):
    with pytest.raises(SxError) as e:
      restore_checkpoint(bad, make_state())
    assert e.value.code == "E-CKPT-003" and bad in e.value.message and e.value.fix
    with pytest.raises(SxError) as e:
      read_meta(bad)
    assert e.value.code == "E-CKPT-003"
  with pytest.raises(SxError) as e:
    resolve_resume(str(tmp_path / "missing"), None, "run")
  assert e.value.code == "E-CKPT-003"


def test_structure_mismatch_is_unreadable(tmp_path):
  store = CheckpointStore(str(tmp_path), "run", keep=1)
  store.save(1, make_state(), {}, wait=True)
  store.close()
  step = f"{tmp_path}/run/1"
  other = make_state()
  other["extra"] = np.zeros(3)
  wider = make_state(n=65)
  for abstract in (other, wider):
    with pytest.raises(SxError) as e:
      restore_checkpoint(step, abstract)
    assert e.value.code == "E-CKPT-003" and step in e.value.message


def test_unwritable_location(tmp_path):
  blocker = tmp_path / "file.txt"
  blocker.write_text("not a folder")
  store = CheckpointStore(str(blocker / "sub"), "run", keep=1)
  with pytest.raises(SxError) as e:
    store.check_writable()
  assert e.value.code == "E-CKPT-004" and e.value.where == "--checkpoint-dir"
  assert "file.txt/sub/run" in e.value.message
  with pytest.raises(SxError) as e:
    store.save(1, make_state(), {}, wait=True)
  assert e.value.code == "E-CKPT-004"
  store.close()


# -- s3 (moto) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto(moto_endpoint):
  """The session's moto S3 server (conftest); its endpoint URL."""
  return moto_endpoint


def _aws_env(monkeypatch, endpoint):
  for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
                     "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": endpoint}.items():
    monkeypatch.setenv(key, value)
  monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
  monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def s3(moto, monkeypatch, request):
  """A fresh bucket on the moto server; yields an s3fs filesystem and its URI."""
  _aws_env(monkeypatch, moto)
  import s3fs
  fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto})
  bucket = "b" + request.node.name.replace("_", "-").lower()[:50]
  fs.mkdir(bucket)
  yield fs, f"s3://{bucket}/exp"


@pytest.mark.slow  # S3 on the session's moto server
def test_s3_roundtrip_fresh_store_and_markers(s3):
  fs, loc = s3
  state = make_state()
  store = CheckpointStore(loc, "run", keep=2)
  store.check_writable()
  assert store.run_dir == f"{loc}/run" and store.latest() is None
  store.save(1, state, {"fp": "one"}, wait=False)
  info = store.wait()
  assert info.location == f"{loc}/run/1" and info.bytes > 0
  store.close()
  fresh = CheckpointStore(loc, "run", keep=2)
  assert fresh.latest() == f"{loc}/run/1"
  got, meta = restore_checkpoint(fresh.latest(), state)
  assert meta == {"fp": "one"} and read_meta(f"{loc}/run/1") == {"fp": "one"}
  assert peek_meta(f"{loc}/run/1") == {"fp": "one"}
  assert isinstance(got["opt"][0], optax.ScaleByAdamState)
  assert_bitwise(got, state)
  # A step folder without its marker never counts.
  fs.pipe_file(f"{loc[5:]}/run/9/state/_METADATA", b"half")
  assert fresh.latest() == f"{loc}/run/1"
  with pytest.raises(SxError) as e:
    restore_checkpoint(f"{loc}/run/9", state)
  assert e.value.code == "E-CKPT-003" and "not a complete" in e.value.message
  assert resolve_resume("latest", loc, "run") == (f"{loc}/run/1", f"latest={loc}/run/1")
  assert resolve_resume(f"{loc}/run", None, "x") == (f"{loc}/run/1",) * 2
  fresh.close()


@pytest.mark.slow  # S3 on the session's moto server
def test_s3_retention_keeps_two(s3):
  fs, loc = s3
  store = CheckpointStore(loc, "run", keep=2)
  fs.pipe_file(f"{loc[5:]}/run/1/state/_METADATA", b"left by a killed upload")
  for step in (2, 3, 4):
    store.save(step, make_state(step), {"step": step}, wait=False)
  store.close()
  fs.invalidate_cache()
  assert sorted(os.path.basename(p) for p in fs.ls(f"{loc[5:]}/run")) == ["3", "4"]
  assert fs.exists(f"{loc[5:]}/run/4/COMMIT")
  fs.rm_file(f"{loc[5:]}/run/4/COMMIT")
  assert CheckpointStore(loc, "run", keep=2).latest() == f"{loc}/run/3"
  got, meta = restore_checkpoint(f"{loc}/run/3", make_state(3))
  assert meta == {"step": 3}
  assert_bitwise(got, make_state(3))


@pytest.mark.slow  # S3 on the session's moto server
def test_s3_missing_bucket(moto, monkeypatch):
  _aws_env(monkeypatch, moto)
  store = CheckpointStore("s3://no-such-bucket-xyz/p", "run", keep=1)
  with pytest.raises(SxError) as e:
    store.check_writable()
  text = str(e.value)
  assert e.value.code == "E-CKPT-004" and "s3://no-such-bucket-xyz/p/run" in text
  assert SECRET not in text and "testing" not in text
  with pytest.raises(SxError) as e:
    restore_checkpoint("s3://no-such-bucket-xyz/p/run/1", make_state())
  assert e.value.code == "E-CKPT-003" and SECRET not in str(e.value)
  store.close()


@pytest.mark.slow  # S3 on the session's moto server
def test_s3_server_dies_mid_upload(s3, moto, monkeypatch):
  """The store's server dies while uploading step 2: an SxError, step 1 intact.

  The store talks to moto through a proxy that is killed mid-upload (moto
  in memory loses everything when it restarts, so the proxy stands for the
  dead server); the real server then shows what a restarted one would hold.
  """
  fs, loc = s3
  proxy = KillableProxy(int(moto.rsplit(":", 1)[1]))
  _aws_env(monkeypatch, f"http://127.0.0.1:{proxy.port}")
  monkeypatch.setenv("SEXPGPU_REMOTE_TIMEOUT", "2")  # retried 2 s, then given up
  small = {"w": np.arange(10, dtype=np.float32)}
  big = {"w": np.random.default_rng(1).standard_normal(25_000_000, dtype=np.float32)}
  store = CheckpointStore(loc, "run", keep=2)
  store.save(1, small, {"step": 1}, wait=True)
  before = proxy.sent
  store.save(2, big, {"step": 2}, wait=False)
  deadline = time.monotonic() + 30
  while proxy.sent - before < 20_000_000 and time.monotonic() < deadline:
    time.sleep(0.01)
  proxy.kill()
  with pytest.raises(SxError) as e:
    store.wait()
  text = str(e.value)
  assert e.value.code == "E-CKPT-004" and f"{loc}/run/2" in text
  # the server is gone, so step 1 is named as the last one completed, not claimed intact
  assert "step 1 (" in text and "last checkpoint this run completed" in text
  assert "could not be checked now" in text
  assert SECRET not in text and "testing" not in text
  store.close()
  _aws_env(monkeypatch, moto)
  fs.invalidate_cache()
  assert not fs.exists(f"{loc[5:]}/run/2/COMMIT")
  assert not fs.exists(f"{loc[5:]}/run/2/commit_success.txt")
  assert fs.du(f"{loc[5:]}/run/2") < 90_000_000  # it did die mid-upload
  assert CheckpointStore(loc, "run", keep=2).latest() == f"{loc}/run/1"
  got, meta = restore_checkpoint(f"{loc}/run/1", small)
  assert meta == {"step": 1}
  assert_bitwise(got, small)

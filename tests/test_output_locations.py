"""Outputs go where they are named or are refused, and no secret of a URI reaches any."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.paths import scrub
from sexpgpu.track import open_metrics
from sexpgpu.track.status import StatusFile

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("spec", ["jsonl:s3://bucket/m.jsonl", "tensorboard:gs://bucket/tb",
                                  "jsonl:s3://KEY:SECRET-1@bucket/m.jsonl"])
def test_a_local_metrics_target_with_a_remote_location_is_refused(tmp_path, monkeypatch, spec):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SxError) as e:
    open_metrics(spec, "run")
  assert e.value.code == "E-METRICS-001" and "is a remote location" in e.value.message
  assert "mlflow:URI" in e.value.fix and "SECRET-1" not in str(e.value)
  assert os.listdir(tmp_path) == []  # no folder named `s3:` or `gs:`


def test_a_remote_status_file_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SxError) as e:
    StatusFile("s3://bucket/s.json")
  assert e.value.code == "E-METRICS-001" and e.value.where == "--status"
  code = main(["run", TINY, "--variant", "smoke", "--steps", "1", "--status",
               "s3://bucket/s.json"])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-METRICS-001]" in err and "Traceback" not in err
  assert os.listdir(tmp_path) == []


def test_an_mlflow_password_is_in_no_error_and_no_line(tmp_path):
  uri = f"http://user:SECRET-mlflow-2@127.0.0.1:{_closed_port()}/"
  t0 = time.perf_counter()
  with pytest.raises(SxError) as e:
    open_metrics(f"mlflow:{uri}", "run")
  assert e.value.code == "E-METRICS-001" and "SECRET-mlflow-2" not in str(e.value)
  assert "http://***@127.0.0.1" in e.value.message
  assert time.perf_counter() - t0 < 60  # a dead server is said at once, not after minutes


def test_the_status_file_keeps_no_secret(tmp_path):
  path = tmp_path / "s.json"
  st = StatusFile(str(path))
  st.write({"state": "failed", "error": {"code": "E-METRICS-001", "message":
                                         "mlflow:http://u:SECRET-status-3@h failed"},
            "list": ["s3://K:SECRET-status-4@b/p"], "step": 3})
  text = path.read_text()
  assert "SECRET-status" not in text
  got = json.loads(text)
  assert got["error"]["message"] == "mlflow:http://***@h failed" and got["step"] == 3
  assert got["list"] == ["s3://***@b/p"]


def test_a_uri_secret_once_seen_is_masked_where_a_library_repeats_it():
  assert scrub("s3://AKIA-KEY-5:SECRET-VALUE-5@bucket/p") == "s3://***@bucket/p"
  # an S3 client's own error names the "bucket" with the credentials, without `//`
  said = scrub('Invalid bucket name "AKIA-KEY-5:SECRET-VALUE-5@bucket"')
  assert "SECRET-VALUE-5" not in said and "AKIA-KEY-5" not in said


def test_an_s3_checkpoint_location_with_credentials_never_shows_them(monkeypatch):
  from sexpgpu.ckpt import CheckpointStore
  monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
  with pytest.raises(SxError) as e:
    CheckpointStore("s3://KEYID6:SECRET-VALUE-6@bucket/p", "run", keep=1).check_writable()
  assert e.value.code == "E-CKPT-004"
  assert "SECRET-VALUE-6" not in str(e.value) and "KEYID6" not in str(e.value)


# -- deadlines --------------------------------------------------------------------------------


def test_bounded_gives_up_at_the_deadline_and_passes_results_and_errors(monkeypatch):
  from sexpgpu.retrying import bounded
  monkeypatch.setenv("SEXPGPU_REMOTE_TIMEOUT", "0.5")
  t0 = time.perf_counter()
  with pytest.raises(TimeoutError) as e:
    bounded("the listing of gs://b/x", time.sleep, 30)
  assert time.perf_counter() - t0 < 5 and "within 0.5 s (SEXPGPU_REMOTE_TIMEOUT)" in str(e.value)
  assert bounded("x", lambda a, b=0: a + b, 2, b=3) == 5
  with pytest.raises(FileNotFoundError):
    bounded("x", open, "/no/such/file")


def test_a_remote_resume_whose_store_does_not_answer_keeps_the_deadline(monkeypatch):
  from sexpgpu.ckpt import remote, resolve_resume, restore
  monkeypatch.setenv("SEXPGPU_REMOTE_TIMEOUT", "1")
  monkeypatch.setattr(restore, "remote_fs", lambda *a: object())
  monkeypatch.setattr(remote, "is_committed", lambda *a: time.sleep(60))  # a library retrying
  t0 = time.perf_counter()
  with pytest.raises(SxError) as e:
    resolve_resume("gs://bucket/run/5", None, "run")
  assert time.perf_counter() - t0 < 10
  assert e.value.code == "E-CKPT-003" and "no answer within 1 s" in e.value.message


def test_a_remote_cache_folder_is_refused_at_once(monkeypatch, capsys):
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", "s3://bucket/cache")
  t0 = time.perf_counter()
  assert main(["check", TINY]) == 1
  assert "error[E-ENV-001]" in capsys.readouterr().err and time.perf_counter() - t0 < 30

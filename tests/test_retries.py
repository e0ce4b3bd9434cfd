"""An S3 that blips: saves are retried through an outage (bitwise the same losses, retry lines);
an outage past SEXPGPU_REMOTE_TIMEOUT ends in E-CKPT-004 naming the last good step, which
resumes exactly. The store is moto on 127.0.0.1 behind tests/faultproxy.py's OutageProxy."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import ROOT, sexpgpu_cmd
from faultproxy import OutageProxy
from s3server import make_bucket, s3_env

pytestmark = pytest.mark.slow  # S3 on moto through a proxy that blips: runs and a resume

EXP = os.path.join(ROOT, "tests", "data", "faults.sx")
STEPS = "steps=60"
SLUG = "faults-steps=60"
COMMIT_PUT = rb"^PUT .*/COMMIT HTTP"


@pytest.fixture(scope="module")
def moto(moto_endpoint):
  return make_bucket(moto_endpoint, "blips")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The same run never interrupted, on a local folder: its losses."""
  tmp = tmp_path_factory.mktemp("ref")
  r = _run(["--checkpoint-dir", str(tmp / "ck"), "--metrics", f"jsonl:{tmp / 'm'}"], dict(os.environ))
  assert r.returncode == 0, r.stderr
  return _losses(tmp / "m")


def _env(endpoint, timeout_s):
  e = dict(os.environ)
  e.update(s3_env(endpoint))
  e["SEXPGPU_REMOTE_TIMEOUT"] = str(timeout_s)
  return e


def _run(args, env, **kw):
  return subprocess.run(sexpgpu_cmd("run", EXP, "--json", "--set", STEPS, *args), cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300, **kw)


def _losses(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


def test_a_blip_is_retried_and_the_run_is_unchanged(moto, reference, tmp_path):
  proxy = OutageProxy(int(moto.rsplit(":", 1)[1]))
  proxy.cut_at(COMMIT_PUT, nth=2, seconds=3.0)  # the commit marker of step 8
  t = time.monotonic()
  r = _run(["--checkpoint-dir", "s3://blips/short", "--metrics", f"jsonl:{tmp_path / 'm'}"],
           _env(proxy.endpoint, 60))
  assert r.returncode == 0, r.stderr
  assert proxy.cuts, "the outage never happened"
  assert f"checkpoint: commit marker of s3://blips/short/{SLUG}/8 failed (" in r.stderr
  assert "retrying for up to 60s" in r.stderr
  assert f"checkpoint: commit marker of s3://blips/short/{SLUG}/8 succeeded after" in r.stderr
  assert time.monotonic() - t > 3.0
  got = _losses(tmp_path / "m")
  assert sorted(got) == sorted(reference) and all(got[s] == reference[s] for s in got)
  assert json.loads(r.stdout)["checkpoint"] == f"s3://blips/short/{SLUG}/60"


def test_an_outage_past_the_deadline_names_the_last_good_step_which_resumes(moto, reference,
                                                                          tmp_path):
  proxy = OutageProxy(int(moto.rsplit(":", 1)[1]))
  proxy.cut_at(COMMIT_PUT, nth=2, seconds=60.0)  # step 8's marker never lands
  p = subprocess.Popen(sexpgpu_cmd("run", EXP, "--json", "--set", STEPS, "--checkpoint-dir",
                                   "s3://blips/long"), cwd=ROOT, env=_env(proxy.endpoint, 2),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    _, err = p.communicate(timeout=240)
  finally:
    if p.poll() is None:
      p.kill()
  t_cut = proxy.cuts[0][0]
  assert time.monotonic() - t_cut < 40, "the run outlived its deadline by far"
  assert p.returncode == 1 and "error[E-CKPT-004]" in err, err
  assert "giving up" in err
  assert f"previous: step 4 (s3://blips/long/{SLUG}/4) was the last checkpoint this run " \
         "completed" in err, err
  proxy.heal()
  r = _run(["--checkpoint-dir", "s3://blips/long", "--resume", "latest", "--metrics",
            f"jsonl:{tmp_path / 'm'}"], _env(proxy.endpoint, 60))
  assert r.returncode == 0, r.stderr
  assert f"latest=s3://blips/long/{SLUG}/4" in r.stderr
  assert "took over the lock" in r.stderr  # the failed run could not remove its lease
  got = _losses(tmp_path / "m")
  assert min(got) == 5 and all(got[s] == reference[s] for s in got)

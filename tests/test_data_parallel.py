"""Data parallel over XLA host devices: the same losses as one device; SEXPGPU_DEVICES errors."""

import json
import os
import subprocess

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _run(tmp_path, name, devices=None, extra=(), env=None):
  m = tmp_path / f"{name}.jsonl"
  e = dict(os.environ)
  e.pop("SEXPGPU_DEVICES", None)
  if devices:
    e["SEXPGPU_DEVICES"] = devices
  e.update(env or {})
  p = subprocess.run(sexpgpu_cmd("run", TINY, "--variant", "smoke", "--set", "microbatches=4",
                                 "--steps", "8", "--metrics", f"jsonl:{m}", "--json", *extra),
                     cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
  return p, m


def _losses(m):
  return [e["train/loss"] for e in map(json.loads, open(m)) if e["kind"] == "step"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """The reference the tests below compare with, run once: 8 steps on host device 0 alone,
  with checkpoints (the last one is what a resume over two devices is refused)."""
  tmp = tmp_path_factory.mktemp("one")
  p, m = _run(tmp, "one", "0", extra=("--checkpoint-dir", str(tmp / "ck")))
  assert p.returncode == 0, p.stderr
  return p, m, tmp / "ck"


@pytest.mark.slow  # runs over host devices, each a subprocess
def test_two_host_devices_match_one(tmp_path, one_device):
  p1, m1, _ = one_device
  p2, m2 = _run(tmp_path, "two", "0,1")
  assert p1.returncode == 0 and p2.returncode == 0, p2.stderr
  assert "device cpu ranks 2 nodes 1 steps 8" in p2.stderr.splitlines()[0]
  np.testing.assert_allclose(_losses(m2), _losses(m1), rtol=0, atol=1e-5)
  a, b = json.loads(p1.stdout), json.loads(p2.stdout)
  assert a["counters"] == b["counters"]
  assert b["eval"]["eval/loss"] == pytest.approx(a["eval"]["eval/loss"], abs=1e-5)


@pytest.mark.slow  # runs over host devices, each a subprocess
def test_two_host_devices_with_stacking_1(tmp_path, one_device):
  p1, m1, _ = one_device
  p2, m2 = _run(tmp_path, "two", "0,1", env={"SEXPGPU_STACKING": "1"})
  assert p2.returncode == 0, p2.stderr
  np.testing.assert_allclose(_losses(m2), _losses(m1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("value,needle", [("zero,one", "does not parse"),
                                          ("0,0", "repeats ordinal 0")])
def test_bad_device_lists_are_e_dp_001(tmp_path, value, needle):
  p, _ = _run(tmp_path, "bad", value)
  assert p.returncode == 1 and "error[E-DP-001]" in p.stderr and needle in p.stderr
  assert "SEXPGPU_DEVICES" in p.stderr


def test_an_invisible_ordinal_is_e_dp_001(tmp_path):
  p, _ = _run(tmp_path, "bad", "0,3",
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert p.returncode == 1 and "error[E-DP-001]" in p.stderr and "ordinal 3" in p.stderr


def test_an_ordinal_past_the_cpus_is_e_dp_001_as_doctor_says(tmp_path):
  p, _ = _run(tmp_path, "bad", str(os.cpu_count() or 1))
  assert p.returncode == 1 and "error[E-DP-001]" in p.stderr and "not visible" in p.stderr
  assert "Traceback" not in p.stderr


@pytest.mark.slow  # runs over host devices, each a subprocess
def test_one_rank_on_host_device_1_trains_as_on_device_0(tmp_path, one_device):
  if (os.cpu_count() or 1) < 2:
    pytest.skip("one CPU: host device 1 is not visible")
  p0, m0, _ = one_device
  p1, m1 = _run(tmp_path, "one", "1")
  assert p0.returncode == 0 and p1.returncode == 0, p1.stderr
  assert _losses(m1) == _losses(m0)


def test_microbatches_must_divide_e_dp_003(tmp_path):
  p, _ = _run(tmp_path, "bad", "0,1,2",
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
  assert p.returncode == 1 and "error[E-DP-003]" in p.stderr


@pytest.mark.slow  # runs over host devices, each a subprocess
def test_resume_with_another_rank_count_is_e_dp_002(tmp_path, one_device):
  _, _, ck = one_device  # the resume is refused before it writes anything there
  p2, _ = _run(tmp_path, "two", "0,1", extra=("--checkpoint-dir", str(ck), "--resume", "latest",
                                              "--steps", "10"))
  assert p2.returncode == 1 and "error[E-DP-002]" in p2.stderr
  assert "1 ranks" in p2.stderr and "2 ranks" in p2.stderr

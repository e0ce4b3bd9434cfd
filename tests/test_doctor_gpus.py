"""The GPUs doctor and the sweep see, against a stand-in `nvidia-smi` (two H100s, the second
split into MIG slices), under CUDA_VISIBLE_DEVICES of indices, GPU- UUIDs and MIG- UUIDs;
and why a CUDA backend did not start, told apart from a driver problem."""

import logging
import os
import subprocess

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.devices import doctor
from sexpgpu.tools import sweep

CARD0 = "GPU-6f3a1c2e-0b4d-4e8a-9a1b-2c3d4e5f6a7b"
CARD1 = "GPU-b81d5e77-1c2f-4a3b-8d9e-0f1a2b3c4d5e"
MIG_A = "MIG-c2e4a6b8-1d3f-5a7c-9e1b-3d5f7a9c1e3b"
MIG_B = "MIG-d4f6b8c1-2e4a-6b8d-1f3c-5e7a9c1e3b5d"

# What nvidia-smi prints (it lists every card, whatever CUDA_VISIBLE_DEVICES says)
SMI = f"""#!/bin/sh
case "$*" in
  *--query-gpu=index,uuid,name,compute_cap,memory.total*)
    echo "0, {CARD0}, NVIDIA H100 80GB HBM3, 9.0, 81559 MiB"
    echo "1, {CARD1}, NVIDIA H100 80GB HBM3, 9.0, 81559 MiB" ;;
  *--query-gpu=driver_version*) echo "580.65.06"; echo "580.65.06" ;;
  -L)
    echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: {CARD0})"
    echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: {CARD1})"
    echo "  MIG 1g.10gb     Device  0: (UUID: {MIG_A})"
    echo "  MIG 3g.40gb     Device  1: (UUID: {MIG_B})" ;;
  *) exit 6 ;;
esac
"""


@pytest.fixture
def smi(tmp_path, monkeypatch):
  """The stand-in nvidia-smi first on PATH; yields the folder it lies in."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "nvidia-smi").write_text(SMI)
  (bin_dir / "nvidia-smi").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  return bin_dir


def _uuids(monkeypatch, cvd):
  if cvd is None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  else:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
  return [g.uuid for g in doctor.gpus()]


@pytest.mark.parametrize("cvd,seen", [
    (None, [CARD0, CARD1]),
    ("1,0", [CARD1, CARD0]),
    (CARD1, [CARD1]),                       # a whole UUID
    (f"{CARD1[:12]},{CARD0[:10]}", [CARD1, CARD0]),  # prefixes that name one card each
    ("GPU-", []),                           # a prefix of both names neither
    (MIG_B, [MIG_B]),
    (f"{MIG_A},{MIG_B}", [MIG_A, MIG_B]),
    ("1,bogus,0", [CARD1]),                 # CUDA stops at the first entry naming nothing
    ("-1", []),
    ("", []),
])
def test_visible_devices_read_as_cuda_reads_them(smi, monkeypatch, cvd, seen):
  assert _uuids(monkeypatch, cvd) == seen


def test_a_mig_slice_is_named_with_its_profile_and_memory(smi, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_A)
  checks = doctor.check_gpus("cuda")
  assert [c.line() for c in checks] == [
      "ok gpu 0: NVIDIA H100 80GB HBM3 MIG 1g.10gb, compute capability 9.0, 10gb"]
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_B}")
  checks = doctor.check_gpus("cuda")
  assert [c.status for c in checks] == ["ok", "ok", "warn"]
  assert checks[2].name == "mig" and "2 MIG slices" in checks[2].detail


def test_ranks_are_checked_against_the_uuids_visible(smi, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{CARD1},{CARD0}")
  ok = doctor.check_devices("cuda", {"SEXPGPU_DEVICES": "0,1"})
  assert ok.status == "ok" and "ranks on cuda 0,1" in ok.detail
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", CARD1)
  bad = doctor.check_devices("cuda", {"SEXPGPU_DEVICES": "0,1"})
  assert bad.status == "fail" and "E-DP-001" in bad.detail


def test_the_sweep_shares_the_gpus_cuda_sees(smi, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,bogus,0")
  assert sweep._gpu_count() == 1
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{CARD0[:8]},{CARD1}")
  assert sweep._gpu_count() == 2


def test_without_nvidia_smi_the_count_reads_the_variable(monkeypatch, tmp_path):
  monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{CARD0},{MIG_A},-1,2")
  assert doctor.gpus() == [] and doctor.gpu_count() == 2


def test_doctor_lists_the_gpu_a_uuid_names(smi):
  env = {k: v for k, v in os.environ.items() if not k.startswith("SEXPGPU_")}
  env.update(SEXPGPU_CACHE_DIR=os.environ["SEXPGPU_CACHE_DIR"], CUDA_VISIBLE_DEVICES=CARD1,
             SEXPGPU_DEVICES="0")
  p = subprocess.run(sexpgpu_cmd("doctor", "--device", "cuda"), cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  lines = p.stdout.splitlines()
  assert "ok gpu 0: NVIDIA H100 80GB HBM3, compute capability 9.0, 81559 MiB" in lines, lines
  assert not any(ln.startswith("fail gpu") for ln in lines)
  assert "ok SEXPGPU_DEVICES: 0: ranks on cuda 0" in lines


# --- a CUDA backend that did not start -----------------------------------------------

def _backend_fails(monkeypatch, error, warning=None):
  """jax.devices as it behaves with the plugin installed and its backend failing: the
  plugin's warning logged while starting (as jax_plugins.xla_cuda13 logs it), then JAX's
  error."""
  import jax

  def devices(kind=None):
    if warning:
      logging.getLogger("jax_plugins.xla_cuda13").warning(
          "CUDA version check failed during initialization. CUDA backend will not be "
          "available. Error: %s", warning)
    raise RuntimeError(error)
  monkeypatch.setattr(jax, "devices", devices)
  monkeypatch.setattr(doctor, "_plugin", lambda: "jax_plugins.xla_cuda13")


def test_a_missing_cuda_library_is_not_blamed_on_the_driver(monkeypatch):
  _backend_fails(monkeypatch, "Unknown backend cuda. Available backends are ['cpu']",
                 "Unable to load cuFFT. Is it installed?")
  c = doctor.check_plugin("cuda")
  assert c.status == "fail" and "the CUDA library cuFFT cannot be loaded" in c.detail
  assert c.fix == doctor.FIX_LIBRARY and c.fix != doctor.FIX_DRIVER
  assert "(Unknown backend cuda." in c.detail


@pytest.mark.parametrize("error,cause,fix", [
    ("Unable to initialize backend 'cuda': FAILED_PRECONDITION: No visible GPU devices. "
     "INTERNAL: CUDA error: CUDA_ERROR_INSUFFICIENT_DRIVER", "too old", doctor.FIX_DRIVER),
    ("Unable to initialize backend 'cuda': INTERNAL: no CUDA-capable device is detected",
     "CUDA finds no GPU", doctor.FIX_VISIBLE),
    ("Unable to initialize backend 'cuda': no supported devices found for platform CUDA.",
     "memory is taken", doctor.FIX_BUSY),
])
def test_each_backend_error_has_its_own_cause(monkeypatch, error, cause, fix):
  _backend_fails(monkeypatch, error)
  c = doctor.check_plugin("cpu")
  assert c.status == "warn" and cause in c.detail and c.fix == fix


def test_unknown_backend_is_told_apart_by_device_nodes_and_libraries():
  text = "Unknown backend cuda. Available backends are ['cpu']"
  cause, fix = doctor.plugin_failure(text, device_nodes=False, missing=[])
  assert "no NVIDIA device node" in cause and fix.startswith(doctor.FIX_DRIVER)
  cause, fix = doctor.plugin_failure(text, device_nodes=True, missing=["libcufft"])
  assert cause == "the CUDA libraries libcufft cannot be loaded" and fix == doctor.FIX_LIBRARY
  cause, fix = doctor.plugin_failure(text, device_nodes=True, missing=[])
  assert "TF_CPP_MIN_LOG_LEVEL=0" in fix

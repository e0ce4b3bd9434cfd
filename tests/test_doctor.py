"""`sexpgpu doctor`: its lines, its exit code, and the variables it checks."""

import os
import stat

import pytest

from sexpgpu.cli import doctor as cli_doctor
from sexpgpu.cli.main import main
from sexpgpu.devices import doctor

NAMES = ["python", "jax", "jaxlib", "cuda plugin", "driver", "cudnn", "nvrtc", "cublas",
         "SEXPGPU_DEVICES", "nodes", "SEXPGPU_RENDEZVOUS_TIMEOUT", "cache", "checkpoints"]
HAS_GPU = bool(doctor.gpus())


@pytest.fixture
def run_doctor(monkeypatch, capsys):
  """`sexpgpu doctor ARGS` in this process with only the given SEXPGPU_* variables (and the
  suite's cache): (exit code, its lines, standard error). A process of its own would add
  a JAX import and nothing the checks read."""
  def run(*args, **env):
    for name in [k for k in os.environ if k.startswith("SEXPGPU_") and k != "SEXPGPU_CACHE_DIR"]:
      monkeypatch.delenv(name)
    for name, value in env.items():
      monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = main(["doctor", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out.splitlines(), err
  return run


def _line(lines, name):
  hits = [ln for ln in lines if ln.split(" ", 1)[1].startswith(name + ":")]
  assert hits, (name, lines)
  return hits[0]


def test_default_exits_0_with_every_check(run_doctor):
  rc, lines, err = run_doctor()
  assert rc == 0, (lines, err)
  for ln in lines:
    assert ln.split(" ", 1)[0] in ("ok", "warn"), ln
  for name in NAMES:
    _line(lines, name)
  assert _line(lines, "python").startswith("ok python: 3.")
  if not HAS_GPU:
    assert "no GPU: cuda runs unavailable" in _line(lines, "gpu")
    assert _line(lines, "gpu").startswith("warn")


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_cuda_without_gpu_fails(run_doctor):
  rc, lines, _ = run_doctor("--device", "cuda")
  assert rc == 1
  assert _line(lines, "gpu").startswith("fail gpu: no GPU visible — fix:")


def test_bad_devices_is_e_dp_001(run_doctor):
  rc, lines, _ = run_doctor(SEXPGPU_DEVICES="0,0")
  assert rc == 1
  ln = _line(lines, "SEXPGPU_DEVICES")
  assert ln.startswith("fail SEXPGPU_DEVICES: error[E-DP-001]") and "repeats ordinal 0" in ln
  assert "fix: list visible ordinals once each" in ln


def test_bad_nodes_is_e_dp_005(run_doctor):
  rc, lines, _ = run_doctor(SEXPGPU_NODES="two")
  assert rc == 1
  ln = _line(lines, "nodes")
  assert ln.startswith("fail nodes: error[E-DP-005]") and "SEXPGPU_NODES=two" in ln
  rc, lines, _ = run_doctor(SEXPGPU_NODES="2", SEXPGPU_NODE_RANK="0",
                         SEXPGPU_RENDEZVOUS="127.0.0.1:29500")
  assert rc == 1 and "needs the cuda device" in _line(lines, "nodes")


def test_checkpoint_location(run_doctor, tmp_path):
  rc, lines, _ = run_doctor(SEXPGPU_CHECKPOINT_DIR=str(tmp_path / "ck"))
  assert rc == 0 and _line(lines, "checkpoints").startswith("ok checkpoints:")
  assert not os.listdir(tmp_path / "ck")  # the probe leaves nothing behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_checkpoint_location_fails(run_doctor, tmp_path):
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
  try:
    rc, lines, _ = run_doctor(SEXPGPU_CHECKPOINT_DIR=str(ro / "ck"))
  finally:
    ro.chmod(stat.S_IRWXU)
  assert rc == 1 and _line(lines, "checkpoints").startswith("fail checkpoints:")


def test_checkpoint_location_that_is_a_file_fails(tmp_path):
  f = tmp_path / "file"
  f.write_text("not a folder")
  checks = cli_doctor.check_checkpoints({"SEXPGPU_CHECKPOINT_DIR": str(f)})
  assert checks[-1].status == "fail" and "E-CKPT-004" in checks[-1].line()


def test_s3_endpoint_that_does_not_answer_fails():
  checks = cli_doctor.check_checkpoints({"SEXPGPU_CHECKPOINT_DIR": "s3://bucket/runs",
                                     "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
  assert [c.status for c in checks] == ["fail"] and checks[0].name == "s3 endpoint"


def test_bad_device_flag(run_doctor):
  rc, _, err = run_doctor("--device", "tpu")
  assert rc == 1 and "error[E-DEV-001]" in err

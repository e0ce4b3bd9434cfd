"""Opening the cuda device: E-DEV-001 without CUDA, E-DEV-002 for an old card, E-DEV-003 for an
old driver (the last two with the driver and the device list stood in for, as no GPU is here)."""

import os
import subprocess

import pytest

import sexpgpu.devices.doctor as doctor
import sexpgpu.run.backend as devices
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.errors import SxError


def test_no_cuda_backend_is_e_dev_001():
  env = dict(os.environ, SEXPGPU_DEVICE="cuda")
  p = subprocess.run(sexpgpu_cmd("run", "configs/tiny-lm.sx", "--steps", "1"), cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 1 and "error[E-DEV-001]" in p.stderr
  assert 'pip install "sexpgpu[cuda]"' in p.stderr and "Traceback" not in p.stderr


def test_an_old_driver_is_e_dev_003(monkeypatch):
  monkeypatch.setattr(doctor, "driver_version", lambda: "535.104.05")
  with pytest.raises(SxError) as e:
    devices.open_device("cuda")
  assert e.value.code == "E-DEV-003" and "535.104.05" in e.value.message


class _Card:
  platform = "gpu"
  device_kind = "Tesla T4"
  id = 0
  compute_capability = "7.5"


def test_an_old_card_is_e_dev_002(monkeypatch):
  import jax
  monkeypatch.setattr(doctor, "driver_version", lambda: "580.65.06")
  monkeypatch.setattr(jax, "devices", lambda kind=None: [_Card()])
  with pytest.raises(SxError) as e:
    devices.open_device("cuda")
  assert e.value.code == "E-DEV-002" and "Tesla T4" in e.value.message and "7.5" in e.value.message


def test_deterministic_variable_is_checked(monkeypatch):
  monkeypatch.setenv("SEXPGPU_DETERMINISTIC", "yes")
  with pytest.raises(SxError) as e:
    devices.deterministic_flags()
  assert e.value.code == "E-ENV-001"
  monkeypatch.setenv("SEXPGPU_DETERMINISTIC", "1")
  monkeypatch.setenv("XLA_FLAGS", "")
  devices.deterministic_flags()
  assert "--xla_gpu_deterministic_ops=true" in os.environ["XLA_FLAGS"]


def _flag(name):
  return {k: v for k, _, v in (f.lstrip("-").partition("=")
                               for f in os.environ["XLA_FLAGS"].split())}.get(name)


def test_deterministic_runs_keep_autotuning_with_the_checkpoint(monkeypatch, tmp_path):
  """Under SEXPGPU_DETERMINISTIC=1 XLA writes its autotuning results to a file; a
  checkpoint's meta carries them; a resume loads them before the backend starts."""
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path))
  monkeypatch.setenv("SEXPGPU_DETERMINISTIC", "1")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
  devices.deterministic_flags()
  dump = _flag("xla_gpu_dump_autotune_results_to")
  assert dump == devices.autotune_dump_path() and dump.startswith(str(tmp_path / "autotune"))
  assert _flag("xla_gpu_autotune_level") == "2" and _flag("xla_gpu_load_autotune_results_from") is None
  assert devices.autotune_results() is None  # nothing autotuned yet
  with open(dump, "w") as f:  # what XLA writes after a compilation that autotuned
    f.write("version: 3\nresults { device: \"sm_90\" }\n")
  tuned = devices.autotune_results()
  assert tuned["results"].startswith("version: 3") and tuned["jaxlib"]
  meta = {"step": 3, "xla_autotune": tuned}
  assert devices.autotune_of(meta) == tuned
  assert devices.autotune_of({"xla_autotune": dict(tuned, jaxlib="0.0.1")}) is None
  assert devices.autotune_of({"step": 3}) is None and devices.autotune_of(None) is None
  monkeypatch.setenv("XLA_FLAGS", "")
  devices.deterministic_flags(tuned)
  loaded = _flag("xla_gpu_load_autotune_results_from")
  assert open(loaded).read() == tuned["results"]
  monkeypatch.setenv("SEXPGPU_DETERMINISTIC", "0")
  monkeypatch.setenv("XLA_FLAGS", "")
  devices.deterministic_flags(tuned)
  assert os.environ["XLA_FLAGS"] == "" and devices.autotune_results() is None


@pytest.mark.parametrize("name,value", [("SEXPGPU_MEMORY", "lots"), ("SEXPGPU_PATTERNS", "maybe"),
                                        ("SEXPGPU_RENDEZVOUS_TIMEOUT", "-3"),
                                        ("SEXPGPU_DETERMINISTIC", "yes"),
                                        ("SEXPGPU_CPU_COLLECTIVES", "mpi"),
                                        ("SEXPGPU_STACKING", "0")])
def test_a_variable_that_does_not_parse_is_e_env_001_before_anything_runs(name, value):
  env = dict(os.environ, **{name: value})
  p = subprocess.run(sexpgpu_cmd("run", "configs/tiny-lm.sx", "--steps", "1"), cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 1 and p.stderr.startswith("error[E-ENV-001]"), p.stderr
  assert name in p.stderr


_FLAGS_AND_CACHE = """
import json, os, sys
import sexpgpu.run.backend as devices
tuned = json.loads(sys.argv[1])
devices.deterministic_flags(tuned)
flags = os.environ["XLA_FLAGS"]
import jax, jax.numpy as jnp  # the backend starts here and parses the flags
counter = devices.CompileCounter.install(os.environ["SEXPGPU_CACHE_DIR"])
jax.jit(lambda x: jnp.sin(x) * 3.0 + x).lower(jnp.ones((64,), jnp.float32)).compile()
print(json.dumps({"flags": flags, "hits": counter.snapshot()[2]}))
"""


@pytest.mark.slow  # two processes each
@pytest.mark.parametrize("resumed", [False, True])
def test_deterministic_processes_set_equal_flags_and_share_cache_hits(tmp_path, resumed):
  """Two processes under SEXPGPU_DETERMINISTIC=1 (fresh, or resuming one checkpoint's
  autotuning results): equal XLA_FLAGS, which this jaxlib parses, so the second process
  hits the first one's persistent compilation cache."""
  import json
  import sys
  tuned = {"jaxlib": "x", "results": "version: 3\n"} if resumed else None
  env = dict(os.environ, SEXPGPU_DETERMINISTIC="1", SEXPGPU_CACHE_DIR=str(tmp_path),
             XLA_FLAGS="")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's shared XLA cache: not this test's
  outs = []
  for _ in range(2):
    p = subprocess.run([sys.executable, "-c", _FLAGS_AND_CACHE, json.dumps(tuned)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
  assert outs[0]["flags"] == outs[1]["flags"]
  assert "--xla_gpu_deterministic_ops=true" in outs[0]["flags"]
  assert ("--xla_gpu_load_autotune_results_from=" in outs[0]["flags"]) == resumed
  # the first compiles everything afresh; the second finds each of those programs cached
  assert outs[0]["hits"] == 0 and outs[1]["hits"] > 0


def test_jaxs_own_cache_variable_moves_the_xla_cache(tmp_path):
  """JAX_COMPILATION_CACHE_DIR, when set, is where the XLA cache goes (runs may share one);
  the rest of the sexpgpu cache stays under SEXPGPU_CACHE_DIR."""
  import json
  import sys
  env = dict(os.environ, SEXPGPU_CACHE_DIR=str(tmp_path / "sx"),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"), XLA_FLAGS="")
  env.pop("SEXPGPU_DETERMINISTIC", None)
  hits = []
  for _ in range(2):
    p = subprocess.run([sys.executable, "-c", _FLAGS_AND_CACHE, "null"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    hits.append(json.loads(p.stdout.strip().splitlines()[-1])["hits"])
  assert hits[0] == 0 and hits[1] > 0
  assert os.listdir(tmp_path / "xla") and not (tmp_path / "sx" / "xla").exists()


def test_autotuning_results_written_before_this_process_are_not_its_own(monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path))
  monkeypatch.setenv("SEXPGPU_DETERMINISTIC", "1")
  monkeypatch.setenv("XLA_FLAGS", "")
  path = devices.autotune_dump_path()
  with open(path, "w") as f:
    f.write("version: 3\nresults { device: \"another process\" }\n")
  os.utime(path, (1e9, 1e9))  # written long before this process set its flags
  monkeypatch.setattr(devices, "_dump_since", None)
  devices.deterministic_flags()
  assert devices.autotune_results() is None
  with open(path, "w") as f:  # what XLA writes after this process's compilation
    f.write("version: 3\nresults { device: \"sm_90\" }\n")
  assert "sm_90" in devices.autotune_results()["results"]


class _Cpu:
  platform = "cpu"
  process_index = 0
  id = 0


def test_a_node_whose_cuda_backend_failed_never_trains_on_cpu_devices(monkeypatch):
  """Over nodes, `jax.devices()` after a failed CUDA backend lists the CPU's devices."""
  import jax

  class Nodes:
    nodes = 2
  monkeypatch.setattr(jax, "devices", lambda kind=None: [_Cpu()])
  with pytest.raises(SxError) as e:
    devices.open_devices("cuda", None, Nodes())
  assert e.value.code == "E-DEV-001" and "JAX offers cpu devices instead" in e.value.message

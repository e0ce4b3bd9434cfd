"""The SEXPGPU_* variables: one parser each, and `run` and `doctor` saying the same for a bad one."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu import env
from sexpgpu.devices import doctor
from sexpgpu.errors import SxError
from sexpgpu.run import backend as run_devices
from sexpgpu.run import flags as run_env

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _code(fn, *args):
  with pytest.raises(SxError) as e:
    fn(*args)
  return e.value


def test_devices():
  assert run_devices.parse_device_list is env.parse_device_list  # run's parser is doctor's
  assert env.parse_device_list(None) is None and env.parse_device_list(" ") is None
  assert env.parse_device_list("2, 0") == [2, 0]
  assert env.parse_devices(None, 4) == [0, 1, 2, 3]
  assert env.parse_devices("", 2) == [0, 1]
  assert env.parse_devices("2, 0", 4) == [2, 0]
  assert env.parse_devices("1", 2) == [1]


@pytest.mark.parametrize("value,visible,says", [
    ("0,x", 2, "does not parse"), ("0,0", 2, "repeats ordinal 0"), ("0,2", 2, "not visible"),
    ("-1", 2, "does not parse"), ("0,,1", 2, "does not parse"), (None, 0, "no GPU is visible")])
def test_bad_devices_are_e_dp_001(value, visible, says):
  e = _code(env.parse_devices, value, visible)
  assert e.code == "E-DP-001" and says in e.message and e.where == "SEXPGPU_DEVICES"
  assert e.fix == "list visible ordinals once each, SEXPGPU_DEVICES=0,1"


GOOD = {"SEXPGPU_NODES": "2", "SEXPGPU_NODE_RANK": "1", "SEXPGPU_RENDEZVOUS": "10.0.0.1:29500"}


def test_nodes():
  assert env.parse_nodes({}, "cuda") is None
  assert env.parse_nodes({"SEXPGPU_NODES": "1"}, "cpu") is None
  c = env.parse_nodes(GOOD, "cuda")
  assert (c.nodes, c.rank, c.host, c.port, c.gradients, c.collectives) == (
      2, 1, "10.0.0.1", 29500, "bf16", "nccl")
  assert c.rendezvous == "10.0.0.1:29500"
  c = env.parse_nodes(dict(GOOD, SEXPGPU_NODE_GRADIENTS="f32", SEXPGPU_CPU_COLLECTIVES="gloo",
                           SEXPGPU_RENDEZVOUS="node-0.local:1234"), "cpu")
  assert c.gradients == "f32" and c.collectives == "gloo" and c.host == "node-0.local"


@pytest.mark.parametrize("change,where", [
    ({"SEXPGPU_NODES": "two"}, "SEXPGPU_NODES"), ({"SEXPGPU_NODES": "0"}, "SEXPGPU_NODES"),
    ({"SEXPGPU_NODE_RANK": "2"}, "SEXPGPU_NODE_RANK"),
    ({"SEXPGPU_NODE_RANK": ""}, "SEXPGPU_NODE_RANK"),
    ({"SEXPGPU_RENDEZVOUS": "10.0.0.1"}, "SEXPGPU_RENDEZVOUS"),
    ({"SEXPGPU_RENDEZVOUS": "host:99999"}, "SEXPGPU_RENDEZVOUS"),
    ({"SEXPGPU_NODE_GRADIENTS": "f16"}, "SEXPGPU_NODE_GRADIENTS")])
def test_bad_node_variables_are_e_dp_005(change, where):
  e = _code(env.parse_nodes, dict(GOOD, **change), "cuda")
  assert e.code == "E-DP-005" and e.where == where and where in e.message
  assert e.fix == "set all three on every node, with SEXPGPU_DEVICE=cuda"


def test_nodes_need_cuda_unless_gloo():
  e = _code(env.parse_nodes, GOOD, "cpu")
  assert e.code == "E-DP-005" and "cuda" in e.message
  assert env.parse_nodes(dict(GOOD, SEXPGPU_CPU_COLLECTIVES="gloo"), "cpu") is not None


def test_one_node_takes_rank_0_only():
  assert env.parse_nodes({"SEXPGPU_NODES": "1", "SEXPGPU_NODE_RANK": "0"}, "cpu") is None
  for nodes in ({"SEXPGPU_NODES": "1"}, {}):
    e = _code(env.parse_nodes, dict(nodes, SEXPGPU_NODE_RANK="3"), "cpu")
    assert e.code == "E-DP-005" and e.where == "SEXPGPU_NODE_RANK"


def test_cpu_devices_visible_are_the_cpus_or_xlas_forced_count():
  assert env.cpu_visible({}) == (os.cpu_count() or 1)
  assert env.cpu_visible({"XLA_FLAGS": "--xla_force_host_platform_device_count=7"}) == 7
  e = _code(env.check_visible, [0, 3], 2, "cpu")
  assert e.code == "E-DP-001" and "ordinal 3" in e.message and "0..1" in e.message


def test_microbatches_divide_is_the_one_e_dp_003():
  run_devices.microbatches_divide(8, 2)
  e = _code(run_devices.microbatches_divide, 6, 4)
  assert e.code == "E-DP-003" and e.where == "SEXPGPU_DEVICES"


@pytest.mark.parametrize("value,want", [(None, False), ("", False), ("0", False), ("1", True)])
def test_switches(value, want):
  assert env.parse_switch("SEXPGPU_DEBUG", value) is want


@pytest.mark.parametrize("name", ["SEXPGPU_DEBUG", "SEXPGPU_DETERMINISTIC"])
def test_a_switch_is_0_or_1_never_ignored(name):
  e = _code(env.parse_switch, name, "yes")
  assert e.code == "E-ENV-001" and e.where == name and f"{name}=yes" in e.message


def test_every_parsed_variable_is_checked_by_run():
  bad = {name: {"SEXPGPU_MEMORY": "lots", "SEXPGPU_RENDEZVOUS_TIMEOUT": "soon",
                "SEXPGPU_METRICS": "foo:bar", "SEXPGPU_STACKING": "0",
                "SEXPGPU_DEVICE": "tpu", "SEXPGPU_CACHE_DIR": "s3://bucket/cache",
                "JAX_COMPILATION_CACHE_DIR": "/proc/version/x"}.get(name, "maybe")
         for name in env.VARIABLES}
  for name, value in bad.items():
    found = env.variable_errors({name: value})
    assert [n for n, _ in found] == [name], (name, found)
    assert found[0][1].where == name


# One malformed value each; `run` and `check` refuse it, `doctor` fails on it, with the same words.
BAD = [("SEXPGPU_DEVICES", "0,0"), ("SEXPGPU_DEVICES", "x"), ("SEXPGPU_DEVICES", "5"),
       ("SEXPGPU_NODES", "two"), ("SEXPGPU_NODE_RANK", "3"), ("SEXPGPU_NODE_GRADIENTS", "f16"),
       ("SEXPGPU_RENDEZVOUS_TIMEOUT", "soon"), ("SEXPGPU_MEMORY", "lots"),
       ("SEXPGPU_STACKING", "0"), ("SEXPGPU_DETERMINISTIC", "yes"), ("SEXPGPU_DEBUG", "yes"),
       ("SEXPGPU_PATTERNS", "maybe"), ("SEXPGPU_CPU_COLLECTIVES", "mpi"),
       ("SEXPGPU_METRICS", "foo:bar"), ("SEXPGPU_DEVICE", "tpu")]


@pytest.mark.parametrize("name,value", BAD)
def test_run_and_doctor_say_the_same(monkeypatch, capsys, tmp_path, name, value):
  for k in [k for k in os.environ if k.startswith("SEXPGPU_") and k != "SEXPGPU_CACHE_DIR"]:
    monkeypatch.delenv(k)
  monkeypatch.setenv("SEXPGPU_CHECKPOINT_DIR", str(tmp_path / "ck"))
  if name == "SEXPGPU_DEVICES" and value == "5":
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                       + " --xla_force_host_platform_device_count=2")
  monkeypatch.setenv(name, value)
  assert main(["run", TINY, "--variant", "smoke", "--steps", "1"]) == 1
  err = capsys.readouterr().err
  m = re.search(r"^error\[(E-[A-Z]+-\d{3})\]: (.*)$", err, re.M)
  assert m and f"  --> {name}\n" in err, err  # the variable is named, not a flag
  said = _doctor_says(capsys)
  assert f"error[{m.group(1)}]" in said and m.group(2) in said, said
  if (name, value) != ("SEXPGPU_DEVICES", "5"):  # visibility is known once devices are open
    assert main(["check", TINY, "--variant", "smoke"]) == 1
    assert m.group(0) in capsys.readouterr().err


def _doctor_says(capsys) -> str:
  """What `doctor` prints about the variables: its command's device check, then its checks of
  the variables (the GPU library probes are left to test_doctor's subprocesses: loading cuDNN
  without a GPU can crash the process that loads it)."""
  device = os.environ.get("SEXPGPU_DEVICE") or "cpu"
  if device not in ("cpu", "cuda"):
    assert main(["doctor"]) == 1  # refused before any check runs
    said = capsys.readouterr()
    return said.out + said.err
  checks = [doctor.check_devices(device, os.environ), *doctor.check_nodes(device, os.environ),
            *doctor.check_variables(os.environ)]
  return "\n".join(c.line() for c in checks)


@pytest.mark.parametrize("text,n", [("40GiB", 40 << 30), ("64MiB", 64 << 20), ("1.5GB", 1_500_000_000),
                                    ("512 kib", 512 << 10), ("1000", 1000), ("2TB", 2 * 10**12)])
def test_memory(text, n):
  assert env.parse_memory(text) == n


@pytest.mark.parametrize("text", ["", "lots", "40G", "-1GiB", "0", "1.2.3MiB", "GiB"])
def test_bad_memory_is_e_env_001(text):
  e = _code(env.parse_memory, text)
  assert e.code == "E-ENV-001" and e.where == "SEXPGPU_MEMORY"


def test_rendezvous_timeout():
  assert env.rendezvous_timeout({}) == 300
  assert env.rendezvous_timeout({"SEXPGPU_RENDEZVOUS_TIMEOUT": "3"}) == 3
  for bad in ("soon", "0", "-5", "nan", "inf"):
    e = _code(env.rendezvous_timeout, {"SEXPGPU_RENDEZVOUS_TIMEOUT": bad})
    assert e.code == "E-ENV-001" and e.where == "SEXPGPU_RENDEZVOUS_TIMEOUT"


def test_env_module_does_not_import_jax():
  code = ("import sys; import sexpgpu.env, sexpgpu.devices.memory, "
          "sexpgpu.devices.nodes, sexpgpu.devices.report; print('jax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"

"""The device variables: SEXPGPU_DEVICES, the node variables, SEXPGPU_MEMORY, the timeout."""

import subprocess
import sys

import pytest

from sexpgpu.devices import env
from sexpgpu.errors import SxError


def _code(fn, *args):
  with pytest.raises(SxError) as e:
    fn(*args)
  return e.value


def test_devices():
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


def test_check_divides():
  env.check_divides(8, 2)
  e = _code(env.check_divides, 6, 4)
  assert e.code == "E-DP-003" and e.fix == "pick a device count that divides :microbatches"


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
  code = ("import sys; import sexpgpu.devices.env, sexpgpu.devices.memory, "
          "sexpgpu.devices.nodes, sexpgpu.devices.report; print('jax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"

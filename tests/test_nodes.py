"""Several nodes rehearsed on cpu over loopback: the rendezvous, E-DP-006, E-DP-007."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.devices import nodes

# One node: parse the variables, join, compare, then one all-reduce over gloo.
WORKER = r"""
import json, os, sys
from sexpgpu import env
from sexpgpu.devices import nodes
from sexpgpu.errors import SxError
try:
  cfg = env.parse_nodes(os.environ, "cpu")
  status = os.environ.get("STATUS_FILE")
  def on_timeout(err):
    if status:
      with open(status, "w") as f:
        json.dump({"state": "failed", "error": err.code}, f)
  nodes.initialize(cfg, env.rendezvous_timeout(), on_timeout)
  nodes.compare_at_rendezvous({"nodes": cfg.nodes, "node": cfg.rank, "gpus": 1,
                               "fingerprint": sys.argv[1], "gradients": cfg.gradients,
                               "resume": None})
  import jax, jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((cfg.nodes,), ("node",))
  with nodes.quiet_collectives():
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("node")),
                                               jnp.full((1,), cfg.rank + 1.0))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    total = float(total.addressable_shards[0].data)
  digest = nodes.params_hash({"w": jnp.arange(4.0) * (1 + int(sys.argv[2]) * cfg.rank)})
  nodes.agree_at_checkpoint(10, digest)
  print("OK", total)
except SxError as e:
  sys.stderr.write(e.render() + "\n")
  sys.exit(1)
"""


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(tmp_path, n, ranks, fingerprints, timeout="20", bad_hash=0):
  script = tmp_path / "worker.py"
  script.write_text(WORKER)
  port = _port()
  procs = []
  for r in ranks:
    e = dict(os.environ, SEXPGPU_NODES=str(n), SEXPGPU_NODE_RANK=str(r),
             SEXPGPU_RENDEZVOUS=f"127.0.0.1:{port}", SEXPGPU_CPU_COLLECTIVES="gloo",
             SEXPGPU_RENDEZVOUS_TIMEOUT=timeout, STATUS_FILE=str(tmp_path / f"status{r}.json"),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    e.pop("XLA_FLAGS", None)
    procs.append(subprocess.Popen([sys.executable, str(script), fingerprints[r], str(bad_hash)],
                                  cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  out = []
  for p in procs:
    o, err = p.communicate(timeout=120)
    out.append((p.returncode, o, err))
  return out


@pytest.mark.slow  # two processes over gloo
def test_two_nodes_agree(tmp_path):
  res = _start(tmp_path, 2, [0, 1], ["abc", "abc"])
  for rc, out, err in res:
    assert rc == 0, err
    assert out == "OK 3.0\n", out  # gloo's connection line kept out of stdout and stderr
    assert "[Gloo]" not in err, err


@pytest.mark.slow  # two processes over gloo
def test_mismatching_fingerprint_is_e_dp_006_on_every_node(tmp_path):
  res = _start(tmp_path, 2, [0, 1], ["abc", "xyz"])
  assert [r[0] for r in res] == [1, 1], res
  err0 = res[0][2]
  assert "error[E-DP-006]" in err0 and "node 1" in err0 and "xyz" in err0 and "abc" in err0
  assert "error[E-DP-006]" in res[1][2]


@pytest.mark.slow  # two processes over gloo
def test_disagreeing_checkpoint_hash_is_e_dp_004(tmp_path):
  res = _start(tmp_path, 2, [0, 1], ["abc", "abc"], bad_hash=1)
  assert [r[0] for r in res] == [1, 1], res
  assert all("error[E-DP-004]" in r[2] for r in res)


@pytest.mark.slow  # a process waits for its absent peer
@pytest.mark.parametrize("present", [0, 1])
def test_absent_node_is_e_dp_007_exit_1(tmp_path, present):
  t = time.monotonic()
  (rc, out, err), = _start(tmp_path, 2, [present], ["abc", "abc"], timeout="3")
  assert rc == 1, (rc, err)
  assert "error[E-DP-007]" in err and "within 3 s" in err
  assert time.monotonic() - t < 20
  assert '"E-DP-007"' in (tmp_path / f"status{present}.json").read_text()


def test_params_hash():
  a = {"w": np.arange(6.0).reshape(2, 3), "b": np.zeros(3, np.float32)}
  assert nodes.params_hash(a) == nodes.params_hash(dict(a))
  assert nodes.params_hash(a) != nodes.params_hash({**a, "b": np.ones(3, np.float32)})
  assert nodes.params_hash(a) != nodes.params_hash({**a, "w": a["w"].reshape(3, 2)})


def test_gloo_announcements_go_also_when_two_threads_interleave_their_pieces():
  """gloo writes `[Gloo] Rank N is connected to …` in pieces; two local devices' threads
  interleave them. Every interleaving leaves the run's own lines, and only those (written
  whole, before the collective connects or after its results came back)."""
  import random
  def pieces(rank):
    return [b"[Gloo] Rank ", str(rank).encode(), b" is connected to ", b"3", b" peer ranks. ",
            b"Expected number of connected peer ranks is : ", b"3", b"\n"]
  ours = [b"step 0/6 loss - | eval/loss 3.46574 | 0 records | 0.0s\n",
          b"step 10/12 loss 1.25 | 240 records | 1.2s\n"]
  rng = random.Random(0)
  for _ in range(200):
    streams = [pieces(2), pieces(3)]
    out = ours[0]
    while any(streams):
      s = rng.choice([s for s in streams if s])
      out += s.pop(0)
    out += ours[1]
    assert nodes.without_gloo(out) == b"".join(ours), out
  assert nodes.without_gloo(b"step 3 loss 2\n12\n") == b"step 3 loss 2\n12\n"  # no gloo here

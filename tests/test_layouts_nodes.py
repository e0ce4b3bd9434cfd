"""`:sharding` as a mesh over two processes of two host devices each (gloo): tensor:4,
fsdp:2,tensor:2 and moe-lm's expert:4 train as replicate over the same four devices, each
process holds its devices' shares of each split parameter, each writes its shards of a
checkpoint, and a SIGTERM to one node then `--resume latest` continues bitwise, also into
another layout. The devices are in node-major order, so the axes written first span the
nodes. One module-scoped fixture runs every pair of processes once (seven pairs, and
replicate's references in one process)."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd
from s3server import free_port
from stopping import stop_at

pytestmark = pytest.mark.slow  # two processes of two devices over gloo: seven pairs of runs

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
MOE = os.path.join(ROOT, "configs", "moe-lm.sx")
STOP = 4  # node 1 gets SIGTERM once node 0 has logged this step


def _env(rank, port):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("SEXPGPU_STACKING", None)
  env.update({"SEXPGPU_DEVICES": "0,1", "SEXPGPU_NODES": "2", "SEXPGPU_NODE_RANK": str(rank),
              "SEXPGPU_RENDEZVOUS": f"127.0.0.1:{port}", "SEXPGPU_CPU_COLLECTIVES": "gloo",
              "SEXPGPU_NODE_GRADIENTS": "f32", "SEXPGPU_RENDEZVOUS_TIMEOUT": "60"})
  return env


def _start(tmp, name, path, sharding, *extra):
  """Both nodes of a 10-step run; node 0 writes the metrics to tmp/NAME.jsonl."""
  port = free_port()
  args = ("--variant", "smoke", "--steps", "10", "--eval-every", "0", "--set", "microbatches=4",
          "--set", f"sharding={sharding}", "--metrics", f"jsonl:{tmp / f'{name}.jsonl'}",
          "--json") + extra
  return [subprocess.Popen(sexpgpu_cmd("run", path, *args), cwd=ROOT, env=_env(r, port),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for r in (0, 1)]


def _one_process(tmp, name, path):
  """replicate's reference: one process of four host devices (no rendezvous to pay for), the
  same 10 steps over the same four devices' batches."""
  env = dict(os.environ, SEXPGPU_DEVICES="0,1,2,3", XLA_FLAGS=(
      "--xla_force_host_platform_device_count=4 " + os.environ.get("XLA_FLAGS", "")))
  env.pop("SEXPGPU_STACKING", None)
  args = ("--variant", "smoke", "--steps", "10", "--eval-every", "0", "--set", "microbatches=4",
          "--metrics", f"jsonl:{tmp / f'{name}.jsonl'}", "--json")
  return [subprocess.Popen(sexpgpu_cmd("run", path, *args), cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]


def _done(procs, code=0):
  out = [(p, *p.communicate(timeout=600)) for p in procs]
  for p, _, err in out:
    assert p.returncode == code, err[-3000:]
    assert "Traceback" not in err
  return [json.loads(o) for _, o, _ in out]


def _losses(tmp, name):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(tmp / f"{name}.jsonl"))
          if e["kind"] == "step"}


# Each process opens the two-node placement as a run does and reports, for each layout, each
# state leaf's whole bytes and the bytes of its addressable shards by device.
SHARES = r"""
import json, os, sys
import jax
from sexpgpu import env
from sexpgpu.devices import nodes
from sexpgpu.run.backend import cpu_flags, open_devices
cfg = env.parse_nodes(os.environ, "cpu")
cpu_flags()
jax.config.update("jax_num_cpu_devices", 2)
nodes.initialize(cfg, 60)
from sexpgpu.run.compile import compile_file
from sexpgpu.run.training import build
place = open_devices("cpu", [0, 1], cfg)
out = {}
for path, name in json.loads(sys.argv[1]):
  training = build(compile_file(path, "smoke", [("microbatches", "4"), ("sharding", name)]),
                   place, "f32")
  state = training.init_state()
  rows = [(jax.tree_util.keystr(k), int(x.nbytes),
           {s.device.id: int(s.data.nbytes) for s in x.addressable_shards})
          for part in ("params", "opt")
          for k, x in jax.tree_util.tree_leaves_with_path(state[part])]
  out[name] = {"specs": {p: list(s) for p, s in training.specs().items()}, "rows": rows}
print(json.dumps({"process": jax.process_index(),
                  "local": [d.id for d in place.local_devices], "layouts": out}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("layouts-nodes")
  out = {"tmp": tmp}
  for name, path in (("replicate", TINY), ("moe-replicate", MOE)):
    out[name] = _done(_one_process(tmp, name, path))
  for name, path, sharding in (("tensor4", TINY, "tensor:4"), ("both", TINY, "fsdp:2,tensor:2"),
                               ("expert4", MOE, "expert:4")):
    out[name] = _done(_start(tmp, name, path, sharding))
  # tensor:4 stopped by SIGTERM to node 1 alone, then resumed twice: as it was, and as
  # fsdp:2,tensor:2 from the same checkpoint
  ck = ("--checkpoint-dir", str(tmp / "ck"))
  node0 = []

  def start(attempt):
    procs = _start(tmp, f"stop{attempt}", TINY, "tensor:4", *ck)
    node0.append(procs[0])
    return procs[1], tmp / f"stop{attempt}.jsonl"
  p1, out1, err1, metrics = stop_at(start, STOP, signal.SIGTERM)
  assert p1.returncode == 143, err1[-3000:]
  out0, err0 = node0[-1].communicate(timeout=300)
  assert node0[-1].returncode == 143, err0[-3000:]
  out["stop"] = [json.loads(out0), json.loads(out1)]
  out["stop-name"] = metrics.stem
  out["resumed"] = _done(_start(tmp, "resumed", TINY, "tensor:4", *ck, "--resume", "latest"))
  out["other"] = _done(_start(tmp, "other", TINY, "fsdp:2,tensor:2", "--resume",
                              out["stop"][0]["checkpoint"]))
  port = free_port()
  layouts = json.dumps([[TINY, "tensor:4"], [TINY, "fsdp:2,tensor:2"], [MOE, "expert:4"]])
  procs = [subprocess.Popen([sys.executable, "-c", SHARES, layouts], cwd=ROOT,
                            env=_env(r, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for r in (0, 1)]
  out["shares"] = [json.loads(o.splitlines()[-1]) for _, o, _ in
                   ((p, *p.communicate(timeout=600)) for p in procs)]
  return out


@pytest.mark.parametrize("name,reference", [("tensor4", "replicate"), ("both", "replicate"),
                                            ("expert4", "moe-replicate")])
def test_a_layout_over_two_nodes_trains_as_replicate(runs, name, reference):
  mine, rep = _losses(runs["tmp"], name), _losses(runs["tmp"], reference)
  assert sorted(mine) == list(range(1, 11))
  gap = max(abs(mine[s] - rep[s]) for s in mine)
  assert gap <= 1e-5, (mine, rep)
  print(name, "max |loss - replicate's|", gap)
  s0, s1 = runs[name]
  assert s0["train_loss"] == s1["train_loss"] == mine[10]  # both nodes ran one program


def test_sigterm_to_one_node_stops_both_and_the_resume_continues_bitwise(runs):
  """The stopped run's steps are the uninterrupted run's, bitwise (run to run), and so are
  the resumed run's, from the step the stop's checkpoint holds."""
  tmp = runs["tmp"]
  whole, stopped = _losses(tmp, "tensor4"), _losses(tmp, runs["stop-name"])
  s0, s1 = runs["stop"]
  assert s0["stopped_by"] == s1["stopped_by"] == "SIGTERM"
  at = s0["steps"]
  assert at == s1["steps"] and STOP <= at < 10
  assert stopped == {s: whole[s] for s in range(1, at + 1)}
  assert s0["checkpoint"].endswith(f"/{at}")
  resumed = _losses(tmp, "resumed")
  assert resumed == {s: whole[s] for s in range(at + 1, 11)}
  # each process wrote its own shards: a leaf split four ways has four chunk files
  state = os.path.join(s0["checkpoint"], "state")
  index = json.load(open(os.path.join(state, "shards.json")))
  meta = json.load(open(os.path.join(s0["checkpoint"], "meta", "metadata")))
  assert meta["sharding"] == "tensor:4" and meta["mesh"] == {"node": 2, "gpu": 2}
  split = [i for i, e in enumerate(index["leaves"])
           if e["shape"] and any(c * 4 == s for c, s in zip(e["chunks"], e["shape"]))]
  assert len(split) >= 8
  for i in split:
    assert len([n for n in os.listdir(os.path.join(state, f"{i:05d}"))
                if not n.startswith(".")]) == 4


def test_a_resume_over_two_nodes_may_change_the_layout(runs):
  """The tensor:4 checkpoint resumed as fsdp:2,tensor:2: the uninterrupted tensor:4 run's
  losses within 1e-5 (the layouts sum in different orders)."""
  tmp = runs["tmp"]
  at = runs["stop"][0]["steps"]
  whole, other = _losses(tmp, "tensor4"), _losses(tmp, "other")
  assert sorted(other) == list(range(at + 1, 11))
  gap = max(abs(other[s] - whole[s]) for s in other)
  assert gap <= 1e-5, (other, whole)
  print("tensor:4 resumed as fsdp:2,tensor:2, max |loss - tensor:4's|", gap)


@pytest.mark.parametrize("layout", ["tensor:4", "fsdp:2,tensor:2", "expert:4"])
def test_each_process_holds_its_devices_shares_of_each_split_parameter(runs, layout):
  sizes = {a: int(s) for a, s in (x.split(":") for x in layout.split(","))}
  seen = set()
  for got in runs["shares"]:
    assert len(got["local"]) == 2
    specs, rows = got["layouts"][layout]["specs"], got["layouts"][layout]["rows"]
    split = 0
    for key, whole, shards in rows:
      assert sorted(map(int, shards)) == sorted(got["local"])  # its own devices only
      seen.update(shards)
      path = next((p for p in specs if f"'{p}'" in key), None)
      ways = int(np.prod([sizes.get(a, 1) for a in specs[path] if isinstance(a, str)])) \
          if path is not None else 1
      assert list(shards.values()) == [whole // ways] * 2, (key, specs.get(path))
      split += ways > 1
    assert split >= (9 if layout == "expert:4" else 16), split  # a weight and adam's moments
  assert len(seen) == 4

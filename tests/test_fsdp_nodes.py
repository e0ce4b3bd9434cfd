"""`:sharding fsdp|hsdp` over two nodes of two host devices each, rehearsed on the CPU (gloo):
training, a stop on SIGTERM to one node, each process writing only its own shards of a
checkpoint into a folder every node sees, bitwise resumes, and node 0's host memory while
saving. The s3:// cases are in test_fsdp_nodes_s3.py (a module of their own, so the two
workers share the load)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, sexpgpu_cmd
from s3server import free_port

pytestmark = pytest.mark.slow  # two processes over gloo, stopped and resumed

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _args(sharding, steps=8):
  return ("--variant", "smoke", "--steps", str(steps), "--eval-every", "0", "--set",
          "microbatches=4", "--set", f"sharding={sharding}", "--set", "checkpoint-every=4")


def _start(tmp, rank, port, args, name, extra=None):
  env = dict(os.environ)
  env.pop("SEXPGPU_STACKING", None)
  env.update({"SEXPGPU_DEVICES": "0,1", "SEXPGPU_NODES": "2", "SEXPGPU_NODE_RANK": str(rank),
              "SEXPGPU_RENDEZVOUS": f"127.0.0.1:{port}", "SEXPGPU_CPU_COLLECTIVES": "gloo",
              "SEXPGPU_RENDEZVOUS_TIMEOUT": "30"})
  env.update(extra or {})
  return subprocess.Popen(
      sexpgpu_cmd("run", TINY, *args, "--metrics", f"jsonl:{tmp / f'{name}{rank}.jsonl'}",
                  "--json"),
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _both(tmp, args, name, envs=(None, None)):
  port = free_port()
  procs = [_start(tmp, r, port, args, name, envs[r]) for r in (0, 1)]
  return [(p, *p.communicate(timeout=600)) for p in procs]


def _losses(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


def _steps_logged(path):
  try:
    return path.read_text().count('"kind":"step"')
  except OSError:
    return 0


def _stop_resume(tmp, sharding, location, envs=(None, None)):
  """An uninterrupted run; a run stopped by SIGTERM to node 1 alone; its resume. Returns
  (uninterrupted {step: loss}, the stop's summaries, the resume's {step: loss})."""
  args = _args(sharding) + ("--checkpoint-dir", location)
  whole = _both(tmp, args[:-2] + ("--checkpoint-dir", location + "-whole"), "w", envs)
  for p, out, err in whole:
    assert p.returncode == 0, err
    assert "Gloo" not in err + out and "Traceback" not in err
  port = free_port()
  procs = [_start(tmp, r, port, args, "s", envs[r]) for r in (0, 1)]
  deadline = time.time() + 300
  while time.time() < deadline and procs[0].poll() is None and _steps_logged(
      tmp / "s0.jsonl") < 2:
    time.sleep(0.005)
  procs[1].send_signal(signal.SIGTERM)  # node 1 only: the step's stop flag stops both
  stopped = [(p, *p.communicate(timeout=300)) for p in procs]
  summaries = []
  for p, out, err in stopped:
    assert p.returncode == 143, err
    summaries.append(json.loads(out))
    assert summaries[-1]["stopped_by"] == "SIGTERM"
  assert summaries[0]["steps"] == summaries[1]["steps"] < 8
  resumed = _both(tmp, args + ("--resume", "latest"), "r", envs)
  for p, out, err in resumed:
    assert p.returncode == 0, err
    assert f"/{summaries[0]['steps']} status" in err.splitlines()[0], err
  return _losses(tmp / "w0.jsonl"), summaries, _losses(tmp / "r0.jsonl")


def test_fsdp_over_two_nodes_stops_on_sigterm_to_one_and_resumes_bitwise(tmp_path):
  whole, summaries, resumed = _stop_resume(tmp_path, "fsdp", str(tmp_path / "ck"))
  assert len(whole) == 8 and all(v == v for v in whole.values())
  start = summaries[0]["steps"]
  assert resumed == {s: v for s, v in whole.items() if s > start}
  step_dir = tmp_path / "ck" / "tiny-lm-smoke-checkpoint-every=4-microbatches=4-sharding=fsdp"
  meta = json.loads((step_dir / str(start) / "meta" / "metadata").read_text())
  assert meta["sharding"] == "fsdp" and meta["mesh"] == {"node": 2, "gpu": 2}
  # every process wrote its own shards: a leaf split four ways has four chunk files
  index = json.loads((step_dir / str(start) / "state" / "shards.json").read_text())
  split = [i for i, e in enumerate(index["leaves"])
           if e["shape"] and e["chunks"][0] * 4 == e["shape"][0]]
  assert split
  chunks = [n for n in os.listdir(step_dir / str(start) / "state" / f"{split[0]:05d}")
            if not n.startswith(".")]
  assert len(chunks) == 4
  # the same checkpoint resumed replicated: each device's bf16 carry is its node's
  other = _both(tmp_path, _args("replicate") + (
      "--checkpoint-dir", str(tmp_path / "ck2"), "--resume", str(step_dir / str(start))), "x")
  for p, out, err in other:
    assert p.returncode == 0, err
  again = _losses(tmp_path / "x0.jsonl")
  assert sorted(again) == sorted(resumed)
  assert again[start + 1] == pytest.approx(resumed[start + 1], abs=1e-6)  # the same params
  assert all(abs(again[s] - resumed[s]) < 1e-4 for s in again), (again, resumed)
  # a warm start from it over the same nodes: parameters read into the shards, the bf16
  # carries at zero in the sharded layout, a fresh optimizer
  warm = _both(tmp_path, _args("fsdp", steps=1) + ("--init-from", str(step_dir / str(start))),
               "i")
  for p, out, err in warm:
    assert p.returncode == 0, err
    assert "init-from: " in err, err
  assert _losses(tmp_path / "i0.jsonl")[1] < whole[1] - 0.01  # trained, not initialized


def test_a_checkpoint_folder_the_nodes_do_not_share_is_e_ckpt_004_on_both(tmp_path):
  """Each node's --checkpoint-dir its own disk (here: two folders): node 0 does not see
  node 1's shards, so it commits nothing and every node says why and what to pass."""
  args = _args("fsdp", steps=2)
  port = free_port()
  procs = [_start(tmp_path, r, port, args + ("--checkpoint-dir", str(tmp_path / f"disk{r}")),
                  "n") for r in (0, 1)]
  for p in procs:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1, err
    line = next(ln for ln in err.splitlines() if ln.startswith("error["))
    assert line.startswith("error[E-CKPT-004]: node 0: cannot write checkpoint "), err
    assert "where node 0 does not see them" in line and "every node sees" in line, line
    assert "storage they all mount" in err and "Traceback" not in err, err
  (run_dir,) = (tmp_path / "disk0").iterdir()
  assert not any(n.isdigit() for n in os.listdir(run_dir))  # no step counts


# Two processes, each holding half of a 128 MiB state on its one host device, save it with
# the run's sharded writer; node 0's host memory peak during the save is measured.
MEMORY = r"""
import json, os, sys
import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sexpgpu import env
from sexpgpu.devices import nodes
from sexpgpu.ckpt import CheckpointStore

rank, port, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = env.NodeConfig(nodes=2, rank=rank, host="127.0.0.1", port=port, collectives="gloo")
rdv = nodes.initialize(cfg, 60)
mesh = Mesh(np.array(jax.devices()), ("node",))
sharding = NamedSharding(mesh, P("node"))
leaves = 8
n = 4 << 20  # floats a leaf: 16 MiB, 8 MiB a process
state = {"params": {f"w{i}": jax.make_array_from_callback(
    (n,), sharding, lambda idx, i=i: np.full((n // 2,), i + rank, np.float32))
    for i in range(leaves)}}
state_bytes = leaves * n * 4

def status(field):
  for line in open("/proc/self/status"):
    if line.startswith(field):
      return int(line.split()[1]) * 1024

store = CheckpointStore(folder, "run", keep=2)
if rank == 0:
  store.check_writable()
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # VmHWM back to the current RSS
store.save_sharded(3, state, {"step": 3}, rdv)
grown = status("VmHWM:") - base
store.close()
print(json.dumps({"grown": grown, "state": state_bytes}), flush=True)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_node_0_holds_less_than_half_the_state_in_host_memory_while_saving(tmp_path):
  port = free_port()
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("SEXPGPU_DEVICES", None)
  procs = [subprocess.Popen([sys.executable, "-c", MEMORY, str(r), str(port),
                             str(tmp_path / "ck")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for r in (0, 1)]
  results = [(p, *p.communicate(timeout=300)) for p in procs]
  for p, out, err in results:
    assert p.returncode == 0, err
  got = json.loads(results[0][1].splitlines()[-1])
  # gathering the state on node 0 (the replicated path) would add all of it
  assert got["grown"] < got["state"] / 2, got
  from sexpgpu.ckpt import restore_checkpoint
  from sexpgpu.models.source import checkpoint_params
  import jax
  import numpy as np
  step_dir = str(tmp_path / "ck" / "run" / "3")
  abstract = {"params": {f"w{i}": jax.ShapeDtypeStruct((4 << 20,), np.float32)
                         for i in range(8)}}
  state, meta = restore_checkpoint(step_dir, abstract)
  params, meta2 = checkpoint_params(step_dir)  # as export, sample and warm starts read it
  assert meta == meta2 == {"step": 3}
  half = 2 << 20
  for i in range(8):  # each half came from the process that held it
    for got in (state["params"][f"w{i}"], params[f"w{i}"]):
      assert (got[:half] == i).all() and (got[half:] == i + 1).all()

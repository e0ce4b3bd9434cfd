"""Step time of `:sharding fsdp` against `replicate` on the same host devices, in one run.

Usage:
  python benchmarks/bench_fsdp.py [--devices 4] [--steps 12] [--warmup 3] [--rounds 3]
                                  [--variant compute] [--nodes 1]

Trains benchmarks/transformer.sx (the compute shape by default) over N XLA host
devices, once per sharding a round, the two legs back to back in a rotating order.
A leg's time is the median `time/step` after the warm-up steps; the ratio is the
median of the rounds' paired ratios fsdp ÷ replicate: the cost of the gathers and
reduce-scatters where, on host devices sharing one memory, nothing is saved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SX = os.path.join(HERE, "transformer.sx")
LEGS = ("replicate", "fsdp")


def leg(sharding: str, devices: int, steps: int, warmup: int, variant: str, tmp: str,
        nodes: int = 1) -> dict:
  """One run; its median step time after the warm-up, and its losses. With `nodes` > 1,
  that many processes over loopback (gloo), each with devices/nodes host devices."""
  m = os.path.join(tmp, f"{sharding}.jsonl")
  if os.path.exists(m):
    os.unlink(m)
  local = devices // nodes
  env = dict(os.environ, SEXPGPU_DEVICES=",".join(map(str, range(local))),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={local}")
  env.pop("SEXPGPU_STACKING", None)
  cmd = [sys.executable, "-m", "sexpgpu.cli.main", "run", SX, "--variant", variant, "--set",
         f"microbatches={devices}", "--set", f"sharding={sharding}", "--steps", str(steps)]
  port = _free_port()
  procs = []
  for rank in range(nodes):
    if nodes > 1:
      env = dict(env, SEXPGPU_NODES=str(nodes), SEXPGPU_NODE_RANK=str(rank),
                 SEXPGPU_RENDEZVOUS=f"127.0.0.1:{port}", SEXPGPU_CPU_COLLECTIVES="gloo",
                 SEXPGPU_NODE_GRADIENTS="f32")
    metrics = ["--metrics", f"jsonl:{m}"] if rank == 0 else []
    procs.append(subprocess.Popen(cmd + metrics, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  for p in procs:
    _, err = p.communicate()
    if p.returncode != 0:
      raise RuntimeError(f"{sharding} failed:\n{err[-3000:]}")
  ev = [json.loads(line) for line in open(m)]
  steps_ev = [e for e in ev if e["kind"] == "step"]
  return {"step_s": statistics.median(e["time/step"] for e in steps_ev[warmup:]),
          "loss": [e["train/loss"] for e in steps_ev]}


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main(argv=None) -> int:
  """Runs the rounds and prints each leg's median step and the ratio."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--variant", default="compute")
  ap.add_argument("--nodes", type=int, default=1,
                  help="processes over loopback (gloo) sharing the devices")
  a = ap.parse_args(argv)
  runs = {x: [] for x in LEGS}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(a.rounds):
      for sharding in (LEGS if r % 2 == 0 else LEGS[::-1]):
        runs[sharding].append(leg(sharding, a.devices, a.steps, a.warmup, a.variant, tmp,
                                  a.nodes))
  ratios = [f["step_s"] / p["step_s"] for f, p in zip(runs["fsdp"], runs["replicate"])]
  for sharding in LEGS:
    med = statistics.median(x["step_s"] for x in runs[sharding])
    print(f"{sharding:10} median step {med * 1e3:.1f} ms over {a.rounds} rounds")
  diff = max(abs(x - y) for x, y in zip(runs["fsdp"][0]["loss"], runs["replicate"][0]["loss"]))
  where = f" in {a.nodes} processes" if a.nodes > 1 else ""
  print(f"ratio {a.variant} fsdp/replicate over {a.devices} host devices{where}: step "
        f"{statistics.median(ratios):.3f} (median of {len(ratios)} rounds, "
        f"{min(ratios):.2f}..{max(ratios):.2f}); losses max |difference| {diff:.1e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

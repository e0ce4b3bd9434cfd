"""The CPU backend's host allocator: each step's buffers reuse the last step's memory."""

import json
import os
import subprocess
import sys

import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.run.setup import wants_kept_host_memory

# The gradient of an 8-layer MLP over 16,384 rows: XLA's runtime allocates its 72 MiB
# temporary buffer on a worker thread at every call. Prints the median minor page faults
# of a call after warm-up (the heap may still grow once in a while: the steady state counts).
_PROBE = """
import json, resource, sys
from sexpgpu.run import backend as devices
kept = devices.keep_host_memory() if sys.argv[1] == "kept" else False
import jax, jax.numpy as jnp

def loss(ws, x):
  for w in ws:
    x = jnp.tanh(x @ w)
  return jnp.sum(x)

grad = jax.jit(jax.grad(loss))
ws, x = [jnp.eye(128) * 0.5 for _ in range(8)], jnp.ones((16384, 128))
for _ in range(3):
  jax.block_until_ready(grad(ws, x))
calls = []
for _ in range(7):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(grad(ws, x))
  calls.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": sorted(calls)[len(calls) // 2], "kept": kept}))
"""


def _faults(mode: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       cwd=ROOT, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # steps measured page by page
def test_steps_reuse_host_memory_instead_of_faulting_in_new_pages():
  plain, kept = _faults("plain"), _faults("kept")
  assert kept["kept"]
  # 72 MiB in 4 KiB pages: 18,432 faults a call when every call maps fresh memory
  assert plain["faults"] > 9000, plain
  assert kept["faults"] < plain["faults"] / 20, (kept, plain)


def test_runs_keep_host_memory_only_when_their_steps_are_big_and_not_huge():
  def wants(name, variant=None):
    return wants_kept_host_memory(sexpgpu.compile(os.path.join(ROOT, name), variant=variant)._c)
  assert not wants("configs/tiny-lm.sx")  # 1.1 MiB of forward values a microbatch
  assert not wants("benchmarks/transformer.sx")  # 0.3 MiB
  assert wants("benchmarks/transformer.sx", "compute")  # 101 MiB
  assert not wants("configs/gpt2-small.sx")  # 9.3 GiB: glibc trims it whatever we set

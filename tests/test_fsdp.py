"""`:sharding fsdp` over XLA host devices: replicate's losses, 1/N of the state a device,
the plan per device, the refusal's fix, and a resume that changes the sharding."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _env(n, **extra):
  e = dict(os.environ, SEXPGPU_DEVICES=",".join(map(str, range(n))),
           XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
  e.pop("SEXPGPU_STACKING", None)
  e.update(extra)
  return e


def _run(tmp_path, name, n, *args, env=None):
  m = tmp_path / f"{name}.jsonl"
  p = subprocess.run(sexpgpu_cmd("run", TINY, "--set", f"microbatches={n}", "--metrics",
                                 f"jsonl:{m}", *args), cwd=ROOT, env=env or _env(n),
                     capture_output=True, text=True, timeout=600)
  return p, m


def _losses(m):
  return [e["train/loss"] for e in map(json.loads, open(m)) if e["kind"] == "step"]


@pytest.mark.slow  # runs over 8 host devices
def test_fsdp_over_8_devices_trains_as_replicate_and_bitwise_run_to_run(tmp_path):
  runs = {}
  for name, sharding in (("rep", "replicate"), ("fsdp", "fsdp"), ("fsdp2", "fsdp")):
    p, m = _run(tmp_path, name, 8, "--set", f"sharding={sharding}", "--steps", "10")
    assert p.returncode == 0, p.stderr
    runs[name] = _losses(m)
  assert len(runs["fsdp"]) == 10
  np.testing.assert_allclose(runs["fsdp"], runs["rep"], rtol=0, atol=1e-5)
  assert runs["fsdp"] == runs["fsdp2"]


_SHARES = """
import json, jax
from sexpgpu.run.compile import compile_file
from sexpgpu.run.backend import open_devices
from sexpgpu.run.training import build
c = compile_file({path!r}, None, [("microbatches", "8"), ("sharding", "fsdp")])
training = build(c, open_devices("cpu", list(range(8))))
state = training.init_state()
out = {{}}
for part in ("params", "opt"):
  leaves = jax.tree_util.tree_leaves_with_path(state[part])
  out[part] = [(jax.tree_util.keystr(k), int(x.nbytes),
                sorted({{int(s.data.nbytes) for s in x.addressable_shards}}))
               for k, x in leaves]
out["replicated"] = training.replicated()
print(json.dumps(out))
"""


def test_each_device_holds_an_eighth_of_the_parameters_and_optimizer_state():
  p = subprocess.run([sys.executable, "-c", _SHARES.format(path=TINY)], cwd=ROOT, env=_env(8),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr
  out = json.loads(p.stdout.strip().splitlines()[-1])
  replicated = set(out["replicated"])
  for part in ("params", "opt"):
    whole = sum(b for _, b, _ in out[part])
    mine = sum(s[0] for _, _, s in out[part])
    kept = sum(b for name, b, _ in out[part]
               if any(r in name for r in replicated) or b < 8 * 4)  # counters, whole arrays
    assert all(len(s) == 1 for _, _, s in out[part])  # every device the same share
    assert mine == pytest.approx((whole - kept) / 8 + kept), part
    assert mine < whole / 4, part


@pytest.mark.slow  # a run over 8 host devices
def test_the_plan_counts_a_device_share_and_names_fsdp(tmp_path):
  args = ("--set", "microbatches=4", "--set", "width=256", "--print", "plan")
  rep = subprocess.run(sexpgpu_cmd("check", TINY, *args, "--set", "sharding=replicate"), cwd=ROOT,
                       env=_env(4), capture_output=True, text=True, timeout=600)
  fsdp = subprocess.run(sexpgpu_cmd("check", TINY, *args, "--set", "sharding=fsdp"), cwd=ROOT,
                        env=_env(4), capture_output=True, text=True, timeout=600)
  assert rep.returncode == 0 and fsdp.returncode == 0, fsdp.stderr
  assert "(fsdp over 4)" in fsdp.stdout and "(fsdp over" not in rep.stdout
  assert "  sharding    fsdp over 4; replicated: " in fsdp.stdout

  def part(text, name):
    line = next(x for x in text.splitlines() if x.strip().startswith(name))
    value, unit = line.split()[-2:]
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]

  for name in ("parameters", "optimizer states"):
    assert part(fsdp.stdout, name) == pytest.approx(part(rep.stdout, name) / 4, rel=0.05)


@pytest.mark.slow  # a run over 8 host devices
def test_a_run_refused_replicated_names_fsdp_and_runs_with_it(tmp_path):
  sets = ("--set", "width=256", "--steps", "2")
  env = _env(4, SEXPGPU_MEMORY="25MiB")
  p, _ = _run(tmp_path, "rep", 4, *sets, env=env)
  assert p.returncode == 1 and "error[E-MEM-001]" in p.stderr, p.stderr
  assert "--set sharding=fsdp (about " in p.stderr
  p, m = _run(tmp_path, "fsdp", 4, *sets, "--set", "sharding=fsdp", env=env)
  assert p.returncode == 0, p.stderr
  assert len(_losses(m)) == 2


@pytest.mark.slow  # runs and resumes over 8 host devices
def test_a_resume_may_change_the_sharding(tmp_path):
  """fsdp's step-4 checkpoint of an 8-step run, resumed replicated: the fsdp run's last four
  losses within 1e-5 (one uninterrupted run is both the checkpoint and the reference)."""
  ck = tmp_path / "ck"
  every = ("--set", "checkpoint-every=4", "--steps", "8")
  full, mf = _run(tmp_path, "full", 4, "--set", "sharding=fsdp", *every,
                  "--checkpoint-dir", str(ck))
  assert full.returncode == 0, full.stderr
  (step_dir,) = ck.glob("*/4")  # the slug names the --set sharding: resume names the folder
  rest, mr = _run(tmp_path, "rest", 4, "--set", "sharding=replicate", *every,
                  "--resume", str(step_dir))
  assert rest.returncode == 0, rest.stderr
  assert f"resume {step_dir}" in rest.stderr.splitlines()[0]
  assert len(_losses(mf)) == 8 and len(_losses(mr)) == 4
  np.testing.assert_allclose(_losses(mr), _losses(mf)[4:], rtol=0, atol=1e-5)


# The sharded step of a (node, gpu) mesh of 2 x 2 host devices in one process, lowered: the
# sum between nodes as the program states it, before XLA's CPU backend widens bf16 sums.
_NODE_SUMS = """
import jax, re
from sexpgpu.run.compile import compile_file
from sexpgpu.run.backend import Placement
from sexpgpu.run.training import build
for sharding in ("fsdp", "hsdp"):
  for gradients in ("bf16", "f32"):
    c = compile_file({path!r}, "smoke", [("microbatches", "4"), ("sharding", sharding)])
    t = build(c, Placement("cpu", jax.devices("cpu")[:4], nodes=2), gradients)
    text = t.step(0, 1).lowered(t.place_abstract(t.abstract_state()),
                                t.abstract_batches(c.stages[0].data, (4,))).as_text()
    ops = re.findall(r'"stablehlo\\.(reduce_scatter|all_reduce)"[^\\n]*replica_groups = '
                     r'dense<(\\[\\[0, 2\\], \\[1, 3\\]\\])>[^\\n]*\\n\\s*\\^bb0\\(%\\w+: '
                     r'tensor<(\\w+)>', text)
    print(sharding, gradients, sorted(set((op, dtype) for op, _, dtype in ops)))
"""


def test_bf16_node_gradients_cross_nodes_in_bf16_reduce_scatter_or_all_reduce():
  """fsdp reduce-scatters the nodes' sums onto the parameters' shards, hsdp all-reduces
  them, in bf16 between the two nodes (devices 0,1 and 2,3); with f32 node gradients no
  explicit sum crosses the nodes (XLA's partitioner places the f32 reduce-scatter)."""
  p = subprocess.run([sys.executable, "-c", _NODE_SUMS.format(path=TINY)], cwd=ROOT,
                     env=_env(4), capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr
  assert p.stdout.splitlines() == [
      "fsdp bf16 [('reduce_scatter', 'bf16')]", "fsdp f32 []",
      "hsdp bf16 [('all_reduce', 'bf16')]", "hsdp f32 []"], p.stdout


_SPLIT_KERNEL = """
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sexpgpu.lower import cuda_target
from sexpgpu.lower.kernels import flash_attention as fa
mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(0)
q, k, v, w = (jnp.asarray(rng.normal(size=(2, 2, 2, 64, 16)), jnp.float32) for _ in range(4))
seg = jnp.asarray(np.cumsum(rng.random((2, 2, 64)) < 0.1, axis=-1), jnp.int32)
split_over = NamedSharding(mesh, P("data"))
args = [jax.device_put(x, split_over) for x in (q, k, v, seg, w)]

def step(split, interpret=True):
  def loss(q, k, v, s, w):
    return jnp.sum(fa.flash_attention(q, k, v, s, causal=True, scale=0.25, interpret=interpret,
                                      split=split) * w)
  return jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2)))  # the fsdp step's rank vmap

out = {}
for split in (False, True):
  fn = jax.jit(step(split))
  vals = [np.asarray(x).tolist() for x in jax.tree_util.tree_leaves(fn(*args))]
  text = fn.lower(*args).compile().as_text()
  cuda = cuda_target.lower_for_cuda(step(split, False), *[
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split_over) for x in args]).as_text()
  out[str(split)] = {"vals": vals, "gathers": len(re.findall(r"all-gather\\(", text)),
                     "calls": cuda_target.custom_calls(cuda),
                     "rules": cuda_target.sharding_rules(cuda)}
print(json.dumps(out))
"""


def test_flash_kernels_in_a_sharded_step_keep_the_batch_split():
  """Under the fsdp step's vmap over ranks, with the ranks' axis split over 2 devices: the
  kernels without a sharding rule make XLA gather their operands onto every device; with
  it (`split`) no gather is left, the values are equal, and for CUDA each kernel call
  carries its rule."""
  p = subprocess.run([sys.executable, "-c", _SPLIT_KERNEL], cwd=ROOT, env=_env(2),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  plain, split = out["False"], out["True"]
  assert plain["gathers"] > 0 and split["gathers"] == 0
  for a, b in zip(split["vals"], plain["vals"]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert plain["calls"] == {"__gpu$xla.gpu.triton": 3} and plain["rules"] == 0
  # the forward and the backward (its two kernels in one partitioned call), each with a rule
  assert split["calls"] == {"CustomSPMDPartitioning": 2} and split["rules"] == 2

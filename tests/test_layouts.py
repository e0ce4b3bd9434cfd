"""`:sharding` as a mesh (tensor:4, fsdp:2,tensor:2, expert:4) over 4 XLA host devices:
replicate's losses, bitwise run to run, each device's share of each split parameter, the
collectives of the compiled step (sequence parallel's reduce-scatters under tensor:4), a resume
into another layout, the pairs the split rules
find, and the E-codes of a mesh that does not fit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
MOE = os.path.join(ROOT, "configs", "moe-lm.sx")
LAYOUTS = ("tensor:4", "fsdp:2,tensor:2")


def _env(n):
  e = dict(os.environ, SEXPGPU_DEVICES=",".join(map(str, range(n))),
           XLA_FLAGS=f"--xla_force_host_platform_device_count={n} "
           + os.environ.get("XLA_FLAGS", ""))
  e.pop("SEXPGPU_STACKING", None)
  return e


# One process, 4 host devices: 10 steps of replicate and of each layout twice (tiny-lm,
# moe-lm's expert:4, a 5-layer tiny-lm), a resume from tensor:4 into fsdp:4, each device's
# share of the state, the compiled step's collectives, and the plan's lines.
_RUNS = """
import json, re, sys, time
import jax
import sexpgpu
from sexpgpu.run.compile import compile_file
from sexpgpu.run.backend import open_devices
from sexpgpu.run.planning.plan import collective_lines, spec_lines
from sexpgpu.run.training import build
out = {{"losses": {{}}, "seconds": {{}}, "shares": {{}}, "specs": {{}}}}
runs = [({path!r}, "replicate")] + [({path!r}, l) for l in {layouts!r} for _ in (0, 1)]
runs += [({moe!r}, "replicate"), ({moe!r}, "expert:4"), ({moe!r}, "expert:4")]
runs += [("5 layers", "replicate"), ("5 layers", "tensor:4")]  # a scanned repeat
for i, (path, name) in enumerate(runs):
  t = time.time()
  m = f"{tmp}/{{i}}.jsonl"
  sets = {{"sharding": name, "microbatches": 4}}
  if path == "5 layers":
    path, sets["layers"] = {path!r}, 5
    name = "5 layers " + name
  sexpgpu.compile(path, "smoke", set=sets).run(steps=10, metrics=f"jsonl:{{m}}")
  name = name if path == {path!r} else "moe " + name
  out["losses"].setdefault(name, []).append(
      [e["train/loss"] for e in map(json.loads, open(m)) if e["kind"] == "step"])
  out["seconds"][name] = time.time() - t
# a resume into another layout: 4 steps of tensor:4, then fsdp:4 from its checkpoint to 10
for name, steps, resume in (("tensor:4", 4, None), ("fsdp:4", 10, "{tmp}/ck")):
  m = f"{tmp}/{{name}}.jsonl"
  sets = {{"sharding": name, "microbatches": 4}}
  if resume:
    import glob
    (resume,) = glob.glob(resume + "/*/4")
  sexpgpu.compile({path!r}, "smoke", set=sets).run(
      steps=steps, metrics=f"jsonl:{{m}}", checkpoint_dir=None if resume else "{tmp}/ck",
      resume=resume)
  out["losses"].setdefault("resumed", []).extend(
      [e["train/loss"] for e in map(json.loads, open(m)) if e["kind"] == "step"])
for path, name in [({path!r}, l) for l in {layouts!r}] + [({moe!r}, "expert:4")]:
  c = compile_file(path, "smoke", [("microbatches", "4"), ("sharding", name)])
  training = build(c, open_devices("cpu", [0, 1, 2, 3]))
  state = training.init_state()
  specs = training.specs()
  out["specs"][name] = {{p: [a if a is None or isinstance(a, str) else list(a) for a in s]
                        for p, s in specs.items()}}
  out.setdefault("plan", spec_lines(training))
  rows = []
  for part in ("params", "opt"):
    for k, x in jax.tree_util.tree_leaves_with_path(state[part]):
      rows.append((part, jax.tree_util.keystr(k), int(x.nbytes),
                   [int(s.data.nbytes) for s in x.addressable_shards]))
  out["shares"][name] = rows
  # the collectives of its compiled step, by kind and result type
  compiled = training.step(0, 1).lowered(
      training.place_abstract(training.abstract_state()),
      training.abstract_batches(c.stages[0].data, (4,))).compile()
  text = compiled.as_text()
  out.setdefault("collective_lines", {{}})[name] = collective_lines({{"train step": compiled}})
  out.setdefault("collectives", {{}})[name] = [m.groups() for m in (re.search(
      r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all)\\(", l)
      for l in text.splitlines()) if m]
# tensor:4 without sequence parallel: the pairs' all-reduces it replaces
c = compile_file({path!r}, "smoke", [("microbatches", "4"), ("sharding", "tensor:4")])
training = build(c, open_devices("cpu", [0, 1, 2, 3]))
training.sequence_parallel = False
compiled = training.step(0, 1).lowered(
    training.place_abstract(training.abstract_state()),
    training.abstract_batches(c.stages[0].data, (4,))).compile()
out["collectives"]["tensor:4 plain"] = [m.groups() for m in (re.search(
    r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all)\\(", l)
    for l in compiled.as_text().splitlines()) if m]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("layouts")
  p = subprocess.run([sys.executable, "-c", _RUNS.format(path=TINY, moe=MOE, layouts=LAYOUTS, tmp=tmp)],
                     cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-4000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
@pytest.mark.parametrize("layout", LAYOUTS + ("moe expert:4",))
def test_a_layout_trains_as_replicate_and_bitwise_run_to_run(runs, layout):
  (rep,) = runs["losses"]["moe replicate" if "moe" in layout else "replicate"]
  first, second = runs["losses"][layout]  # the second from a fresh compile
  assert len(first) == 10
  np.testing.assert_allclose(first, rep, rtol=0, atol=1e-5)
  assert first == second
  print(layout, "max |loss - replicate's|", float(np.max(np.abs(np.subtract(first, rep)))))


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_device_holds_its_share_of_each_split_parameter(runs, layout):
  sizes = dict((a, int(s)) for a, s in (x.split(":") for x in layout.split(",")))
  specs = runs["specs"][layout]
  assert specs[next(p for p in specs if p.endswith("block/mlp/up/w"))][-1] == "tensor"
  assert specs[next(p for p in specs if p.endswith("block/mlp/down/w"))][-2] == "tensor"
  assert specs[next(p for p in specs if p.endswith("/embed"))][0] == "tensor"
  checked = 0
  for part, key, whole, shards in runs["shares"][layout]:
    path = next((p for p in specs if f"'{p}'" in key), None)
    if path is None:  # a counter or a step: whole on every device
      assert shards == [whole] * 4
      continue
    ways = 1
    for a in specs[path]:
      ways *= sizes.get(a, 1) if isinstance(a, str) else 1
    assert shards == [whole // ways] * 4, (part, key, specs[path])  # the optimizer's too
    checked += ways > 1
  assert checked >= 16  # params, and adam's two moments, of the split parameters


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_each_device_holds_a_quarter_of_the_expert_weights(runs):
  specs, rows = runs["specs"]["expert:4"], runs["shares"]["expert:4"]
  experts = [p for p in specs if "/moe-experts/" in p]
  assert sorted(p.rsplit("/", 1)[1] for p in experts) == ["down", "gate", "up"]
  assert all(specs[p] == ["expert", None, None] for p in experts)
  assert all(specs[p] == [] for p in specs if p not in experts)  # the rest replicated
  mine = [(key, whole, shards) for _, key, whole, shards in rows
          if any(f"'{p}'" in key for p in experts)]
  assert len(mine) == 9  # the weights and adam's two moments
  assert all(shards == [whole // 4] * 4 for _, whole, shards in mine), mine


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_expert_parallel_sends_the_tokens_to_their_experts(runs):
  """The dispatch and the combine (and their gradients) are all-to-alls over `expert`; no
  device gathers an expert weight [4 32 64] (left to itself the partitioner did)."""
  got = runs["collectives"]["expert:4"]
  assert sum(kind == "all-to-all" for _, kind in got) >= 4, got
  assert not [t for t, kind in got if kind == "all-gather" and ("[4,32,64]" in t or
                                                                "[4,64,32]" in t)], got


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_the_plan_lists_each_parameters_spec(runs):
  lines = runs["plan"]  # tensor:4's
  up = next(x for x in lines if "block/mlp/up/w" in x)
  assert up.split()[-3:] == ["(·,", "·,", "tensor)"], up  # the layer axis kept whole
  norm = next(x for x in lines if "block/norm1/scale" in x)
  assert norm.split()[-1] == "replicated", norm


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_a_scanned_repeat_trains_as_replicate_under_tensor_4(runs):
  """5 layers: past interp's UNROLL_MAX, so the blocks run in a lax.scan, its stacked
  weights split on `tensor` with the layer axis whole."""
  from sexpgpu.lower.interp import UNROLL_MAX
  assert UNROLL_MAX < 5
  (rep,), (mine,) = runs["losses"]["5 layers replicate"], runs["losses"]["5 layers tensor:4"]
  assert len(mine) == 10
  np.testing.assert_allclose(mine, rep, rtol=0, atol=1e-5)
  gap = float(np.max(np.abs(np.subtract(mine, rep))))
  print("5 layers tensor:4 max |loss - replicate's|", gap)


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_a_resume_may_change_the_layout(runs):
  """tensor:4 for 4 steps, then fsdp:4 from its checkpoint: the uninterrupted tensor:4
  run's losses, within 1e-5 (the layouts sum in different orders)."""
  resumed, (full, _) = runs["losses"]["resumed"], runs["losses"]["tensor:4"]
  assert len(resumed) == 10
  assert resumed[:4] == full[:4]
  np.testing.assert_allclose(resumed, full, rtol=0, atol=1e-5)
  print("resumed into fsdp:4, max |loss - tensor:4's|",
        float(np.max(np.abs(np.subtract(resumed, full)))))


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_the_step_sums_the_pairs_activations(runs):
  """Without sequence parallel, Megatron's all-reduces: of activations [ranks, batch, seq,
  width] (the ends of the attention and MLP pairs, forward and backward), and of the
  vocabulary's log-sum-exp."""
  got = runs["collectives"]["tensor:4 plain"]
  reduces = {t.split("{")[0] for t, kind in got if kind == "all-reduce"}
  assert {"f32[4,4,16,32]", "f32[4,4,16]"} <= reduces, reduces
  assert not [t for t, kind in got if kind == "reduce-scatter"]


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_sequence_parallel_turns_the_pairs_all_reduces_into_reduce_scatters(runs):
  """tensor:4 (sequence parallel on): each pair's end reduce-scatters its sum onto a quarter
  of the sequence [4,4,4,32] and each pair's start all-gathers it [4,4,16,32], forward and
  backward (at least the 2 layers x 2 pairs; XLA merges the gathers of one value); the only
  all-reduce of an activation left is the embedding's (a take of the vocabulary's shards),
  where without it each pair's end all-reduces [4,4,16,32], forward and backward."""
  got = runs["collectives"]["tensor:4"]
  scatters = [t.split("{")[0] for t, kind in got if kind == "reduce-scatter"]
  gathers = [t.split("{")[0] for t, kind in got if kind == "all-gather" and t.startswith("f32")]
  reduces = [t.split("{")[0] for t, kind in got if kind == "all-reduce"]
  assert scatters and set(scatters) == {"f32[4,4,4,32]"}, got
  assert len(scatters) >= 4 and len(gathers) >= 4, got
  assert reduces.count("f32[4,4,16,32]") == 1, reduces  # the embedding's rows
  plain = [t for t, kind in runs["collectives"]["tensor:4 plain"] if kind == "all-reduce"
           and t.startswith("f32[4,4,16,32]")]
  assert len(plain) >= 4, plain


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_no_weight_is_gathered_under_tensor_parallel(runs):
  """Only activations are gathered (the sequence before each pair), never a weight.
  (lower/step.py's _once_computed read leaf.ravel()[0]: XLA gathered every whole parameter
  to reshape it, at every update, under fsdp too.)"""
  for name in ("tensor:4", "tensor:4 plain"):
    got = runs["collectives"][name]
    gathers = {t.split("{")[0] for t, kind in got if kind == "all-gather" and t.startswith("f32")}
    assert gathers <= {"f32[4,4,16,32]"}, (name, gathers)


@pytest.mark.slow  # reads the layouts' runs: one process training 17 runs over 4 host devices
def test_the_plan_lists_the_collectives_with_their_bytes(runs):
  lines = runs["collective_lines"]["tensor:4"]
  kinds = {x.split()[2]: x.split() for x in lines}
  count = sum(kind == "all-reduce" for _, kind in runs["collectives"]["tensor:4"])
  assert kinds["all-reduce"][3] == f"×{count}" and count >= 4, lines
  count = sum(kind == "reduce-scatter" for _, kind in runs["collectives"]["tensor:4"])
  assert kinds["reduce-scatter"][3] == f"×{count}", lines
  assert float(kinds["all-reduce"][4]) > 0 and kinds["all-reduce"][5] in ("B", "KiB"), lines
  moe = {x.split()[2] for x in runs["collective_lines"]["expert:4"]}
  assert "all-to-all" in moe


def test_the_rules_find_megatrons_pairs_and_the_vocabulary():
  from sexpgpu.lower.layouts import find_pairs
  from sexpgpu.run.compile import compile_file
  c = compile_file(TINY, None, [])
  split = {p.replace("lm/transformer-lm/", "").replace("repeat/block/", ""): how
           for p, how in find_pairs(c.stages[0].graph).split.items()}
  assert split == {"attention/q/w": (1, "columns"), "attention/k/w": (1, "columns"),
                   "attention/v/w": (1, "columns"), "attention/o/w": (0, "rows"),
                   "mlp/up/w": (1, "columns"), "mlp/down/w": (0, "rows"),
                   "embed": (0, "vocabulary"), "unembed": (1, "vocabulary")}


def _error(fn):
  from sexpgpu.errors import SxError
  with pytest.raises(SxError) as e:
    fn()
  return e.value


def test_defrun_writes_a_mesh_as_a_string(tmp_path):
  from sexpgpu.run.compile import compile_file
  src = open(TINY).read().replace(":precision f32", ':precision f32 :sharding "fsdp:2,tensor:2"')
  (tmp_path / "mesh.sx").write_text(src)
  c = compile_file(str(tmp_path / "mesh.sx"), None, [])
  assert str(c.exp.run["sharding"]) == "fsdp:2,tensor:2"
  (tmp_path / "bad.sx").write_text(src.replace("tensor:2", "tensor:2,model:1"))
  e = _error(lambda: compile_file(str(tmp_path / "bad.sx"), None, []))
  assert e.code == "E-KNOB-003" and "`model`" in e.message and e.location is not None


def test_an_unknown_axis_is_an_error_naming_the_axes():
  from sexpgpu.run.compile import compile_file
  e = _error(lambda: compile_file(TINY, None, [("sharding", "fsdp:2,model:2")]))
  assert e.code == "E-KNOB-003" and "`model`" in e.message
  assert "data, fsdp, tensor, expert" in e.fix
  e = _error(lambda: compile_file(TINY, None, [("sharding", "tensr")]))
  assert e.code == "E-KNOB-003" and "a mesh like fsdp:2,tensor:2" in e.fix


def test_a_mesh_of_another_device_count_is_an_error():
  from sexpgpu.lang.mesh import check_devices
  e = _error(lambda: check_devices("fsdp:2,tensor:4", 4))
  assert e.code == "E-KNOB-003" and "has 8 devices; the run has 4" in e.message
  assert e.where == "--set sharding=fsdp:2,tensor:4" and "tensor:4" in e.fix


def test_a_tensor_size_that_does_not_divide_the_heads_names_them_and_the_divisors():
  from sexpgpu.lower.layouts import param_specs
  from sexpgpu.run.compile import compile_file
  c = compile_file(TINY, None, [("heads", "2"), ("width", "96")])
  e = _error(lambda: param_specs(c.stages[0].graph, c.params, (("tensor", 4),)))
  assert e.code == "E-KNOB-003" and "tensor:4 does not divide the 2 heads" in e.message
  assert e.fix.startswith("tensor sizes that divide 2: 1, 2")
  c = compile_file(TINY, None, [("vocab", "30")])
  e = _error(lambda: param_specs(c.stages[0].graph, c.params, (("tensor", 4),)))
  assert "tensor:4 does not divide the vocabulary of lm/transformer-lm/embed (30)" in e.message


def test_an_expert_size_that_does_not_divide_the_experts_names_them():
  from sexpgpu.lower.layouts import param_specs
  from sexpgpu.run.compile import compile_file
  c = compile_file(MOE, "smoke", [])
  e = _error(lambda: param_specs(c.stages[0].graph, c.params, (("expert", 8),)))
  assert e.code == "E-KNOB-003" and e.message.startswith("expert:8 does not divide the 4 "
                                                         "experts of moe-lm/"), e.message
  assert e.fix.startswith("expert sizes that divide 4: 1, 2, 4")


def test_the_cli_refuses_a_mesh_of_another_device_count(tmp_path):
  p = subprocess.run(sexpgpu_cmd("check", TINY, "--variant", "smoke", "--set", "microbatches=4",
                                 "--set", "sharding=tensor:2", "--print", "plan"),
                     cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
  assert p.returncode == 1 and "error[E-KNOB-003]" in p.stderr, p.stderr
  assert "the mesh tensor:2 has 2 devices; the run has 4" in p.stderr


def test_check_prints_the_plans_reduce_scatters_under_tensor_parallel():
  """`check --print plan` under tensor:4: sequence parallel's reduce-scatters and all-gathers
  in the step's collectives."""
  p = subprocess.run(sexpgpu_cmd("check", TINY, "--variant", "smoke", "--set", "microbatches=4",
                                 "--set", "sharding=tensor:4", "--print", "plan"),
                     cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  lines = p.stdout.splitlines()
  got = {x.split()[2]: x.split()[3] for x in lines[lines.index("  collectives") + 1:]
         if x.startswith("    train step")}
  assert int(got["reduce-scatter"][1:]) >= 4 and int(got["all-gather"][1:]) >= 4, p.stdout

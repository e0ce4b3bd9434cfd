"""The memory plan (memory_analysis, E-MEM-001, SEXPGPU_MEMORY) and stacking's choice."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.devices import memory
from sexpgpu.devices.memory import plan
from sexpgpu.run.planning.plan import ChoiceCache, Given, choose_stacking, cost_model
from sexpgpu.run.planning import plan as stacking
from sexpgpu.errors import SxError

GPT2 = os.path.join(ROOT, "configs", "gpt2-small.sx")
TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")

# Builds the train step of a config for abstract inputs only, as the run loop will.
_ABSTRACT_STEP = """
import jax
from sexpgpu.run.compile import compile_file
from sexpgpu.run.training import build

def abstract_step(path, variant, stacking=None):
  c = compile_file(path, variant)
  training = build(c)
  k = training.k
  state = training.abstract_state()
  batches = training.abstract_batches(c.stages[0].data, (k,))
  return c, training.step(0, stacking or k), state, batches
"""
exec(_ABSTRACT_STEP)  # defines abstract_step here too


def _small():
  f = jax.jit(lambda s, x: ({"w": s["w"] - 0.1 * jnp.tanh(x @ s["w"]).T @ x}, jnp.sum(x)),
              donate_argnums=(0,))
  s = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
  x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
  return f.lower(s, x).compile()


def test_plan_is_memory_analysis_formula():
  ex = _small()
  m = ex.memory_analysis()
  p = plan({"train": ex}, {"parameters": 256 * 256 * 4}, 1000, 1 << 30, reserve=0)
  want = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)
  assert p.total == want + 1000
  assert m.alias_size_in_bytes > 0  # the donated state aliases the output
  assert p.peak_at == "train" and p.fits
  assert p.parts["largest live set"] == want - m.argument_size_in_bytes
  assert p.text().endswith("of 1.0 GiB free")
  ann = p.annotation()
  assert ann["planned_bytes"] == p.total and ann["parts"]["parameters"] == 262144
  json.dumps(ann)


def test_plan_peaks_at_the_largest_executable_and_counts_resident():
  small, big = _small(), memory.ExecutableMemory(10, 10, 10 << 20, 0, 0, 0)
  p = plan({"grads": big, "update": small}, {}, 0, 1 << 40, reserve=0)
  assert p.peak_at == "grads" and p.total == (10 << 20) + 20
  p2 = plan({"update": small}, {}, 0, 1 << 40, reserve=0, resident={"update": 1 << 30})
  assert p2.total >= 1 << 30


def test_refuse_when_free_is_small():
  p = plan({"train": _small()}, {"parameters": 262144, "optimizer states": 524288}, 0, 100_000,
           reserve=0)
  assert not p.fits
  e = memory.refuse(p, ":batch 4")
  assert isinstance(e, SxError) and e.code == "E-MEM-001"
  text = e.render()
  for word in ("parameters", "optimizer states", "97.7 KiB is free", ":batch 4", ":remat true",
               "bf16", ":layers", "SEXPGPU_STACKING=1"):
    assert word in text, word


def test_reserve_counts():
  p = plan({"train": _small()}, {}, 0, (1 << 30) + 1000, reserve=1 << 30)
  assert not p.fits


def test_free_bytes_of():
  dev = jax.devices("cpu")[0]
  assert memory.free_bytes_of(dev, "64MiB") == 64 << 20
  assert memory.free_bytes_of(dev, None) > 1 << 20  # the machine's memory on cpu
  with pytest.raises(SxError) as e:
    memory.free_bytes_of(dev, "lots")
  assert e.value.code == "E-ENV-001"


@pytest.mark.slow  # compiles gpt2's smoke step to plan it
def test_gpt2_smoke_refuses_at_64mib_before_any_initializer(monkeypatch):
  monkeypatch.setenv("SEXPGPU_MEMORY", "64MiB")
  before = {id(a) for a in jax.live_arrays()}
  c, st, state, batches = abstract_step(GPT2, "smoke")
  ex = st.lowered(state, batches).compile()
  dev = jax.devices("cpu")[0]
  p = plan({"train": ex}, memory.state_parts(state),
           memory.outside_bytes(memory.tree_bytes(batches), memory.tree_bytes(state)),
           memory.free_bytes_of(dev, os.environ["SEXPGPU_MEMORY"]), memory.reserve_for(dev))
  assert not p.fits and p.parts["parameters"] > 64 << 20 // 2
  e = memory.refuse(p)
  assert e.code == "E-MEM-001" and "64.0 MiB is free" in e.render()
  assert "SEXPGPU_MEMORY=64MiB" in e.render()
  # nothing was initialized: no array of a parameter's size came into being
  sizes = {int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(state["params"])}
  new = [a for a in jax.live_arrays() if id(a) not in before]
  assert not [a for a in new if a.size in sizes and a.size > 1000]
  assert sum(a.nbytes for a in new) < 1 << 20


def test_tiny_smoke_fits_at_64mib():
  c, st, state, batches = abstract_step(TINY, "smoke")
  p = plan({"train": st.lowered(state, batches).compile()}, memory.state_parts(state), 0,
           64 << 20,
           reserve=0)
  assert p.fits


_RSS = _ABSTRACT_STEP + """
import sys, gc, numpy as np
from sexpgpu.devices import memory
def status(key):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
c, st, state, batches = abstract_step(sys.argv[1], "smoke")
p = memory.plan({"train": st.compile(state, batches)}, memory.state_parts(state),
                memory.outside_bytes(memory.tree_bytes(batches), memory.tree_bytes(state)),
                1 << 40, reserve=0)
k = int(c.exp.run["microbatches"])
loader = c.loaders[c.stages[0].data]
host = []
for _ in range(3):
  mbs = [loader.next() for _ in range(k)]
  host.append({f: np.stack([b[f] for b in mbs]) for f in mbs[0]})
gc.collect()
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # resets VmHWM to the current RSS
from sexpgpu.lower.init import init_params
from sexpgpu.lower.step import init_state
s = init_state(init_params(int(c.exp.run["seed"]), c.params), st.optimizer)
for h in host:
  s, m = st(s, jax.device_put(h))
  jax.block_until_ready(m)
print(p.total, status("VmHWM:") - base)
"""


@pytest.mark.slow  # gpt2 smoke's plan against a run's measured RSS
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_gpt2_smoke_plan_against_measured_rss(tmp_path):
  script = tmp_path / "rss.py"
  script.write_text(_RSS)
  p = subprocess.run([sys.executable, str(script), GPT2], cwd=ROOT, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  planned, grown = map(int, p.stdout.split()[-2:])
  print(f"gpt2-small smoke on cpu: plan {planned} B, peak RSS growth {grown} B")
  # the cpu's RSS also holds malloc slack and the eager initializers' temporaries
  assert 0.75 * grown <= planned <= 1.25 * grown, (planned, grown)  # within 25%


# --- stacking -------------------------------------------------------------------

ALL = {1: True, 2: True, 4: True}


def test_fixed_wins():
  fixed = Given(fixed=2, remembered=4)
  assert choose_stacking(4, ALL, {4: 1.0, 2: 2.0, 1: 3.0}, given=fixed)[:2] == (2, "fixed")
  with pytest.raises(SxError) as e:
    choose_stacking(4, ALL, {}, given=Given(fixed=3))
  assert e.value.code == "E-ENV-001"


def test_only_one_fits():
  d, how, text = choose_stacking(4, {4: False, 2: False, 1: True}, {1: 5.0})
  assert (d, how, text) == (1, "only", "1: the only one that fits")


def test_none_fits():
  assert choose_stacking(4, {4: False, 2: False, 1: False}, {})[:2] == (0, "none")


def test_cost_model_choice():
  d, how, text = choose_stacking(4, ALL, {4: 0.0312, 2: 0.035, 1: 0.0417})
  assert (d, how) == (4, "model")
  assert text == "4: the cost model (4 31.2 ms; 2 35.0 ms; 1 41.7 ms)"


def test_close_predictions_are_measured():
  pred = {4: 0.1305, 2: 0.1315, 1: 0.1336}
  assert stacking.to_measure(ALL, pred) == [4, 2, 1]
  d, how, _ = choose_stacking(4, ALL, pred)
  assert how == "measure"
  d, how, text = choose_stacking(4, ALL, pred, {4: 0.1302, 2: 0.1352, 1: 0.1289})
  assert (d, how) == (1, "measured")
  assert text == ("1: measured at the first step, the model within 5% could not separate them "
                  "(4 130.2 ms, model 130.5 ms; 2 135.2 ms, model 131.5 ms; 1 128.9 ms, model "
                  "133.6 ms)")
  assert choose_stacking(4, ALL, pred, why_not="no room to measure")[1] == "model"


def test_close_predictions_of_slow_steps_are_left_to_the_model():
  # three close degrees at ~10 minutes a step (gpt2-small on a CPU): measuring each four
  # times would take two hours, so the model decides and says why
  pred = {4: 600.0, 2: 605.0, 1: 610.0}
  d, how, text = choose_stacking(4, ALL, pred)
  assert (d, how) == (4, "model")
  assert "within 5% but measuring would take about 7260 s" in text
  fast = {d: t / 10_000 for d, t in pred.items()}  # the same, at 60 ms a step
  assert choose_stacking(4, ALL, fast)[1] == "measure"


def test_remembered_choice():
  pred = {4: 0.1305, 2: 0.1315, 1: 0.1336}
  d, how, text = choose_stacking(4, ALL, pred, given=Given(remembered=2))
  assert (d, how) == (2, "remembered") and "choices.json" in text
  # a remembered degree that no longer fits is ignored
  assert choose_stacking(4, {4: True, 2: False, 1: True}, pred,
                         given=Given(remembered=2))[1] != "remembered"


def test_choice_cache_round_trip(tmp_path):
  path = tmp_path / "sub" / "choices.json"
  cache = ChoiceCache(str(path))
  assert cache.get("abc", "NVIDIA H200") is None
  cache.put("abc", "NVIDIA H200", 2, {4: 0.13, 2: 0.12})
  cache.put("def", "cpu", 1)
  again = ChoiceCache(str(path))
  assert again.get("abc", "NVIDIA H200") == 2 and again.get("def", "cpu") == 1
  assert again.get("abc", "cpu") is None
  data = json.loads(path.read_text())
  assert data["abc|NVIDIA H200"]["measured_s"] == {"4": 0.13, "2": 0.12}
  path.write_text("{not json")
  assert ChoiceCache(str(path)).get("abc", "NVIDIA H200") is None


def test_cost_model_multiplies_the_scan_body():
  def f(w, xs):
    def body(c, x):
      return c + jnp.sum(jnp.tanh(x @ w)), None
    return jax.lax.scan(body, 0.0, xs)[0]
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  one = jax.jit(f).lower(w, jax.ShapeDtypeStruct((1, 64, 128), jnp.float32)).compile()
  eight = jax.jit(f).lower(w, jax.ShapeDtypeStruct((8, 64, 128), jnp.float32)).compile()
  rates = {"flops": 1e9, "bytes": 1e18, "call": 0.0}
  t1, t8 = cost_model(one, 1, rates), cost_model(eight, 8, rates)
  assert t8 == pytest.approx(8 * t1, rel=0.2)
  assert cost_model({"flops": 2e9, "bytes accessed": 1.0}, 1, rates) == pytest.approx(2.0)
  assert cost_model({"flops": 3e9, "bytes accessed": 0.0}, 4,
                    dict(rates, call=0.5), outside={"flops": 1e9}) == pytest.approx(9.5)


def test_measure_rates_on_cpu():
  r = stacking.measure_rates(jax.devices("cpu")[0], size=128)
  assert r["flops"] > 0 and r["bytes"] > 0 and r["call"] >= 0 and r["buffer"] >= 0
  assert r["call"] + r["buffer"] > 0


def test_rates_are_measured_once_per_device_kind_and_remembered(monkeypatch, tmp_path):
  dev = jax.devices("cpu")[0]
  calls = []
  fake = {"flops": 1e9, "bytes": 1e9, "call": 1e-5, "buffer": 1e-6}
  monkeypatch.setattr(stacking, "measure_rates", lambda d: calls.append(d) or dict(fake))
  monkeypatch.setattr(stacking, "_RATES", {})
  assert stacking.device_rates(dev, str(tmp_path)) == fake
  monkeypatch.setattr(stacking, "_RATES", {})  # a new process: read back, not measured
  assert stacking.device_rates(dev, str(tmp_path)) == fake and len(calls) == 1
  saved = json.loads((tmp_path / "rates.json").read_text())
  (entry,) = saved.values()
  assert entry["model"] == stacking.COST_MODEL
  entry["model"] = stacking.COST_MODEL - 1  # rates an older model measured are measured again
  (tmp_path / "rates.json").write_text(json.dumps({stacking.device_name(dev): entry}))
  monkeypatch.setattr(stacking, "_RATES", {})
  stacking.device_rates(dev, str(tmp_path))
  assert len(calls) == 2


def test_a_choice_of_an_older_cost_model_is_made_again(tmp_path):
  path = tmp_path / "choices.json"
  ChoiceCache(str(path)).put("abc", "cpu:cpu", 1)
  data = json.loads(path.read_text())
  assert data["abc|cpu:cpu"]["model"] == stacking.COST_MODEL
  data["abc|cpu:cpu"]["model"] = stacking.COST_MODEL - 1
  path.write_text(json.dumps(data))
  assert ChoiceCache(str(path)).get("abc", "cpu:cpu") is None
  del data["abc|cpu:cpu"]["model"]  # written before the model had a version
  path.write_text(json.dumps(data))
  assert ChoiceCache(str(path)).get("abc", "cpu:cpu") is None


def test_a_calls_fixed_cost_counts_its_buffers():
  def f(xs):
    return [x + 1 for x in xs]
  few = jax.jit(f).lower([jax.ShapeDtypeStruct((4,), jnp.float32)] * 2).compile()
  many = jax.jit(f).lower([jax.ShapeDtypeStruct((4,), jnp.float32)] * 40).compile()
  assert stacking.buffers(few) == 4 and stacking.buffers(many) == 80
  rates = {"flops": 1e18, "bytes": 1e18, "call": 1e-5, "buffer": 1e-6}
  assert stacking.call_seconds(few, rates) == pytest.approx(1e-5 + 4e-6)
  assert cost_model(many, 1, rates) == pytest.approx(1e-5 + 80e-6, rel=1e-3)


def test_the_tiny_model_is_fused_by_the_cost_model():
  """Where a step is mostly its calls' fixed cost, one fused call beats K calls."""
  c, _, state, batches = abstract_step(TINY, "smoke")
  from sexpgpu.run.training import build
  training = build(c)
  k = training.k
  execs = {d: training.step(0, d).executables(state, batches) for d in stacking.divisors(k)}
  update = next(ex["update"] for ex in execs.values() if "update" in ex)
  rates = stacking.measure_rates(jax.devices("cpu")[0])
  preds = {d: stacking.predict(execs[d], d, k, rates, update) for d in execs}
  assert min(preds, key=preds.get) == k, preds


def test_peak_line():
  p = plan({"t": memory.ExecutableMemory(0, 0, 1000, 0, 0, 0)}, {}, 0, 1 << 30, reserve=0)
  assert memory.peak_line(1018, p) == "memory: peak 1018 B of 1000 B planned (+1.8%)"


# --- the lowering report (it shares the compiled step) -----------------------------

def test_lowering_report_on_cpu():
  from sexpgpu.devices import report
  c, st, state, batches = abstract_step(TINY, "smoke")
  ex = st.lowered(state, batches).compile()
  dev = jax.devices("cpu")[0]
  p = plan({"train": ex}, memory.state_parts(state), 0, 8 << 30, reserve=0)
  regions = [("attention", "2 regions → xla attention (f32, causal)")]
  lines = report.lowering_report(dev, True, regions, ex, p, "4: the only one that fits")
  assert lines[0] == "lowering: cpu cpu, patterns on"
  assert lines[1] == "  attention                 2 regions → xla attention (f32, causal)"
  assert lines[2].startswith("  products                  ") and "dot ops" in lines[2]
  counts = report.hlo_counts(ex.as_text())
  assert counts["dots"] > 0 and counts["fusions"] > 0 and "f32" in counts["inputs"]
  assert lines[3] == f"  fusions                   {counts['fusions']} XLA fusions in the train step"
  assert lines[4] == f"  memory                    {p.text()}"
  assert lines[5] == "  stacking                  4: the only one that fits"
  ann = report.lowering_annotation(dev, False, regions, ex, p, None)
  assert ann["fusions"] == counts["fusions"] and ann["lines"][0].endswith("patterns off")
  assert ann["memory"]["planned_bytes"] == p.total
  json.dumps(ann)


def test_hlo_counts_of_gpu_text():
  hlo = """
ENTRY %main (a: bf16[8,8], b: bf16[8,8]) -> f32[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %cublas-gemm.1 = (f32[8,8]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  %dot.2 = f32[8,8]{1,0} dot(bf16[8,8]{1,0} %a, bf16[8,8]{1,0} %b), lhs_contracting_dims={1}
  ROOT %loop_add_fusion = f32[8,8]{1,0} fusion(%dot.2), kind=kLoop, calls=%fused_add
}"""
  from sexpgpu.devices import report
  c = report.hlo_counts(hlo)
  assert c == {"dots": 2, "inputs": ["bf16"], "accumulate": ["f32"], "fusions": 1}

  class Dev:
    platform, device_kind, compute_capability = "gpu", "NVIDIA H200", "9.0"
  assert report.lowering_report(Dev(), True, None, hlo, None, None)[:2] == [
      "lowering: cuda compute_90 NVIDIA H200, patterns on",
      "  products                  2 dot ops, bf16 inputs, f32 accumulate"]


def _copied_state():
  """Entry parameters (state leaves) the compiled tiny-lm step copies before using them."""
  c, st, state, batches = abstract_step(TINY, None)
  hlo = st.lowered(state, batches).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  # scalars (the step and skipped-step counters) are 4 bytes a copy: only arrays count
  params = {name for name, ty in re.findall(r"%(\S+) = (\S+) parameter\(\d+\)", entry)
            if not ty.endswith("[]")}
  return [p for p in re.findall(r" copy\(%([^)]+)\)", entry) if p in params]


@pytest.mark.slow  # compiles and measures steps
def test_the_step_updates_the_optimizer_state_in_place(monkeypatch):
  # the moments' select waits for the new parameters, so XLA need not copy them first
  assert _copied_state() == []
  from sexpgpu.lower import step
  monkeypatch.setattr(step, "_once_computed", lambda flag, tree: flag)
  assert len(_copied_state()) >= 2  # without the ordering: a copy of each moment at least

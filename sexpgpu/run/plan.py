"""Before the first initializer: compile every step abstractly, plan memory, choose stacking."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from sexpgpu.devices import memory as mem
from sexpgpu.errors import SxError

_RATES: dict[str, dict] = {}


@dataclasses.dataclass
class Choice:
  """What the planning chose: the stacking degree, how and why, and the memory plan."""

  degree: int
  how: str
  text: str
  plan: mem.Plan
  executables: dict
  candidates: list[int]  # degrees to measure at the first step when how == "measure"
  fits: dict
  predicted: dict
  totals: dict  # degree → the plan's total bytes


def _rates(device) -> dict:
  key = f"{device.platform}:{device.id}"
  if key not in _RATES:
    _RATES[key] = mem.measure_rates(device)
  return _RATES[key]


def device_name(device, ranks: int = 1) -> str:
  """choices.json's device part: the kind, and the rank count when data parallel (a
  degree measured for one device's share of the microbatches says nothing of another's)."""
  name = f"{device.platform}:{getattr(device, 'device_kind', '')}"
  return name if ranks == 1 else f"{name} x{ranks}"


def predict(executables: dict, degree: int, per_rank: int, rates: dict) -> float:
  """The cost model's seconds for one step at a stacking degree."""
  if "train step" in executables:
    return mem.cost_model(executables["train step"], degree, rates)
  calls = per_rank // degree
  return (calls * mem.cost_model(executables["gradient call"], degree, rates)
          + mem.cost_model(executables["update"], 1, rates))


def shrink_hints(knobs: dict) -> list[str]:
  """The experiment's own knobs that would shrink the plan, with their values."""
  hints = []
  for name in ("batch", "seq", "width", "layers", "microbatches"):
    if name in knobs and isinstance(knobs[name].value, int) and knobs[name].value > 1:
      hints.append(f"--set {name}={max(1, knobs[name].value // 2)} (now {knobs[name].value})")
  return hints


def choose(make_step, per_rank: int, fixed: int | None, state, batches, pass_steps: dict,
           pass_inputs: dict, device, checkpointing: bool, graph_fingerprint: str,
           cache_dir: str, knobs: dict, several_nodes: bool = False,
           ranks: int = 1) -> Choice:
  """Compiles the step at each stacking degree that could be used, and picks one.

  Args:
    make_step: degree → TrainStep.
    per_rank: microbatches per rank per step.
    fixed: SEXPGPU_STACKING's degree or None.
    state, batches: abstract train state and one step's abstract batches.
    pass_steps, pass_inputs: pass name → PassStep, and its abstract (params, batch).
    device: the first device of the run.
    checkpointing: whether a copy of the state is kept while a checkpoint is written.
    several_nodes: node 0's choice is every node's (nothing is measured).
    ranks: data-parallel ranks in all (choices.json keeps each count apart).

  Raises:
    SxError: E-MEM-001 when no degree fits.
  """
  degrees = [fixed] if fixed is not None else sorted(mem.divisors(per_rank), reverse=True)
  pass_execs = {f"pass {n}": s.compile(*pass_inputs[n]) for n, s in pass_steps.items()}
  parts_1 = mem.state_parts(state, accumulators=1)
  state_total = mem.tree_bytes(state)
  outside = mem.outside_bytes(mem.tree_bytes(batches), state_total, checkpoint_copy=checkpointing)
  free = mem.free_bytes_of(device, os.environ.get("SEXPGPU_MEMORY"))
  reserve = mem.reserve_for(device)
  plans, execs, predicted = {}, {}, {}
  for d in degrees:
    step = make_step(d)
    ex = step.executables(state, batches)
    resident = {}
    if "gradient call" in ex:  # the optimizer state and the running gradient sum stay alive
      resident["gradient call"] = parts_1["optimizer states"] + parts_1[
          "gradients and accumulators"]
    parts = mem.state_parts(state, accumulators=1 if "train step" in ex else 2)
    plans[d] = mem.plan({**ex, **pass_execs}, parts, outside, free, reserve, resident)
    execs[d] = ex
  fits = {d: p.fits for d, p in plans.items()}
  if len([d for d in degrees if fits[d]]) > 1:
    rates = _rates(device)
    predicted = {d: predict(execs[d], d, per_rank, rates) for d in degrees}
  cache = mem.ChoiceCache(os.path.join(cache_dir, "choices.json"))
  name = device_name(device, ranks)
  remembered = cache.get(graph_fingerprint, name)
  can_measure = all(p.total + state_total + p.reserve <= p.free for d, p in plans.items()
                    if fits[d])
  why_not = "no room to measure"
  if several_nodes:
    can_measure, why_not = False, "several nodes do not measure"
  degree, how, text = mem.choose_stacking(per_rank, fits, predicted, None, remembered, fixed,
                                          can_measure, why_not)
  if several_nodes:  # each node's timings and choices.json may differ: node 0 decides for all
    from sexpgpu.devices.nodes import follow_node_0
    degree, how, text = follow_node_0("stacking", [degree, how, text])
  if how == "none":
    smallest = min(plans.values(), key=lambda p: p.total)
    raise mem.refuse(smallest, shrink_hints(knobs))
  # The cost model's inputs are timed per process, so its choice is remembered too: every
  # later run of this graph on this device then sums its gradients in the same order.
  if how == "model":
    cache.put(graph_fingerprint, name, degree, None)
  elif how == "remembered":
    entry = cache._load().get(cache.key(graph_fingerprint, name), {})
    if not entry.get("measured_s"):
      text = (f"{degree}: the cost model's choice for this graph on this device, remembered "
              "(choices.json)")
  cands = mem.to_measure(fits, predicted) if how == "measure" else []
  return Choice(degree, how, text, plans[degree], execs[degree], cands, fits, predicted,
                {d: p.total for d, p in plans.items()})


def measure(choice: Choice, make_step, state, batches, per_rank: int, graph_fingerprint: str,
            device, cache_dir: str, ranks: int = 1) -> Choice:
  """Times one step at each close degree on a copy of the state, keeps the fastest, remembers it."""
  measured = {}
  for d in choice.candidates:
    step = make_step(d)
    best = float("inf")
    try:
      copy = jax.tree_util.tree_map(jnp.copy, state)
      new, m = step(copy, batches)  # compiles if needed; the state copy is donated
      jax.block_until_ready(m)
      for _ in range(mem.MEASURE_RUNS - 1):  # the fastest: one step's time is noisy
        copy = jax.tree_util.tree_map(jnp.copy, state)
        t = time.perf_counter()
        new, m = step(copy, batches)
        jax.block_until_ready(m)
        best = min(best, time.perf_counter() - t)
        del new
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      jax.clear_caches()  # this degree does not fit after all: it is not chosen
    measured[d] = best
  degree, how, text = mem.choose_stacking(per_rank, choice.fits, choice.predicted, measured,
                                          None, None)
  mem.ChoiceCache(os.path.join(cache_dir, "choices.json")).put(
      graph_fingerprint, device_name(device, ranks), degree, measured)
  return dataclasses.replace(choice, degree=degree, how=how, text=text, candidates=[])

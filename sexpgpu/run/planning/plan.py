"""Before the first initializer: compile every step abstractly, plan memory, choose stacking.

Stacking (how many microbatches one call of the training graph runs) is chosen
here and nowhere else: the stacking rules (`choose_stacking`),
the cost model they consult (`cost_model`, with the device's rates measured once
per device kind and remembered), the choices remembered in `choices.json`, and
the measurement of close degrees at the first step (`measure`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from sexpgpu import env
from sexpgpu.devices import memory as mem
from sexpgpu.errors import SxError
from sexpgpu.paths import read_json_object, write_atomic

# The cost model's version, kept with every remembered rate and choice: a choice an
# older model made is made again. 2: a call's fixed cost counts its argument and
# result buffers (measured), and a fused step's update is counted once, not per trip.
COST_MODEL = 2
CLOSE = 0.05  # predictions within 5% are measured instead
# A measurement runs each close degree MEASURE_RUNS times (the first compiles): when
# that would take longer than MEASURE_BUDGET_S by the model, the model decides.
MEASURE_RUNS = 4
MEASURE_BUDGET_S = 60.0

_RATES: dict[str, dict] = {}


# --- the rules ------------------------------------------------------------------------------

def divisors(k: int) -> list[int]:
  """The stacking degrees of k microbatches per rank, descending."""
  return [d for d in range(k, 0, -1) if k % d == 0]


def to_measure(fits: Mapping[int, bool], predicted: Mapping[int, float]) -> list[int]:
  """The fitting degrees whose prediction is within 5% of the best one, descending."""
  cands = [d for d, ok in fits.items() if ok and d in predicted]
  if not cands:
    return []
  best = min(predicted[d] for d in cands)
  return sorted((d for d in cands if predicted[d] <= best * (1 + CLOSE)), reverse=True)


def _ms(s: float) -> str:
  return f"{s * 1e3:.1f} ms"


@dataclasses.dataclass(frozen=True)
class Given:
  """The degrees a stacking choice is given before any model: SEXPGPU_STACKING's, which
  fixes it, and the one choices.json remembers for this graph and device."""

  fixed: int | None = None
  remembered: int | None = None


def check_fixed(fixed: int, k_per_rank: int) -> None:
  """Refuses a fixed stacking degree (SEXPGPU_STACKING) that does not divide the microbatches
  each rank runs in a step, before any step is compiled at it.

  Raises:
    SxError: E-ENV-001 naming the variable and the degrees that divide.
  """
  if fixed >= 1 and k_per_rank % fixed == 0:
    return
  works = ", ".join(f"SEXPGPU_STACKING={d}" for d in divisors(k_per_rank))
  raise SxError("E-ENV-001", f"SEXPGPU_STACKING={fixed} does not divide the {k_per_rank} "
                f"microbatch{'es' if k_per_rank != 1 else ''} each rank runs in a step",
                where="SEXPGPU_STACKING",
                fix=f"unset it (auto), or use a divisor: {works}")


def choose_stacking(k_per_rank: int, fits: Mapping[int, bool], predicted: Mapping[int, float],
                    measured: Mapping[int, float] | None = None, given: Given = Given(),
                    why_not: str | None = None) -> tuple[int, str, str]:
  """Chooses how many microbatches one call of the training graph runs.

  The rules, in order: SEXPGPU_STACKING fixes it; the only degree that fits;
  a measurement an earlier run of this graph made on this device; the cost
  model, when its best prediction is more than 5% ahead of the next; else a
  measurement of the close ones at the first step (when a second copy of the
  state fits: `can_measure`; otherwise the model decides).

  Args:
    k_per_rank: microbatches per rank per step.
    fits: degree → whether the plan at that degree fits.
    predicted: degree → the cost model's seconds per step.
    measured: degree → measured seconds per step at the first step, or None.
    given: SEXPGPU_STACKING's degree (None for auto) and the one choices.json holds for
      this graph and device (or None).
    why_not: None when a measurement is possible (a second state copy fits, and one
      node: several nodes would have to time their steps in lockstep), else why it is
      not, for the report line. Close degrees whose measurement would outlast
      MEASURE_BUDGET_S are not measured either: a slow step (a large model on the CPU)
      is left to the model.

  Returns:
    (degree, how, text): how is one of "fixed", "only", "remembered", "model",
    "measured", "measure" (the caller must time `to_measure(...)` and call
    again with `measured`) or "none" (nothing fits: degree 0; raise refuse()).
    text is the stacking report line's value.

  Raises:
    SxError: E-ENV-001 when `given.fixed` does not divide k_per_rank.
  """
  fixed, remembered = given.fixed, given.remembered
  if fixed is not None:
    check_fixed(fixed, k_per_rank)
    note = "" if fits.get(fixed, True) else ", beyond the plan"
    return fixed, "fixed", f"{fixed}: SEXPGPU_STACKING{note}"
  cands = [d for d in divisors(k_per_rank) if fits.get(d, False)]
  if not cands:
    return 0, "none", "no degree fits"
  if len(cands) == 1:
    return cands[0], "only", f"{cands[0]}: the only one that fits"
  if remembered in cands:
    return remembered, "remembered", (f"{remembered}: measured by an earlier run of this graph on "
                                      "this device (choices.json)")
  preds = {d: predicted[d] for d in cands if d in predicted}
  if not preds:
    return cands[0], "model", f"{cands[0]}: the largest that fits (no prediction)"
  close = to_measure({d: True for d in preds}, preds)
  listing = "; ".join(f"{d} {_ms(preds[d])}" for d in sorted(preds, reverse=True))
  best = min(preds, key=lambda d: (preds[d], -d))
  if len(close) < 2:
    return best, "model", f"{best}: the cost model ({listing})"
  cost = MEASURE_RUNS * sum(preds[d] for d in close)
  if why_not is None and cost > MEASURE_BUDGET_S:
    why_not = f"measuring would take about {cost:.0f} s"
  if why_not is not None:
    return best, "model", f"{best}: the cost model, within 5% but {why_not} ({listing})"
  if not measured or any(d not in measured for d in close):
    return best, "measure", f"{best}: to be measured at the first step ({listing})"
  won = min(close, key=lambda d: (measured[d], -d))  # the fastest measured
  detail = "; ".join(f"{d} {_ms(measured[d])}, model {_ms(preds[d])}" for d in close)
  return won, "measured", (f"{won}: measured at the first step, the model within 5% could not "
                           f"separate them ({detail})")


# --- the cost model -------------------------------------------------------------------------

def _cost(c) -> tuple[float, float]:
  if c is None:
    return 0.0, 0.0
  d = c if isinstance(c, Mapping) else c.cost_analysis()
  if isinstance(d, (list, tuple)):
    d = d[0] if d else {}
  return float(d.get("flops", 0.0)), float(d.get("bytes accessed", 0.0))


def buffers(compiled) -> int:
  """Argument and result buffers of a call: what its fixed cost grows with."""
  try:
    return int(compiled.in_tree.num_leaves) + int(compiled.out_tree.num_leaves)
  except AttributeError:  # a cost_analysis dict: nothing known of its buffers
    return 0


def call_seconds(compiled, device_rates: Mapping[str, float]) -> float:
  """The fixed cost of one call: dispatch plus a share for each argument and result."""
  return (float(device_rates.get("call", 0.0))
          + float(device_rates.get("buffer", 0.0)) * buffers(compiled))


def cost_model(compiled, trips: int, device_rates: Mapping[str, float],
               outside: Any = None) -> float:
  """Predicted seconds of one call, from cost_analysis, the scan body times its trips.

  cost_analysis counts a lax.scan body once: the cost outside the loop (the
  `outside` executable's, e.g. the optimizer update, or none) is subtracted,
  the rest multiplied by `trips`, and the two added back.

  Args:
    compiled: a jax.stages.Compiled (or its cost_analysis dict).
    trips: the scan's trip count (the stacking degree).
    device_rates: {"flops": flop/s, "bytes": byte/s, "call": seconds a call,
      "buffer": seconds per argument or result buffer}.
    outside: the cost (Compiled or dict) of the part outside the loop, or None.

  Returns:
    Seconds: the call's fixed cost + max(flops / flop rate, bytes / byte rate).
  """
  f_all, b_all = _cost(compiled)
  f_out, b_out = _cost(outside)
  f_out, b_out = min(f_out, f_all), min(b_out, b_all)
  flops = f_out + trips * (f_all - f_out)
  nbytes = b_out + trips * (b_all - b_out)
  return call_seconds(compiled, device_rates) + max(flops / device_rates["flops"],
                                                    nbytes / device_rates["bytes"])


def predict(executables: dict, degree: int, per_rank: int, rates: dict,
            update: Any = None) -> float:
  """The cost model's seconds for one step at a stacking degree.

  Args:
    executables: the degree's executables ("train step", or "gradient call" and "update").
    degree: the stacking degree.
    per_rank: microbatches per rank per step.
    rates: the device's rates (device_rates).
    update: another degree's "update" executable, when one was compiled: the part of
      a fused step that runs once, not once per trip.
  """
  if "train step" in executables:
    return cost_model(executables["train step"], degree, rates, update)
  calls = per_rank // degree
  grads = executables["gradient call"]
  # the step also zeroes the sums (one small call) before its gradient calls
  return (float(rates.get("call", 0.0)) + calls * cost_model(grads, degree, rates)
          + cost_model(executables["update"], 1, rates))


def measure_rates(device, size: int | None = None) -> dict[str, float]:
  """The device's matmul flop/s, copy byte/s and a call's fixed seconds, timed in ~a second.

  A call's fixed cost is timed twice, with 1 and with 65 small arguments (each
  returned), so it splits into a dispatch cost and a cost per buffer.
  """
  n = size or (4096 if device.platform != "cpu" else 512)
  dt = jnp.bfloat16 if device.platform != "cpu" else jnp.float32
  wide = 65
  with jax.default_device(device):
    a = jnp.ones((n, n), dt)
    v = jnp.ones((n * n * 4,), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    cp = jax.jit(lambda x: x * 2.0)
    one = jax.jit(lambda x: x + 1)
    many = jax.jit(lambda xs: [x + 1 for x in xs])
    s = jnp.ones((8,), jnp.float32)
    ss = [jnp.ones((8,), jnp.float32) for _ in range(wide)]

    t_mm, t_cp = fastest(mm, a), fastest(cp, v)
    t_one, t_many = fastest(one, s, 50), fastest(many, ss, 50)
  per_buffer = max(t_many - t_one, 0.0) / (2 * (wide - 1))
  return {"flops": 2 * n ** 3 / max(t_mm, 1e-9), "bytes": 2 * v.nbytes / max(t_cp, 1e-9),
          "call": max(t_one - 2 * per_buffer, 0.0), "buffer": per_buffer}


def _write_json(path: str, data: dict) -> None:
  write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def fastest(fn, x, reps: int = 5) -> float:
  """The fastest of `reps` calls of fn(x), in seconds, after one call that compiles."""
  jax.block_until_ready(fn(x))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t)
  return min(times)


def device_rates(device, cache_dir: str | None = None) -> dict:
  """The device's rates: measured once per device kind, remembered with the model's version.

  Args:
    device: a jax Device.
    cache_dir: where `rates.json` is kept (none: measured once per process).
  """
  name = device_name(device)
  if name in _RATES:
    return _RATES[name]
  path = os.path.join(cache_dir, "rates.json") if cache_dir else None
  known = read_json_object(path).get(name) if path else None
  if (isinstance(known, dict) and known.get("model") == COST_MODEL
      and known.get("jax") == jax.__version__
      and all(isinstance(known.get(k), (int, float)) for k in ("flops", "bytes", "call",
                                                                "buffer"))):
    rates = {k: float(known[k]) for k in ("flops", "bytes", "call", "buffer")}
  else:
    rates = measure_rates(device)
    if path:
      data = read_json_object(path)
      data[name] = dict(rates, model=COST_MODEL, jax=jax.__version__)
      _write_json(path, data)
  _RATES[name] = rates
  return rates


class ChoiceCache:
  """`<cache>/choices.json`: stacking choices by (graph fingerprint, device), with the model's
  version; an entry another version of the cost model wrote is not used."""

  def __init__(self, path: str):
    """Args: path: the JSON file (usually os.path.join(cache_dir(), "choices.json"))."""
    self.path = path

  @staticmethod
  def key(fingerprint: str, device: str) -> str:
    """The entry's key: `<graph fingerprint>|<device kind or name>`."""
    return f"{fingerprint}|{device}"

  def entry(self, fingerprint: str, device: str) -> dict | None:
    """The entry this version of the cost model wrote, or None."""
    e = read_json_object(self.path).get(self.key(fingerprint, device))
    if not isinstance(e, dict) or e.get("model") != COST_MODEL:
      return None
    return e

  def get(self, fingerprint: str, device: str) -> int | None:
    """The remembered degree, or None (also when missing, unreadable or of another model)."""
    e = self.entry(fingerprint, device)
    try:
      return int(e["degree"]) if e else None
    except (KeyError, TypeError, ValueError):
      return None

  def put(self, fingerprint: str, device: str, degree: int,
          measured: Mapping[int, float] | None = None) -> None:
    """Remembers a choice; written beside the file then renamed (atomic)."""
    data = read_json_object(self.path)
    data[self.key(fingerprint, device)] = {
        "degree": int(degree), "model": COST_MODEL,
        "measured_s": {str(k): v for k, v in (measured or {}).items()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_json(self.path, data)

  # `:sharding auto`'s choices (run/planning/layout_plan.py) live in the same file, under their own
  # key, with the layout model's version.
  def layout(self, fingerprint: str, device: str, model: int) -> str | None:
    """The remembered layout (`tensor:4`, `replicate`) of `:sharding auto`, or None."""
    e = read_json_object(self.path).get(self.key(fingerprint, device) + "|layout")
    if not isinstance(e, dict) or e.get("model") != model or not isinstance(e.get("layout"),
                                                                           str):
      return None
    return e["layout"]

  def put_layout(self, fingerprint: str, device: str, layout: str, model: int,
                 measured: Mapping[str, float] | None = None) -> None:
    """Remembers `:sharding auto`'s choice, with the seconds measured of each timed layout."""
    data = read_json_object(self.path)
    data[self.key(fingerprint, device) + "|layout"] = {
        "layout": layout, "model": model, "measured_s": dict(measured or {}),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_json(self.path, data)


# --- planning -------------------------------------------------------------------------------

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


def device_name(device, ranks: int = 1) -> str:
  """choices.json's device part: the kind, and the rank count when data parallel (a
  degree measured for one device's share of the microbatches says nothing of another's)."""
  name = f"{device.platform}:{getattr(device, 'device_kind', '')}"
  return name if ranks == 1 else f"{name} x{ranks}"


def shrink_hints(knobs: dict) -> list[str]:
  """The experiment's own knobs that would shrink the plan, with their values."""
  hints = []
  for name in ("batch", "seq", "width", "layers", "microbatches"):
    if name in knobs and isinstance(knobs[name].value, int) and knobs[name].value > 1:
      hints.append(f"--set {name}={max(1, knobs[name].value // 2)} (now {knobs[name].value})")
  return hints


def spec_lines(training, stage: int = 0) -> list[str]:
  """`check --print plan`'s lines of each parameter's PartitionSpec (none when replicated):
  `    lm/embed  (tensor, ·)`, one axis a place, `·` for an axis kept whole."""
  from sexpgpu.lower.layouts import spec_text
  specs = training.specs(stage)
  w = max((len(p) for p in specs), default=0)
  return [f"    {path:<{w}}  {spec_text(s)}" for path, s in specs.items()]


def collective_lines(executables: Mapping[str, Any]) -> list[str]:
  """`check --print plan`'s lines of each executable's collectives: count and bytes by kind
  (`    train step  all-reduce ×7 112.0 KiB`; a loop's body once)."""
  from sexpgpu.lower.layouts import collectives
  lines = []
  for name, compiled in executables.items():
    kinds: dict[str, list[int]] = {}
    for kind, size in collectives(compiled.as_text()):
      kinds.setdefault(kind, []).append(size)
    lines += [f"    {name:<13} {kind} ×{len(v)} {mem.human(sum(v))}"
              for kind, v in sorted(kinds.items())]
  return lines


def sharding_hint(training, plan: mem.Plan, state) -> list[str]:
  """`--set sharding=fsdp (about X a device)` when sharding the state would make it fit.

  The estimate takes the parameters, optimizer states and f32 gradient sums out of the
  replicated plan and puts back one device's share of them (1/R): what fsdp saves.
  """
  if training.sharding != "replicate" or training.ranks < 2 or training.place is None:
    return []
  whole = sum(plan.parts.get(k, 0) for k in ("parameters", "optimizer states",
                                             "gradients and accumulators"))
  need = plan.total - whole + whole // training.ranks
  if need + plan.reserve > plan.free:
    return []
  return [f"--set sharding=fsdp (about {mem.human(need)} a device over {training.ranks})"]


def state_parts(training, mine: dict, accumulators: int) -> dict[str, int]:
  """The parts of one device's state (devices/memory.py), f32 gradients and their sums of
  the trained parameters only: a frozen one (`:trainable`, LoRA's base, the reference's
  copies) has no gradient, as it has no optimizer state."""
  parts = mem.state_parts(mine, accumulators)
  trained = {"params": training.trained(mine["params"])}
  parts["gradients and accumulators"] = mem.state_parts(
      trained, accumulators)["gradients and accumulators"]
  return parts


# Step batches on the device at once: the one in use and those drawn ahead (run/feed.py).
BUFFERED_BATCHES = 3


@dataclasses.dataclass(frozen=True)
class Setting:
  """What a plan needs of the run around its steps."""

  cache_dir: str  # where choices.json and rates.json are kept
  checkpointing: bool = False  # a copy of the state is kept while a checkpoint is written
  several_nodes: bool = False  # node 0's choice is every node's (nothing is measured)


def choose(training, stage: int, fixed: int | None, state, batches, setting: Setting) -> Choice:
  """Compiles the step at each stacking degree that could be used, and picks one.

  Args:
    training: the run's Training (run/training.py): its steps and pass steps, and the
      placement whose first device is planned.
    stage: the curriculum stage whose step is planned.
    fixed: SEXPGPU_STACKING's degree or None.
    state, batches: abstract train state and one step's abstract batches.
    setting: the cache folder, whether checkpoints keep a copy of the state, several nodes.

  Raises:
    SxError: E-MEM-001 when no degree fits.
  """
  device, cache_dir = training.place.first, setting.cache_dir
  per_rank = training.k // training.ranks
  if fixed is not None:
    check_fixed(fixed, per_rank)
  degrees = [fixed] if fixed is not None else sorted(divisors(per_rank), reverse=True)
  params = training.place_abstract(state, stage)["params"]
  pass_execs = {f"pass {n}": s.compile(params, training.place.abstract(
      training.abstract_batches(p.data, ())) if training.place else
      training.abstract_batches(p.data, ()))
      for n, s, p in ((n, s, training.c.exp.passes[n]) for n, s in training.pass_steps.items())}
  mine = training.share(state)  # what one device holds of the state (all of it, replicated)
  parts_1 = state_parts(training, mine, accumulators=1)
  state_total = mem.tree_bytes(mine)
  outside = mem.outside_bytes(mem.tree_bytes(batches), state_total,
                              buffered_batches=BUFFERED_BATCHES,
                              checkpoint_copy=setting.checkpointing)
  free = mem.free_bytes_of(device, env.get("SEXPGPU_MEMORY"))
  reserve = mem.reserve_for(device)
  plans, execs, predicted = {}, {}, {}
  over = ("" if training.sharding == "replicate"
          else f"{training.sharding} over {training.split_over(stage)}")
  for d in degrees:
    ex = training.step(stage, d).executables(state, batches)
    resident = {}
    if "gradient call" in ex:  # the optimizer state and the running gradient sum stay alive
      resident["gradient call"] = parts_1["optimizer states"] + parts_1[
          "gradients and accumulators"]
    parts = state_parts(training, mine, accumulators=1 if "train step" in ex else 2)
    plans[d] = mem.plan({**ex, **pass_execs}, parts, outside, free, reserve, resident,
                        over=over)
    execs[d] = ex
  fits = {d: p.fits for d, p in plans.items()}
  if len([d for d in degrees if fits[d]]) > 1:
    rates = device_rates(device, cache_dir)
    update = next((ex["update"] for ex in execs.values() if "update" in ex), None)
    predicted = {d: predict(execs[d], d, per_rank, rates, update) for d in degrees}
  cache = ChoiceCache(os.path.join(cache_dir, "choices.json"))
  name = device_name(device, training.ranks)
  remembered = cache.get(training.c.graph_fingerprint, name)
  can_measure = all(p.total + state_total + p.reserve <= p.free for d, p in plans.items()
                    if fits[d])
  why_not = None if can_measure else "no room to measure"
  if setting.several_nodes:
    why_not = "several nodes do not measure"
  degree, how, text = choose_stacking(per_rank, fits, predicted, None,
                                      Given(fixed, remembered), why_not)
  if setting.several_nodes:  # each node's timings and choices.json may differ: node 0 decides for all
    from sexpgpu.devices.nodes import follow_node_0
    degree, how, text = follow_node_0("stacking", [degree, how, text])
  if how == "none":
    smallest = min(plans.values(), key=lambda p: p.total)
    raise mem.refuse(smallest, sharding_hint(training, smallest, state)
                     + shrink_hints(training.c.selection.knobs))
  # The cost model's inputs are timed per process, so its choice is remembered too: every
  # later run of this graph on this device then sums its gradients in the same order.
  if how == "model":
    cache.put(training.c.graph_fingerprint, name, degree, None)
  elif how == "remembered":
    entry = cache.entry(training.c.graph_fingerprint, name) or {}
    if not entry.get("measured_s"):
      text = (f"{degree}: the cost model's choice for this graph on this device, remembered "
              "(choices.json)")
  cands = to_measure(fits, predicted) if how == "measure" else []
  return Choice(degree, how, text, plans[degree], execs[degree], cands, fits, predicted,
                {d: p.total for d, p in plans.items()})


def measure(choice: Choice, training, stage: int, state, batches, cache_dir: str) -> Choice:
  """Times one step at each close degree on a copy of the state (on the run's devices),
  keeps the fastest, remembers it."""
  device = training.place.first
  measured = {}
  for d in choice.candidates:
    step = training.step(stage, d)
    best = float("inf")
    try:
      copy = jax.tree_util.tree_map(jnp.copy, state)
      new, m = step(copy, batches)  # compiles if needed; the state copy is donated
      jax.block_until_ready(m)
      for _ in range(MEASURE_RUNS - 1):  # the fastest: one step's time is noisy
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
  per_rank = training.k // training.ranks
  degree, how, text = choose_stacking(per_rank, choice.fits, choice.predicted, measured)
  ChoiceCache(os.path.join(cache_dir, "choices.json")).put(
      training.c.graph_fingerprint, device_name(device, training.ranks), degree, measured)
  return dataclasses.replace(choice, degree=degree, how=how, text=text, candidates=[])

"""The memory plan from compiled executables, before any initializer runs; stacking's choice.

The plan reads each executable's `memory_analysis()` (arguments, outputs,
temporaries, aliases), compiled for abstract inputs only, so nothing is
allocated to make it. Stacking (how many microbatches one call runs) is chosen
among the degrees that fit, as the seed's Devices page says.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Mapping, Sequence

from sexpgpu.errors import SxError

GiB = 1 << 30
RESERVE = 1 << 30  # kept free for the libraries (cuBLAS, cuDNN workspaces)
CLOSE = 0.05  # predictions within 5% are measured instead
# A measurement runs each close degree MEASURE_RUNS times (the first compiles): when
# that would take longer than MEASURE_BUDGET_S by the model, the model decides.
MEASURE_RUNS = 4
MEASURE_BUDGET_S = 60.0


def human(n: float) -> str:
  """Bytes as `2.7 GiB`, `64.0 MiB`, `12.0 KiB` or `512 B`."""
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.1f} {unit}"
  return f"{int(n)} B"


def tree_bytes(tree: Any) -> int:
  """Bytes of a pytree of arrays or ShapeDtypeStructs (nothing is allocated)."""
  import jax
  import numpy as np
  return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape")))


def state_parts(state: Mapping[str, Any], accumulators: int = 1) -> dict[str, int]:
  """The parts of a train state, for the plan's annotation.

  Args:
    state: the (abstract) train state, {"params", "opt", "step", "skipped"}.
    accumulators: f32 copies of the parameters alive as gradients and their
      running sum (1 when one call runs every microbatch, 2 when calls add up).

  Returns:
    {"parameters", "optimizer states", "gradients and accumulators"} in bytes.
  """
  import jax
  import numpy as np
  params = state["params"]
  f32_params = sum(int(np.prod(x.shape)) * 4 for x in jax.tree_util.tree_leaves(params))
  return {"parameters": tree_bytes(params), "optimizer states": tree_bytes(state.get("opt", {})),
          "gradients and accumulators": f32_params * accumulators}


@dataclasses.dataclass(frozen=True)
class ExecutableMemory:
  """One executable's memory_analysis, in bytes."""

  arguments: int
  outputs: int
  temporaries: int
  aliases: int
  code: int
  resident: int  # alive during the call but not among its arguments

  @property
  def total(self) -> int:
    """arguments + outputs + temporaries − aliases, plus what else is resident."""
    return self.arguments + self.outputs + self.temporaries - self.aliases + self.resident

  @property
  def live(self) -> int:
    """What the call allocates beyond its arguments: outputs + temporaries − aliases."""
    return self.outputs + self.temporaries - self.aliases


def executable_memory(compiled, resident: int = 0) -> ExecutableMemory:
  """The memory_analysis of a jax.stages.Compiled as an ExecutableMemory."""
  m = compiled.memory_analysis()
  g = lambda name: int(getattr(m, name, 0) or 0)
  return ExecutableMemory(g("argument_size_in_bytes"), g("output_size_in_bytes"),
                          g("temp_size_in_bytes"), g("alias_size_in_bytes"),
                          g("generated_code_size_in_bytes"), int(resident))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The most a run will hold at once on one device, and what it is made of.

  Attributes:
    total: bytes at the peak: the largest executable's total plus `outside`.
    free: bytes free on the device (or SEXPGPU_MEMORY).
    reserve: bytes kept free for the libraries.
    peak_at: the executable where it peaks.
    parts: parameters, optimizer states, gradients and accumulators,
      constants (generated code), largest live set, outside, in bytes.
    executables: name → ExecutableMemory.
  """

  total: int
  free: int
  reserve: int
  peak_at: str
  parts: dict[str, int]
  executables: dict[str, ExecutableMemory]

  @property
  def fits(self) -> bool:
    """True when the plan leaves the reserve free."""
    return self.total + self.reserve <= self.free

  def text(self) -> str:
    """The report line's value: `2.7 GiB of 78.8 GiB free`."""
    return f"{human(self.total)} of {human(self.free)} free"

  def parts_text(self) -> str:
    """The parts, largest first: `parameters 474.7 MiB, optimizer states 949.4 MiB, ...`."""
    return ", ".join(f"{k} {human(v)}" for k, v in self.parts.items()) + f", peak in {self.peak_at}"

  def annotation(self) -> dict:
    """The metrics annotation: bytes of the total, free, reserve, and each part."""
    return {"kind": "memory", "planned_bytes": self.total, "free_bytes": self.free,
            "reserve_bytes": self.reserve, "fits": self.fits, "peak_at": self.peak_at,
            "parts": dict(self.parts),
            "executables": {n: dataclasses.asdict(e) | {"total": e.total}
                            for n, e in self.executables.items()}}


def plan(executables: Mapping[str, Any], state_bytes: Mapping[str, int], extra_bytes: int,
         free_bytes: int, reserve: int = RESERVE,
         resident: Mapping[str, int] | None = None) -> Plan:
  """The memory plan: max over executables (arguments + outputs + temporaries − aliases) + outside.

  Args:
    executables: name → jax.stages.Compiled (or ExecutableMemory), compiled for
      abstract inputs, with the state donated to the train step.
    state_bytes: the parts that live between steps, for the annotation
      (state_parts' "parameters", "optimizer states", "gradients and
      accumulators"); they are already inside the executables' arguments.
    extra_bytes: what lives outside every executable: loader buffers on the
      device, a retained copy of the state while a checkpoint is written.
    free_bytes: the device's free memory (free_bytes_of).
    reserve: bytes kept free for the libraries (1 GiB).
    resident: name → bytes alive during that executable that are not among its
      arguments (the optimizer state and the running gradient sum while a
      stacked gradient call runs).

  Returns:
    The Plan.
  """
  resident = resident or {}
  mems = {n: e if isinstance(e, ExecutableMemory) else executable_memory(e, resident.get(n, 0))
          for n, e in executables.items()}
  if not mems:
    raise ValueError("plan() needs at least one executable")
  peak_at = max(mems, key=lambda n: mems[n].total)
  peak = mems[peak_at]
  parts = {k: int(v) for k, v in state_bytes.items()}
  parts["constants"] = max(e.code for e in mems.values())
  parts["largest live set"] = peak.live
  parts["outside the steps"] = int(extra_bytes)
  return Plan(peak.total + int(extra_bytes), int(free_bytes), int(reserve), peak_at, parts, mems)


def reserve_for(device) -> int:
  """Bytes the plan keeps free: 1 GiB on a GPU for the libraries, none on the cpu."""
  return 0 if getattr(device, "platform", "cpu") == "cpu" else RESERVE


def outside_bytes(batch_bytes: int, state_total: int, buffered_batches: int = 2,
                  checkpoint_copy: bool = False) -> int:
  """What lives outside the executables: loader buffers and, when asked, a state copy.

  Args:
    batch_bytes: bytes of one step's batches on the device.
    state_total: bytes of the train state.
    buffered_batches: step batches the loader keeps on the device at once.
    checkpoint_copy: True when a copy of the state is retained while a
      checkpoint is written asynchronously.
  """
  return batch_bytes * buffered_batches + (state_total if checkpoint_copy else 0)


SHRINK = ("fewer microbatches per call (SEXPGPU_STACKING=1) or a smaller :batch",
          ":remat true on the repeated block", ":precision bf16", "fewer :layers")


def refuse(plan: Plan, knobs_hint: Sequence[str] | str = ()) -> SxError:
  """The E-MEM-001 error for a plan that does not fit (returned, for the caller to raise).

  Args:
    plan: the Plan that does not fit.
    knobs_hint: extra ways to shrink it that the caller knows of (a string or
      a list), named before the general ones.
  """
  hints = [knobs_hint] if isinstance(knobs_hint, str) else list(knobs_hint)
  short = plan.total + plan.reserve - plan.free
  err = SxError("E-MEM-001", f"the plan needs {human(plan.total)} on one device, plus "
                f"{human(plan.reserve)} kept for the libraries; {human(plan.free)} is free "
                f"({human(short)} short)", where=f"the memory plan (peak in {plan.peak_at})",
                fix="shrink it: " + "; ".join(hints + list(SHRINK)))
  err.with_note("parts", plan.parts_text())
  if os.environ.get("SEXPGPU_MEMORY"):
    err.with_note("free", f"SEXPGPU_MEMORY={os.environ['SEXPGPU_MEMORY']} plans against a "
                  "smaller card than the one present")
  return err


def free_bytes_of(device, memory_env: str | None) -> int:
  """The device's free memory: SEXPGPU_MEMORY when set, else what the device reports.

  Args:
    device: a jax Device.
    memory_env: SEXPGPU_MEMORY's value, or None.

  Returns:
    Bytes: SEXPGPU_MEMORY (on any device); else memory_stats' bytes_limit less
    bytes_in_use; else, on cpu, the machine's available memory.

  Raises:
    SxError: E-ENV-001 when SEXPGPU_MEMORY does not parse.
  """
  from sexpgpu.devices.env import parse_memory
  if memory_env not in (None, ""):
    return parse_memory(memory_env)
  stats = None
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return _host_available()


def _host_available() -> int:
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      info = {line.split(":")[0]: line.split()[1] for line in f}
    return int(info.get("MemAvailable", info["MemTotal"])) * 1024
  except (OSError, KeyError, IndexError, ValueError):
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_line(peak: int, plan: Plan) -> str:
  """`memory: peak 2.8 GiB of 2.7 GiB planned (+1.8%)`, the run's last memory line."""
  pct = (peak - plan.total) / max(plan.total, 1) * 100
  return f"memory: peak {human(peak)} of {human(plan.total)} planned ({pct:+.1f}%)"


# --- stacking -----------------------------------------------------------------

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


def choose_stacking(k_per_rank: int, fits: Mapping[int, bool], predicted: Mapping[int, float],
                    measured: Mapping[int, float] | None, remembered: int | None,
                    fixed: int | None, can_measure: bool = True,
                    why_not: str = "no room to measure") -> tuple[int, str, str]:
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
    remembered: the degree choices.json holds for this graph and device, or None.
    fixed: SEXPGPU_STACKING's degree, or None for auto.
    can_measure: whether a measurement is possible (a second state copy fits, and
      one node: several nodes would have to time their steps in lockstep). Close
      degrees whose measurement would outlast MEASURE_BUDGET_S are not measured
      either: a slow step (a large model on the CPU) is left to the model.
    why_not: why it is not, for the report line.

  Returns:
    (degree, how, text): how is one of "fixed", "only", "remembered", "model",
    "measured", "measure" (the caller must time `to_measure(...)` and call
    again with `measured`) or "none" (nothing fits: degree 0; raise refuse()).
    text is the stacking report line's value.

  Raises:
    SxError: E-ENV-001 when `fixed` does not divide k_per_rank.
  """
  if fixed is not None:
    if fixed < 1 or k_per_rank % fixed:
      raise SxError("E-ENV-001", f"SEXPGPU_STACKING={fixed} does not divide the {k_per_rank} "
                    "microbatches per rank", where="SEXPGPU_STACKING",
                    fix="use a divisor of :microbatches per rank, or auto")
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
  if can_measure and cost > MEASURE_BUDGET_S:
    can_measure, why_not = False, f"measuring would take about {cost:.0f} s"
  if not can_measure:
    return best, "model", f"{best}: the cost model, within 5% but {why_not} ({listing})"
  if not measured or any(d not in measured for d in close):
    return best, "measure", f"{best}: to be measured at the first step ({listing})"
  won = min(close, key=lambda d: (measured[d], -d))  # the fastest, as the seed's example
  detail = "; ".join(f"{d} {_ms(measured[d])}, model {_ms(preds[d])}" for d in close)
  return won, "measured", (f"{won}: measured at the first step, the model within 5% could not "
                           f"separate them ({detail})")


def cost_model(compiled, trips: int, device_rates: Mapping[str, float],
               outside: Any = None) -> float:
  """Predicted seconds of one call, from cost_analysis, the scan body times its trips.

  cost_analysis counts a lax.scan body once: the cost outside the loop (the
  `outside` executable's, e.g. the optimizer update, or none) is subtracted,
  the rest multiplied by `trips`, and the two added back.

  Args:
    compiled: a jax.stages.Compiled (or its cost_analysis dict).
    trips: the scan's trip count (the stacking degree).
    device_rates: {"flops": flop/s, "bytes": byte/s, "call": seconds per call}.
    outside: the cost (Compiled or dict) of the part outside the loop, or None.

  Returns:
    Seconds: call + max(flops / flop rate, bytes / byte rate) (a roofline).
  """
  def cost(c) -> tuple[float, float]:
    if c is None:
      return 0.0, 0.0
    d = c if isinstance(c, Mapping) else c.cost_analysis()
    if isinstance(d, (list, tuple)):
      d = d[0] if d else {}
    return float(d.get("flops", 0.0)), float(d.get("bytes accessed", 0.0))

  f_all, b_all = cost(compiled)
  f_out, b_out = cost(outside)
  f_out, b_out = min(f_out, f_all), min(b_out, b_all)
  flops = f_out + trips * (f_all - f_out)
  nbytes = b_out + trips * (b_all - b_out)
  return float(device_rates.get("call", 0.0)) + max(flops / device_rates["flops"],
                                                    nbytes / device_rates["bytes"])


def measure_rates(device, size: int | None = None) -> dict[str, float]:
  """The device's matmul flop/s, copy byte/s and per-call seconds, timed in ~a second."""
  import jax
  import jax.numpy as jnp
  n = size or (4096 if device.platform != "cpu" else 512)
  dt = jnp.bfloat16 if device.platform != "cpu" else jnp.float32
  with jax.default_device(device):
    a = jnp.ones((n, n), dt)
    v = jnp.ones((n * n * 4,), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    cp = jax.jit(lambda x: x * 2.0)
    tiny = jax.jit(lambda x: x + 1)
    s = jnp.float32(0)

    def best(fn, x, reps=5):
      fn(x).block_until_ready()
      times = []
      for _ in range(reps):
        t = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t)
      return min(times)

    t_mm, t_cp, t_call = best(mm, a), best(cp, v), best(tiny, s, 20)
  return {"flops": 2 * n ** 3 / max(t_mm, 1e-9), "bytes": 2 * v.nbytes / max(t_cp, 1e-9),
          "call": t_call}


class ChoiceCache:
  """`<cache>/choices.json`: measured stacking choices by (graph fingerprint, device)."""

  def __init__(self, path: str):
    """Args: path: the JSON file (usually os.path.join(cache_dir(), "choices.json"))."""
    self.path = path

  @staticmethod
  def key(fingerprint: str, device: str) -> str:
    """The entry's key: `<graph fingerprint>|<device kind or name>`."""
    return f"{fingerprint}|{device}"

  def _load(self) -> dict:
    try:
      with open(self.path, encoding="utf-8") as f:
        data = json.load(f)
      return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
      return {}

  def get(self, fingerprint: str, device: str) -> int | None:
    """The remembered degree, or None (also when the file is missing or unreadable)."""
    entry = self._load().get(self.key(fingerprint, device))
    try:
      return int(entry["degree"]) if entry else None
    except (KeyError, TypeError, ValueError):
      return None

  def put(self, fingerprint: str, device: str, degree: int,
          measured: Mapping[int, float] | None = None) -> None:
    """Remembers a measured choice; written beside the file then renamed (atomic)."""
    data = self._load()
    data[self.key(fingerprint, device)] = {
        "degree": int(degree), "measured_s": {str(k): v for k, v in (measured or {}).items()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    folder = os.path.dirname(os.path.abspath(self.path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".choices-", dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, self.path)

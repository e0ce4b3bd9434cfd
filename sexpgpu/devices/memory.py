"""The memory plan from compiled executables, before any initializer runs.

The plan reads each executable's `memory_analysis()` (arguments, outputs,
temporaries, aliases), compiled for abstract inputs only, so nothing is
allocated to make it. Which stacking degree among those that fit is chosen in
`sexpgpu.run.planning.plan`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from sexpgpu.errors import SxError

RESERVE = 1 << 30  # kept free for the libraries (cuBLAS, cuDNN workspaces)


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
  over: str = ""  # how the state is split, e.g. "fsdp over 8" ("" when replicated)

  @property
  def fits(self) -> bool:
    """True when the plan leaves the reserve free."""
    return self.total + self.reserve <= self.free

  def text(self) -> str:
    """The report line's value: `2.7 GiB of 78.8 GiB free`."""
    return f"{human(self.total)} of {human(self.free)} free" + (f" ({self.over})"
                                                                 if self.over else "")

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
         resident: Mapping[str, int] | None = None, over: str = "") -> Plan:
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
    over: how the state is split over devices ("fsdp over 8"), for the report.

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
  return Plan(peak.total + int(extra_bytes), int(free_bytes), int(reserve), peak_at, parts, mems,
              over)


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
  from sexpgpu.env import get as env_get
  if env_get("SEXPGPU_MEMORY"):
    err.with_note("free", f"SEXPGPU_MEMORY={env_get('SEXPGPU_MEMORY')} plans against a "
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
    SxError: E-ENV-001 when SEXPGPU_MEMORY does not parse; E-MEM-002 when a GPU reports
      no memory statistics (its memory is not the host's, and no plan is made against a
      guess).
  """
  from sexpgpu.env import parse_memory
  if memory_env not in (None, ""):
    return parse_memory(memory_env)
  stats = None
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if getattr(device, "platform", "cpu") != "cpu":
    kind = getattr(device, "device_kind", "") or getattr(device, "platform", "the device")
    raise SxError("E-MEM-002", f"{kind} (device {getattr(device, 'id', 0)}) reports no memory "
                  "statistics (no bytes_limit), so the memory plan has nothing to plan "
                  "against", where="the memory plan",
                  fix="set SEXPGPU_MEMORY to what the run may use of one GPU, e.g. "
                  "SEXPGPU_MEMORY=60GiB on an 80 GB card (XLA takes 75% of it by default, "
                  "XLA_PYTHON_CLIENT_MEM_FRACTION)")
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

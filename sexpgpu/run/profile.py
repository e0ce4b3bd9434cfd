"""`--profile A..B`: a jax.profiler trace of those steps, and the ops that took the most time."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

from sexpgpu.env import parse_step_range

TOP = 5


def parse_range(text: str, where: str) -> tuple[int, int]:
  """`A..B` (or `A`) as the steps (1-based, inclusive) to record (sexpgpu/env.py's parser).

  Raises:
    SxError: E-ENV-001 naming `where` (the flag or the variable) when it does not parse.
  """
  return parse_step_range(text, where)


def default_dir(slug: str, metrics: str | None) -> str:
  """`profile/<slug>/` beside the jsonl metrics file when there is one, else in the cwd."""
  base = "."
  for target in (metrics or "").split(","):
    kind, _, path = target.partition(":")
    if kind == "jsonl" and path and "://" not in path:
      base = os.path.dirname(os.path.abspath(path))
      break
  return os.path.join(base, "profile", slug)


class Profile:
  """Starts the trace before step A and stops it after step B (1-based, inclusive)."""

  def __init__(self, first: int, last: int, folder: str):
    self.first, self.last, self.folder = first, last, folder
    self.active = False
    self.done = False
    self.steps: tuple[int, int] | None = None

  def before(self, step: int) -> None:
    """Called before step `step` (1-based) is dispatched."""
    import jax
    if not self.active and not self.done and self.first <= step <= self.last:
      os.makedirs(self.folder, exist_ok=True)
      jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
      self.active, self.steps = True, (step, step)

  def after(self, step: int, sync) -> None:
    """Called once step `step`'s results are on the host (`sync` waits for the device)."""
    if self.active:
      self.steps = (self.steps[0], step)
      if step >= self.last:
        self.stop(sync)

  def stop(self, sync=None) -> None:
    """Ends the trace (at step B, or when the run stops before it)."""
    import jax
    if self.active:
      if sync is not None:
        sync()
      jax.profiler.stop_trace()
      self.active, self.done = False, True

  def line(self) -> str | None:
    """`profile: steps A..B in DIR; top: <op> 31%, …`, or None when nothing was recorded."""
    if self.steps is None:
      return None
    top = top_ops(self.folder)
    ops = ", ".join(f"{name} {share:.0%}" for name, share in top) or "no ops recorded"
    return f"profile: steps {self.steps[0]}..{self.steps[1]} in {self.folder}; top: {ops}"


def top_ops(folder: str, n: int = TOP) -> list[tuple[str, float]]:
  """The n ops with the most time in the newest trace under `folder`, with their shares.

  Ops are the trace's complete events on a device (`/device:…` processes) or, on
  the CPU, on XLA's own threads; runtime frames (`A::B`), Python frames (`$…`)
  and the profiler's markers are left out.
  """
  traces = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*",
                                         "perfetto_trace.json.gz")))
  if not traces:
    return []
  with gzip.open(traces[-1], "rt", encoding="utf-8") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e.get("pid")] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
  devices = {pid for pid, name in procs.items() if name.startswith("/device:")}

  def is_op(e) -> bool:
    name = e.get("name", "")
    if e.get("ph") != "X" or not name or "::" in name or name.startswith(("$", "end: ")):
      return False
    if devices:
      return e.get("pid") in devices
    return threads.get((e.get("pid"), e.get("tid")), "").startswith("tf_XLA")

  time_of: collections.Counter = collections.Counter()
  for e in events:
    if is_op(e):
      time_of[e["name"]] += float(e.get("dur", 0.0))
  total = sum(time_of.values())
  if total <= 0:
    return []
  return [(name, t / total) for name, t in time_of.most_common(n)]

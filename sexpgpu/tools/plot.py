"""`sexpgpu plot`: curves by step from jsonl metrics, one line per slug per metric.

Each metric gets its own panel. A metric is a `step` event field (`train/loss`,
`train/lr`, ...) or a `pass` event metric (`eval/loss`). Curriculum switches (`stage`
events) are dotted vertical lines, resumes (`checkpoint` events with action `restored`)
dashed ones. Where a resume retrains steps, the later values win. Curves carry
gid "curve", markers gid "stage" or "resume".

A metrics file is read through `sexpgpu.bounded` (a regular UTF-8 file of at most
METRICS_BYTES, lines of at most LINE_BYTES); a line that is no JSON object (the torn last
line of a live run, one nested past `bounded.DEPTH`) is skipped and counted, and an event
whose step or value is not a number is left out.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

from sexpgpu import bounded
from sexpgpu.errors import SxError

DEFAULT_METRICS = ("train/loss", "eval/loss")
# A metrics file is read line by line within these bounds: a run of a million steps writes
# a few hundred MiB; an event line is at most a few KiB (a sample's text, a config's knobs).
METRICS_BYTES = bounded.GiB
LINE_BYTES = 16 * bounded.MiB
# The most panels one figure draws (one a metric): each is 3.5 inches tall.
MAX_PANELS = 32


def read_events(paths: list[str], skipped: dict[str, list[int]] | None = None
                ) -> dict[str, list[dict]]:
  """Every event of the files, by slug, in file order.

  A line that is no JSON object (a torn last line a live run leaves, or one nested deeper
  than `bounded.DEPTH`) is skipped; its number is added to `skipped[path]` when given.

  Raises:
    SxError: E-METRICS-001 for a file that is missing, not a regular file (a FIFO,
      /dev/zero), not UTF-8, larger than METRICS_BYTES or with a line past LINE_BYTES.
  """
  by_slug: dict[str, list[dict]] = defaultdict(list)
  for path in paths:
    lines = bounded.read_lines(path, limit=METRICS_BYTES, line_limit=LINE_BYTES,
                               what="metrics file", code="E-METRICS-001", where=path,
                               fix="give the jsonl file a run wrote with --metrics jsonl:PATH")
    for number, line in lines:
      ev = _event(line)
      if ev is None:
        if line.strip() and skipped is not None:
          skipped.setdefault(path, []).append(number)
        continue
      by_slug[str(ev.get("slug", path))[:200]].append(ev)
  return dict(by_slug)


def _event(line: str) -> dict | None:
  """The line's JSON object, or None for anything else (json.loads recurses: a line of
  100,000 `[` is a RecursionError)."""
  try:
    ev = json.loads(line)
  except (ValueError, RecursionError):
    return None
  if not isinstance(ev, dict) or bounded.json_depth(ev) > bounded.DEPTH:
    return None
  return ev


def _step(ev: dict) -> int | None:
  """The event's step: an integer (or an integral float) within 64 bits, else None."""
  step = ev.get("step")
  if isinstance(step, bool) or not isinstance(step, (int, float)):
    return None
  if isinstance(step, float) and not (math.isfinite(step) and step == int(step)):
    return None
  return int(step) if abs(step) < 2**63 else None


def _value(v) -> float | None:
  """A plotted value: a number (NaN kept, as a gap), not an infinity matplotlib cannot scale."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    return None
  try:
    v = float(v)
  except OverflowError:  # an integer past a float
    return None
  return None if math.isinf(v) else v


def series(events: list[dict], metric: str) -> tuple[list[int], list[float]]:
  """(steps, values) of one metric, sorted by step, the last value of a step kept; an
  event whose step or value is not a number is left out."""
  points: dict[int, float] = {}
  for ev in events:
    step = _step(ev)
    if step is None:
      continue
    got = ev.get("metrics") if ev.get("kind") == "pass" else ev
    value = _value(got.get(metric)) if ev.get("kind") in ("step", "pass") and isinstance(
        got, dict) else None
    if value is not None:
      points[step] = value
  steps = sorted(points)
  return steps, [points[s] for s in steps]


def markers(events: list[dict]) -> list[tuple[str, int]]:
  """("stage" | "resume", step) for every curriculum switch and resume."""
  out = []
  for ev in events:
    step = _step(ev)
    if step is None:
      continue
    if ev.get("kind") == "stage":
      out.append(("stage", step))
    elif ev.get("kind") == "checkpoint" and ev.get("action") == "restored":
      out.append(("resume", step))
  return out


def plot(paths: list[str], metrics: list[str] | tuple[str, ...] = DEFAULT_METRICS,
         out: str | None = None, width: float = 10.0, panel_height: float = 3.5,
         dpi: int = 100, skipped: dict[str, list[int]] | None = None):
  """Draws the curves and returns the matplotlib Figure (saved as PNG when `out` is given).

  The figure is made without pyplot, so it works under any backend (Agg in the CLI, inline
  in a notebook). Its size is width × (panel_height × number of metrics) inches at `dpi`.
  The PNG replaces `out` whole (a file that was there stays as it was when drawing fails).

  Args:
    skipped: filled with each file's lines that are no JSON object (`read_events`).

  Raises:
    SxError: E-METRICS-001 when a file cannot be read, no metric or more than MAX_PANELS
      are named, no metric has any value, or `out` cannot be written.
  """
  from matplotlib.figure import Figure
  metrics = [m for m in metrics if m]
  if not 1 <= len(metrics) <= MAX_PANELS:
    raise SxError("E-METRICS-001", f"{len(metrics)} metrics named; a figure draws 1 to "
                  f"{MAX_PANELS}, a panel each", where="--metric",
                  fix=f"name 1 to {MAX_PANELS} metrics: --metric train/loss,eval/loss")
  if out is not None:
    check_output_path(out)
  by_slug = read_events(paths, skipped)
  fig = Figure(figsize=(width, panel_height * len(metrics)), dpi=dpi)
  axes = fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
  drawn = 0
  for ax, metric in zip(axes, metrics):
    for slug, events in sorted(by_slug.items()):
      steps, values = series(events, metric)
      if not steps:
        continue
      drawn += 1
      if drawn > MAX_CURVES:
        raise SxError("E-METRICS-001", f"more than {MAX_CURVES} curves to draw (runs × "
                      f"metrics) from {len(by_slug)} runs in {', '.join(paths)[:200]}",
                      where="--metric", fix=f"plot at most {MAX_CURVES} curves: fewer files "
                      "or fewer metrics a figure")
      (line,) = ax.plot(steps, values, marker="o" if len(steps) < 12 else None,
                        markersize=3, label=slug)
      line.set_gid("curve")
      for what, step in markers(events):
        m = ax.axvline(step, color=line.get_color(), alpha=0.6, linewidth=1,
                       linestyle=":" if what == "stage" else "--")
        m.set_gid(what)
    ax.set_ylabel(metric[:80])
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize="small")
  if drawn == 0:
    raise SxError("E-METRICS-001", f"no values of {', '.join(metrics)[:200]} in "
                  f"{', '.join(paths)[:200]}", where="--metric",
                  fix="name a step field (train/loss) or a pass metric (eval/loss)")
  fig.tight_layout()
  if out:
    save_figure(fig, out)
  return fig


# The most curves one figure draws (runs × metrics); each keeps its own line and legend entry.
MAX_CURVES = 256


def check_output_path(out: str) -> None:
  """Refuses an output that is there and is no regular file (a folder, a FIFO that would
  wait for a reader, a device) before anything is drawn."""
  try:
    there = os.path.exists(out) and not os.path.isfile(out)
  except ValueError:  # a NUL in the name
    there = True
  if there:
    raise SxError("E-METRICS-001", f"the plot's output {out!r} is a folder, FIFO or device, "
                  "not a file", where="-o", fix="give -o a .png file path (curves.png)")


def save_figure(fig, out: str) -> None:
  """The figure as PNG, written beside `out` and renamed onto it."""
  import io
  from sexpgpu.paths import write_atomic
  png = io.BytesIO()
  fig.savefig(png, format="png")
  try:
    write_atomic(out, png.getvalue())
  except (OSError, ValueError) as e:
    why = getattr(e, "strerror", None) or str(e)
    raise SxError("E-METRICS-001", f"cannot write the plot to {out}: {why}", where="-o",
                  fix="give -o a path in a folder you can write") from None

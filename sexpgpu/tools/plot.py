"""`sexpgpu plot`: curves by step from jsonl metrics, one line per slug per metric.

Each metric gets its own panel. A metric is a `step` event field (`train/loss`,
`train/lr`, ...) or a `pass` event metric (`eval/loss`). Curriculum switches (`stage`
events) are dotted vertical lines, resumes (`checkpoint` events with action `restored`)
dashed ones. Where a resume retrains steps, the later values win. Curves carry
gid "curve", markers gid "stage" or "resume".
"""

from __future__ import annotations

import json
from collections import defaultdict

from sexpgpu.errors import SxError

DEFAULT_METRICS = ("train/loss", "eval/loss")


def read_events(paths: list[str]) -> dict[str, list[dict]]:
  """Every event of the files, by slug, in file order (a torn last line is skipped).

  Raises:
    SxError: E-METRICS-001 for a file that cannot be read.
  """
  by_slug: dict[str, list[dict]] = defaultdict(list)
  for path in paths:
    try:
      with open(path, "rb") as f:
        lines = f.read().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
      why = (f"cannot read metrics file {path}: {e.strerror}" if isinstance(e, OSError) else
             f"metrics file {path} is not text (byte {e.start} is no UTF-8)")
      raise SxError("E-METRICS-001", why, where=path,
                    fix="give the jsonl file a run wrote with --metrics jsonl:PATH") from None
    for line in lines:
      try:
        ev = json.loads(line)
      except ValueError:
        continue
      if isinstance(ev, dict):
        by_slug[str(ev.get("slug", path))].append(ev)
  return dict(by_slug)


def series(events: list[dict], metric: str) -> tuple[list[int], list[float]]:
  """(steps, values) of one metric, sorted by step, the last value of a step kept."""
  points: dict[int, float] = {}
  for ev in events:
    if "step" not in ev or ev.get("step") is None:
      continue
    if ev.get("kind") == "step" and isinstance(ev.get(metric), (int, float)):
      points[int(ev["step"])] = float(ev[metric])
    elif ev.get("kind") == "pass" and isinstance((ev.get("metrics") or {}).get(metric),
                                                 (int, float)):
      points[int(ev["step"])] = float(ev["metrics"][metric])
  steps = sorted(points)
  return steps, [points[s] for s in steps]


def markers(events: list[dict]) -> list[tuple[str, int]]:
  """("stage" | "resume", step) for every curriculum switch and resume."""
  out = []
  for ev in events:
    if ev.get("kind") == "stage" and ev.get("step") is not None:
      out.append(("stage", int(ev["step"])))
    elif (ev.get("kind") == "checkpoint" and ev.get("action") == "restored"
          and ev.get("step") is not None):
      out.append(("resume", int(ev["step"])))
  return out


def plot(paths: list[str], metrics: list[str] | tuple[str, ...] = DEFAULT_METRICS,
         out: str | None = None, width: float = 10.0, panel_height: float = 3.5,
         dpi: int = 100):
  """Draws the curves and returns the matplotlib Figure (saved as PNG when `out` is given).

  The figure is made without pyplot, so it works under any backend (Agg in the CLI, inline
  in a notebook). Its size is width × (panel_height × number of metrics) inches at `dpi`.

  Raises:
    SxError: E-METRICS-001 when a file cannot be read or no metric has any value.
  """
  from matplotlib.figure import Figure
  by_slug = read_events(paths)
  metrics = [m for m in metrics if m]
  fig = Figure(figsize=(width, panel_height * len(metrics)), dpi=dpi)
  axes = fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
  drawn = 0
  for ax, metric in zip(axes, metrics):
    for slug, events in sorted(by_slug.items()):
      steps, values = series(events, metric)
      if not steps:
        continue
      (line,) = ax.plot(steps, values, marker="o" if len(steps) < 12 else None,
                        markersize=3, label=slug)
      line.set_gid("curve")
      drawn += 1
      for what, step in markers(events):
        m = ax.axvline(step, color=line.get_color(), alpha=0.6, linewidth=1,
                       linestyle=":" if what == "stage" else "--")
        m.set_gid(what)
    ax.set_ylabel(metric)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize="small")
  if drawn == 0:
    raise SxError("E-METRICS-001", f"no values of {', '.join(metrics)} in "
                  f"{', '.join(paths)}", where="--metric",
                  fix="name a step field (train/loss) or a pass metric (eval/loss)")
  fig.tight_layout()
  if out:
    fig.savefig(out, format="png")
  return fig

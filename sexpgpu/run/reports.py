"""What a run reports besides its steps: the lowering and memory annotations, the stacking
choice, and the finishing lines (timing block, profile, the `memory: peak` line)."""

from __future__ import annotations

import time

from sexpgpu.devices.memory import peak_line as line_of
from sexpgpu.devices.report import lowering_annotation, lowering_report
from sexpgpu.run import output
from sexpgpu.run.planning import plan
from sexpgpu.run.compile import cache_dir
from sexpgpu.run.backend import peak_bytes


def annotate(ctx, choice) -> None:
  """The lowering, memory and stacking annotations of the run (a RunContext) and its
  stacking Choice; on a GPU the lowering report's lines."""
  c, training, place = ctx.c, ctx.training, ctx.place
  metrics, log = ctx.out.metrics, ctx.out.log
  compiled = next(iter(choice.executables.values()))
  regions = region_lines(c.regions, training.step(0, choice.degree).notes)
  ann = lowering_annotation(place.first, c.patterns, regions, compiled, choice.plan, choice.text)
  metrics.emit("annotation", name="lowering", text="\n".join(ann["lines"]),
               **{n: v for n, v in ann.items() if n not in ("kind", "lines")})
  metrics.emit("annotation", name="memory", text=choice.plan.text(), parts=choice.plan.parts,
               peak_at=choice.plan.peak_at, total=choice.plan.total, free=choice.plan.free)
  emit_stacking(choice, metrics)
  if place.first.platform != "cpu":
    for line in lowering_report(place.first, c.patterns, regions, compiled, choice.plan,
                                choice.text):
      log(line)


def emit_stacking(choice, metrics) -> None:
  """The stacking annotation: the degree, how it was chosen, each degree's plan and cost."""
  metrics.emit("annotation", name="stacking", text=choice.text, degree=choice.degree,
               how=choice.how, plans={str(d): t for d, t in choice.totals.items()},
               predicted={str(d): t for d, t in choice.predicted.items()})


def measured(choice, training, stage: int, state, batches, metrics):
  """The stacking chosen by timing each degree on the first step's batches, annotated."""
  choice = plan.measure(choice, training, stage, state, batches, cache_dir())
  emit_stacking(choice, metrics)
  return choice


def finish(ctx, counter, timings: dict, span: tuple[int, int], profile, choice) -> float:
  """The timing block, the profile line and the `memory: peak` line; returns the goodput.

  Args:
    ctx: the RunContext: its experiment (the graph's build time), placement, progress (step
      and pass times), and where the annotations and lines go.
    counter: the CompileCounter (kernels compiled, cache hits).
    timings: `begin`, when the run began (perf_counter); `open` and `step0` in seconds.
    span: the first step of this session minus one, and the last step trained.
    profile: the run's Profile, or None.
    choice: the run's stacking Choice (the memory plan).

  Returns:
    The share of the run's wall time spent in training steps, rounded to 4 places.
  """
  progress, metrics, log = ctx.out.progress, ctx.out.metrics, ctx.out.log
  t_begin = timings["begin"]
  seconds = {"graph": ctx.c.graph_seconds, "open": timings["open"], "step0": timings["step0"],
             "total": time.perf_counter() - t_begin}
  for line in output.timing_lines(progress, counter.snapshot(), seconds, span):
    log(line)
  if profile is not None and (line := profile.line()) is not None:
    log(line)
    metrics.emit("annotation", name="profile", text=line, folder=profile.folder)
  peak_line(ctx.place, choice, metrics, log)
  goodput = sum(progress.step_times) / max(time.perf_counter() - t_begin, 1e-9)
  return round(min(goodput, 1.0), 4)


def peak_line(place, choice, metrics, log) -> None:
  """On a GPU: `memory: peak X of Y planned (+Z%)`, the allocator's peak against the plan."""
  if place.first.platform == "cpu":
    return
  peak = peak_bytes(place.first)
  if peak is not None:
    line = line_of(peak, choice.plan)
    log(line)
    metrics.emit("annotation", name="memory peak", text=line, peak=peak,
                 planned=choice.plan.total)


def region_lines(regions, notes) -> list[tuple[str, str]]:
  """The lowering report's region lines: what each recognized region became."""
  out = []
  att = [r for r in regions if r.kind == "attention"]
  if att:
    n = sum(r.times for r in att)
    impls = sorted({nt["impl"] for nt in notes if nt.get("kind") == "attention"})
    whys = sorted({nt.get("why") for nt in notes if nt.get("kind") == "attention" and nt.get("why")})
    how = {"cudnn": "cudnn fused attention", "pallas": "Pallas flash attention",
           "xla": "XLA attention"}
    became = " + ".join(how[i] for i in impls) or "XLA attention"
    causal = "causal" if all(r.detail.startswith("causal") for r in att) else "mixed masks"
    if any("segment mask" in r.detail for r in att):
      causal += ", segment mask"
    text = f"{n} region{'s' if n != 1 else ''} → {became} ({causal})"
    if whys and "cudnn" not in impls:
      text += f": {'; '.join(whys)}"
    out.append(("attention", text))
  for r in regions:
    if r.kind == "cross-entropy":
      out.append(("cross-entropy", f"{r.times} region → chunked, {r.detail}"))
  return out

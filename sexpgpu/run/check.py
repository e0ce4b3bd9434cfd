"""`sexpgpu check`: compile without training and say what was built."""

from __future__ import annotations


from sexpgpu import env
from sexpgpu.ir.printer import print_graph
from sexpgpu.lang.select import format_value
from sexpgpu.run.compile import compile_file


def check(path: str, variant=None, sets=(), diagnostics=None, what: str | None = None,
          device: str = "cpu", overrides: dict | None = None, fn: str | None = None,
          target: str | None = None, gpu: str | None = None, devices: int | None = None,
          nodes: int | None = None) -> str:
  """The text `sexpgpu check` prints: a summary, or knobs / params / ir / jaxpr / hlo / plan
  / decode (how `sample` decodes `fn`, by default the one function of tokens to logits).

  With `target="cuda"` the summary (and `hlo`, `plan`) is the run's steps lowered for
  CUDA on this machine, reported as a CUDA run reports them (`run.cuda_check`); `gpu`
  names a card for a roofline estimate; `devices` (and `nodes`) plan a run of that many
  GPUs on paper (run.layout_plan).
  """
  if target is not None or gpu is not None or devices is not None or nodes is not None:
    from sexpgpu.run.cuda_check import check_paper, check_target
    check_target(target or "cuda", gpu)
    check_paper(target, devices, nodes)
  c = compile_file(path, variant, sets, overrides, diagnostics)
  if devices is not None:
    from sexpgpu.run.cuda_check import paper_text
    return paper_text(c, gpu, devices, nodes or 1)
  _stacking_divides(c)
  if (target is not None or gpu is not None) and what in (None, "hlo", "plan"):
    from sexpgpu.run.cuda_check import cuda_text
    return cuda_text(c, gpu, what)
  if what == "decode":
    from sexpgpu.models import decode, sample, source
    fn = fn or source.default_fn(c)
    w = sample.window(c, fn)
    return decode.explain(source.logits_graph(c, fn, w), w)
  if what in ("jaxpr", "hlo", "plan"):
    return lowered_text(c, what, device)
  if what == "knobs":
    return knobs_text(c)
  if what == "params":
    return params_text(c)
  if what == "ir":
    return c.ir_text() + "\n"
  lines = [f"check: {c.program.path} slug {c.slug} fingerprint {c.fingerprint}", "", "knobs:"]
  lines += ["  " + line for line in knobs_text(c).splitlines()]
  lines += ["", "parameters:"] + ["  " + line for line in params_text(c).splitlines()]
  lines += ["", "loaders:"]
  for name, ld in c.loaders.items():
    d = ld.describe()
    fields = " ".join(f":{k} {v}" for k, v in d["fields"].items())
    size = "endless" if d.get("records") is None else f"{d['records']} records"
    extra = (f" entropy rate {d['entropy_rate']:.5f} nats/token (the floor of the loss)"
             if "entropy_rate" in d else "")
    extra += f" ({d['summary']})" if "summary" in d else ""
    lines.append(f"  {name}: {d['kind']} {fields} {size}{extra}")
  lines += ["", "passes:"] + [
      f"  {n}: :data {p.data} :every {p.every if p.every is not None else '-'} "
      f":batches {p.batches} metrics {' '.join(f'{n}/{m}' for m, _ in p.metrics)}"
      for n, p in c.exp.passes.items()] or ["  -"]
  if c.exp.samples:
    from sexpgpu.run.sampling import Samplers
    lines += ["", "samples:"] + [  # built as run builds them: a bad prompt fails here too
        f"  {s.decl.name}: :fn {s.decl.fn} :every {s.decl.every} :tokens {s.decl.tokens} "
        f"{len(s.prompts)} prompts, {s.decoder.path} decoding"
        + (f" ({s.decoder.reason})" if s.decoder.reason else "")
        for s in Samplers(c).items]
  if c.exp.evals:
    from sexpgpu.run.evaluating import Evaluators
    # read, tokenized and laid out as run does: a bad task file fails here too
    lines += ["", "evals:"] + Evaluators(c).describe()
  if len(c.stages) > 1:
    lines += ["", "curriculum:"] + [f"  {s.index} {s.name}: :data {s.data}" for s in c.stages]
  return "\n".join(lines) + "\n"


def _stacking_divides(c) -> None:
  """Refuses SEXPGPU_STACKING that does not divide the microbatches each rank runs, as `run`
  refuses it, so `check` does not pass a file and its variables that `run` stops on."""
  from sexpgpu.run.env import stacking_from_env
  from sexpgpu.run.plan import check_fixed
  fixed = stacking_from_env()
  if fixed is not None:
    ranks = len(env.parse_device_list(env.get("SEXPGPU_DEVICES")) or [0])
    k = int(c.exp.run["microbatches"])
    if k % ranks == 0:  # else E-DP-003 is the mistake, said where the devices open
      check_fixed(fixed, k // ranks)


def lowered_text(c, what: str, device_kind: str) -> str:
  """The loss as a jaxpr, the train step's HLO, or the memory plan and cost analysis.

  Nothing is allocated: the step is lowered and compiled for abstract values only.
  """
  import jax

  from sexpgpu.ir.ops import LowerCtx
  from sexpgpu.lower.interp import run_graph
  from sexpgpu.run import plan
  from sexpgpu.run.compile import cache_dir
  from sexpgpu.run.devices import microbatches_divide, open_devices, parse_device_list
  from sexpgpu.run.env import stacking_from_env
  from sexpgpu.run.training import build
  run = c.exp.run
  k = int(run["microbatches"])
  if what == "jaxpr":
    graph = c.stages[0].graph
    abstract = build(c)
    params = abstract.abstract_state()["params"]
    batch = abstract.abstract_batches(c.stages[0].data)
    ctx = LowerCtx(str(run["precision"]))
    return str(jax.make_jaxpr(lambda p, b: run_graph(graph, p, b, ctx)["out"])(params, batch)) + "\n"
  place = open_devices(device_kind, parse_device_list(env.get("SEXPGPU_DEVICES")))
  microbatches_divide(k, place.ranks)
  # The run's own wiring: the same steps, pass steps and state that `run` plans.
  # `:sharding auto` is chosen here as `run` chooses it, before the steps are built
  from sexpgpu.run.layout_choice import resolve
  layout = resolve(c, place, cache_dir())
  training = build(c, place)
  state = training.abstract_state()
  batches = training.abstract_batches(c.stages[0].data, (k,))
  if what == "hlo":
    return training.step(0, k // place.ranks).lowered(state, batches).as_text() + "\n"
  choice = plan.choose(training, 0, stacking_from_env(), state, batches, place.first, False,
                       cache_dir())
  ranks = f" x{place.ranks}" if place.ranks > 1 else ""
  lines = [f"plan: {c.slug} on {place.first.platform}{ranks}",
           f"  memory      {choice.plan.text()} (peak in {choice.plan.peak_at})"]
  lines += [f"    {name:<26} {_bytes(v)}" for name, v in choice.plan.parts.items()]
  if layout is not None:
    lines += layout.lines()
  if training.sharding != "replicate":
    whole = training.replicated()
    lines.append(f"  sharding    {training.sharding} over {training.split_over()}; replicated: "
                 + (", ".join(whole) if whole else "none"))
    lines += ["  specs"] + plan.spec_lines(training)  # each split parameter's PartitionSpec
    lines += ["  collectives"] + plan.collective_lines(choice.executables)
  lines.append(f"  stacking    {choice.text}")
  for d, total in sorted(choice.totals.items(), reverse=True):
    pred = choice.predicted.get(d)
    lines.append(f"    degree {d:<3} plan {_bytes(total)}"
                 + (f", model {pred * 1e3:.1f} ms a step" if pred is not None else ""))
  cost = next(iter(choice.executables.values())).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  lines.append(f"  cost        {cost.get('flops', 0):.3g} flops, "
               f"{cost.get('bytes accessed', 0):.3g} bytes accessed "
               "(XLA's count: a scan body once)")
  return "\n".join(lines) + "\n"


def _bytes(n: float) -> str:
  from sexpgpu.devices.memory import human
  return human(n)


def knobs_text(c) -> str:
  rows = [(k, format_value(v.value), v.source) for k, v in sorted(c.selection.knobs.items())]
  w = max(len(r[0]) for r in rows)
  v = max(len(r[1]) for r in rows)
  return "\n".join(f"{k:<{w}}  {val:<{v}}  {src}" for k, val, src in rows) + "\n"


def params_text(c) -> str:
  rows = [(p.path, f"{p.dtype}[{','.join(map(str, p.full_shape))}]", str(p.init), p.count)
          for p in c.params.values()]
  total = sum(r[3] for r in rows)
  w0 = max([len(r[0]) for r in rows] + [5])
  w1 = max([len(r[1]) for r in rows] + [5])
  w2 = max([len(r[2]) for r in rows] + [4])
  out = [f"{'path':<{w0}}  {'shape':<{w1}}  {'init':<{w2}}  {'count':>12}"]
  out += [f"{a:<{w0}}  {b:<{w1}}  {c_:<{w2}}  {n:>12,}" for a, b, c_, n in rows]
  out.append(f"{'total':<{w0}}  {'':<{w1}}  {'':<{w2}}  {total:>12,}")
  return "\n".join(out) + "\n"

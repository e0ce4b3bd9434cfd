"""`sexpgpu check`: compile without training and say what was built."""

from __future__ import annotations

import dataclasses

from sexpgpu import env
from sexpgpu.lang.select import format_value
from sexpgpu.run.compile import compile_file


@dataclasses.dataclass(frozen=True)
class CheckOptions:
  """What `sexpgpu check` was asked besides the file, its selection and `--print`."""

  diagnostics: str | None = None  # --diagnostics
  overrides: dict | None = None  # --steps, --eval-every
  device: str = "cpu"  # the device whose lowering jaxpr, hlo and plan show
  fn: str | None = None  # --fn: the function `--print decode` explains
  loader: str | None = None  # --loader: the loader `--print batch` draws from
  target: str | None = None  # --target cuda
  gpu: str | None = None  # --gpu: a card for a roofline estimate
  devices: int | None = None  # --devices (and --nodes): a plan on paper
  nodes: int | None = None


def check(path: str, variant=None, sets=(), what: str | None = None,
          opts: CheckOptions = CheckOptions()) -> str:
  """The text `sexpgpu check` prints: a summary, or knobs / params / ir / jaxpr / hlo / plan
  / decode (how `sample` decodes `opts.fn`, by default the one function of tokens to
  logits) / batch (one microbatch of `opts.loader`, by default the run's, run.batchtext).

  With `target="cuda"` the summary (and `hlo`, `plan`) is the run's steps lowered for
  CUDA on this machine, reported as a CUDA run reports them (`run.cuda_check`); `gpu`
  names a card for a roofline estimate; `devices` (and `nodes`) plan a run of that many
  GPUs on paper (run.layout_plan). `requires` lists the files it reads and runs nothing.
  """
  target, gpu, devices, nodes = opts.target, opts.gpu, opts.devices, opts.nodes
  fn, loader = opts.fn, opts.loader
  if what == "requires":
    return requires_text(path)
  if loader is not None and what != "batch":
    from sexpgpu.errors import SxError
    raise SxError("E-FORM-001", f"--loader {loader} names the loader of --print batch",
                  where=f"--loader {loader}", fix=f"add --print batch: check FILE --print batch "
                  f"--loader {loader}")
  if target is not None or gpu is not None or devices is not None or nodes is not None:
    from sexpgpu.run.cuda_check import check_paper, check_target
    check_target(target or "cuda", gpu)
    check_paper(target, devices, nodes)
  c = compile_file(path, variant, sets, opts.overrides, opts.diagnostics)
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
    return lowered_text(c, what, opts.device)
  if what == "knobs":
    return knobs_text(c)
  if what == "batch":
    from sexpgpu.run.batchtext import batch_text
    return batch_text(c, loader)
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


def requires_text(path: str) -> str:
  """`check --print requires`: every file the experiment reads (itself, its `.sx` and `.py`
  requires, the standard library's), each with its sha256 and whether it runs Python.

  The program is read, never evaluated: listing runs none of its Python.
  """
  import os

  from sexpgpu.front import pyops
  from sexpgpu.lang.program import STD_DIR, load_program
  program = load_program(path)
  trusted = pyops.policy().mode == pyops.ALL
  rows = []
  for i, (display, abspath) in enumerate(program.files.items()):
    runs, kind = "no", "sx"
    if display in program.python:
      kind = "python"
      if trusted:
        runs = "yes (--trust-python)"
      elif pyops.inside(abspath, program.base_dir):
        runs = "by run; check, bundle: with --trust-python"
      else:
        runs = "only with --trust-python (outside the experiment's folder)"
    elif i == 0:
      kind = "experiment"
    elif pyops.inside(abspath, STD_DIR) or display.startswith("std/"):
      kind = "std"
    rows.append((display, kind, pyops.sha256_text(program.sources[display]), runs))
  w0 = max(len(r[0]) for r in rows + [("file",)])
  w1 = max(len(r[1]) for r in rows)
  lines = [f"requires: {path} reads {len(rows)} files; nothing ran to list them",
           f"  {'file':<{w0}}  {'kind':<{w1}}  {'sha256':<64}  runs Python"]
  lines += [f"  {a:<{w0}}  {b:<{w1}}  {h}  {r}" for a, b, h, r in rows]
  if program.python:
    lines += ["", f"{len(program.python)} Python file(s) run at compile time with your rights "
              f"(folder of the experiment: {os.path.realpath(program.base_dir)}); read them "
              "before --trust-python or SEXPGPU_TRUST_PYTHON=1"]
  return "\n".join(lines) + "\n"


def _stacking_divides(c) -> None:
  """Refuses SEXPGPU_STACKING that does not divide the microbatches each rank runs, as `run`
  refuses it, so `check` does not pass a file and its variables that `run` stops on."""
  from sexpgpu.run.flags import stacking_from_env
  from sexpgpu.run.planning.plan import check_fixed
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
  from sexpgpu.lower import fp8
  from sexpgpu.lower.interp import run_graph
  from sexpgpu.run.planning import plan
  from sexpgpu.run.compile import cache_dir
  from sexpgpu.run.backend import microbatches_divide, open_devices, parse_device_list
  from sexpgpu.run.flags import stacking_from_env
  from sexpgpu.run.training import build
  run = c.exp.run
  k = int(run["microbatches"])
  if what == "jaxpr":
    graph = c.stages[0].graph
    abstract = build(c)
    params = abstract.abstract_state()["params"]
    batch = abstract.abstract_batches(c.stages[0].data)
    ctx = LowerCtx(str(run["precision"]), fp8_only=fp8.patterns(run))
    return str(jax.make_jaxpr(lambda p, b: run_graph(graph, p, b, ctx)["out"])(params, batch)) + "\n"
  place = open_devices(device_kind, parse_device_list(env.get("SEXPGPU_DEVICES")))
  microbatches_divide(k, place.ranks)
  # The run's own wiring: the same steps, pass steps and state that `run` plans.
  # `:sharding auto` is chosen here as `run` chooses it, before the steps are built
  from sexpgpu.run.planning.layout_choice import resolve
  layout = resolve(c, place, cache_dir())
  training = build(c, place)
  state = training.abstract_state()
  batches = training.abstract_batches(c.stages[0].data, (k,))
  if what == "hlo":
    return training.step(0, k // place.ranks).lowered(state, batches).as_text() + "\n"
  choice = plan.choose(training, 0, stacking_from_env(), state, batches,
                       plan.Setting(cache_dir()))
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
  """`check --print params`: each parameter's path, shape, initializer and count, and its
  role read from the loss graph (`ir.roles`): the stacked axes (repeat's layers, experts)
  apart from its own, fan-in → fan-out, whether the optimizer's weight decay reaches it and
  which optimizer updates it (an `opt` column where the optimizer splits them: Muon's), and
  a `train` column (trained, frozen, or a `(reference X)`'s copy) under `:trainable`, `:lora`
  or a reference, the decay `-` for one not trained; under μP each
  parameter's init-std, learning-rate and output multipliers (ir/mup.py).
  """
  from sexpgpu.ir.reference import is_reference
  from sexpgpu.ir.roles import roles
  from sexpgpu.lower.optim import decay_mask, mup_cells, optimizer_of
  from sexpgpu.run.training import trainable
  train = trainable(c)
  graph, spec = c.stages[0].graph, c.stages[0].exp.optimizer
  found = roles(graph)
  mask = decay_mask(spec, graph)
  opts = optimizer_of(spec, graph)
  split = len(set(opts.values())) > 1 or spec.name == "muon"
  mu = mup_cells(spec, graph)  # under μP: (each parameter's multipliers, their heads, a line)
  rows = []
  for p in c.params.values():
    r = found[p.path]
    fans = f"{r.fan_in}→{r.fan_out}" if r.fan_in or r.fan_out else "-"
    rows.append((p.path, f"{p.dtype}[{','.join(map(str, p.full_shape))}]", str(p.init),
                 p.count, r.text(), r.stacked_text(p), fans,
                 # a frozen parameter is not the optimizer's: its decay does not apply
                 "-" if train is not None and p.path not in train
                 else "yes" if mask.get(p.path) else "no") + (opts[p.path],) * split
                + ("trained" if p.path in (train or ()) else "reference" if is_reference(p.path)
                   else "frozen",) * (train is not None)
                + (mu[0][p.path] if mu else ()))
  total = sum(r[3] for r in rows)
  head = ("path", "shape", "init", "count", "role", "stacked", "fan-in→out",
          "decay") + ("opt",) * split + ("train",) * (train is not None) + (mu[1] if mu else ())
  w = [max([len(r[i]) for r in rows] + [len(head[i])]) if i != 3 else 12
       for i in range(len(head))]

  def line(r):
    cells = [f"{r[0]:<{w[0]}}", f"{r[1]:<{w[1]}}", f"{r[2]:<{w[2]}}",
             f"{r[3]:>12,}" if isinstance(r[3], int) else f"{r[3]:>12}"]
    return "  ".join(cells + [f"{x:<{w[i]}}" for i, x in enumerate(r[4:], 4)]).rstrip()

  out = [line(head)] + [line(r) for r in rows]
  out.append(f"{'total':<{w[0]}}  {'':<{w[1]}}  {'':<{w[2]}}  {total:>12,}")
  wd = float(spec.get("weight-decay", 0.0))
  n = sum(1 for r in rows if r[7] == "yes")
  out.append(f"decay: {spec.name} :weight-decay {wd:g} reaches {n} of {len(rows)} parameters"
             if wd > 0 else f"decay: {spec.name} :weight-decay 0, so none is decayed (the "
             f"column says which {n} a weight decay would reach)")
  if train is not None:
    t = [r for r in rows if "trained" in r[8:]]
    refs = sum(1 for r in rows if "reference" in r[8:])
    out.append(f"train: {len(t)} of {len(rows)} parameters trained ({sum(r[3] for r in t):,} "
               f"of {total:,} values), the rest frozen: constants of the step"
               + (f" ({refs} of them the reference's copies of the starting values, not "
                  "saved in checkpoints)" if refs else ""))
  if split:
    m = sum(1 for r in rows if r[8] == "muon")
    out.append(f"opt: muon orthogonalises {m} of {len(rows)} parameters (each stacked "
               f"matrix on its own), adamw updates the other {len(rows) - m}")
  out += [mu[2]] if mu else []
  return "\n".join(out) + "\n"

"""`sexpgpu coord-check`: the coordinate check of μP (Yang et al. 2022, Tensor Programs V,
§ "coordinate check"): for each width, the first steps on one fixed batch, each layer's mean
absolute activation at each step; under μP the lines are flat in the width, under the
standard parametrization they grow.

The width is set through a knob (`--knob`; by default the first of `width`, `d-model`,
`d_model`, `dim`, `hidden`, `n-embd` the file declares). A layer is what the loss graph
computes outside its bodies and between them: the input of each `repeat` (the embedding),
each of its layers' outputs (the repeat unrolled here, one layer at a time), and the
logits the loss reads; a graph without a `repeat` has each parameter's product at the top
level instead. Each run compiles the file with `:parametrization` set as asked (`standard`:
μP taken out; `mup`: with `--base-width`, by default the file's or the smallest width),
trains with its own optimizer (no dropout: the steps are deterministic) and records the
activations of the forward pass before each update.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.reader import Atom, Keyword, Symbol

WIDTH_KNOBS = ("width", "d-model", "d_model", "dim", "hidden", "n-embd")
CHOICES = ("both", "standard", "mup")
_LOGITS = ("cross-entropy", "log-softmax")


@dataclasses.dataclass
class Options:
  """What one coordinate check runs: the file, the widths, the steps and the selection."""

  file: str
  widths: list[int]
  steps: int = 5
  knob: str | None = None
  parametrization: str = "both"
  base_width: int | None = None
  variant: str | None = None
  sets: list = dataclasses.field(default_factory=list)
  output: str | None = None


def parse_widths(text: str) -> list[int]:
  """`64,128,256` as [64, 128, 256].

  Raises:
    SxError: E-KNOB-002 for anything but two or more distinct positive integers.
  """
  parts = [p.strip() for p in str(text).split(",") if p.strip()]
  try:
    widths = [int(p, 10) for p in parts]
  except ValueError:
    widths = []
  if len(widths) < 2 or len(set(widths)) != len(widths) or min(widths) < 1:
    raise SxError("E-KNOB-002", f"--widths {text} is not two or more distinct positive "
                  "integers", where="--widths",
                  fix="--widths 64,128,256,512 (each a value of the width knob)")
  return sorted(widths)


def width_knob(program, knob: str | None) -> str:
  """The knob that sets the width: `knob`, or the first of WIDTH_KNOBS the file declares.

  Raises:
    SxError: E-KNOB-001 when it is not a knob of the file (the nearest named).
  """
  names = sorted(program.knobs)
  if knob is None:
    found = [k for k in WIDTH_KNOBS if k in program.knobs]
    if found:
      return found[0]
    raise SxError("E-KNOB-001", f"{program.path} declares none of the knobs coord-check "
                  f"takes for the width ({', '.join(WIDTH_KNOBS)})", where="--knob",
                  fix="name the knob that sets the model's width: --knob NAME (knobs: "
                  + (", ".join(names) or "none; declare one with defknob") + ")")
  if knob not in program.knobs:
    raise SxError("E-KNOB-001", f"--knob {knob} is not a knob of {program.path}",
                  where="--knob", fix=(did_you_mean(knob, names) + " " if did_you_mean(
                      knob, names) else "") + "knobs: " + (", ".join(names) or "none"))
  return knob


def check_output(out: str) -> None:
  """Refuses an -o that is no file or lies in no folder (E-METRICS-001, as `plot` does)."""
  import os
  from sexpgpu.tools.plot import check_output_path
  check_output_path(out)
  folder = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(folder):
    raise SxError("E-METRICS-001", f"the coordinate check's figure {out}: its folder "
                  f"{folder} does not exist", where="-o",
                  fix="create the folder first, or give -o coord.png (the current folder)")


def _with_parametrization(program, name: str, base: int | None):
  """The program with defrun's `:parametrization` (and `:base-width`) replaced."""
  old = list(program.run.items)
  items = old[:1]
  i = 1
  while i < len(old):
    f = old[i]
    if (isinstance(f, Atom) and isinstance(f.value, Keyword) and str(f.value) in
        ("parametrization", "base-width") and i + 1 < len(old)):
      i += 2
      continue
    items.append(f)
    i += 1
  loc = program.run.loc
  items += [Atom(loc, Keyword("parametrization")), Atom(loc, Symbol(name))]
  if name == "mup":
    items += [Atom(loc, Keyword("base-width")), Atom(loc, int(base))]
  run = dataclasses.replace(program.run, items=tuple(items))
  # the evaluator reads each top-level form from `forms` (defrun among them), `run` is the same
  return dataclasses.replace(program, run=run, forms=[
      run if f is program.run else f for f in program.forms])


def _file_base(program) -> int | None:
  items = program.run.items
  for f, v in zip(items, items[1:]):
    if isinstance(f, Atom) and str(f.value) == "base-width" and isinstance(f.value, Keyword):
      if isinstance(v, Atom) and isinstance(v.value, int) and not isinstance(v.value, bool):
        return v.value
  return None


def _batch(c) -> dict:
  """The first batch of the run's loader, cut to the loss graph's input shapes."""
  graph = c.stages[0].graph
  raw = c.loaders[c.exp.data].batch(0)
  out = {}
  for name, node in graph.inputs.items():
    x = np.asarray(raw[name])
    out[name] = x[tuple(slice(0, d) for d in node.shape)] if x.shape != node.shape else x
  return out


def _layers(graph):
  """The layers the check records: (name, node) outside bodies, and the repeats to unroll."""
  nodes = list(graph.nodes())
  repeats = [n for n in nodes if n.op == "repeat"]
  named: list[tuple[str, object]] = []
  for k, r in enumerate(repeats):
    named.append((f"repeat{k} in" if len(repeats) > 1 else "embedding", r.inputs[0]))
  if not repeats:
    for n in nodes:
      if n.op in ("matmul", "einsum", "conv"):
        path = next((i.attr("path") for i in n.inputs if getattr(i, "op", "") == "param"), None)
        if path:
          named.append((path.rsplit("/", 1)[0], n))
  for n in nodes:
    if n.op in _LOGITS:  # the logits a loss reads, at the top level
      named.append(("logits", n.inputs[0]))
      break
  return named, repeats


def _measure(c, batch: dict, steps: int) -> dict[str, list[float]]:
  """Each layer's mean |activation| at steps 0..steps-1 of training `c` on `batch`."""
  import jax
  import jax.numpy as jnp
  import optax

  from sexpgpu.ir.opdef import LowerCtx
  from sexpgpu.lower.init import init_params
  from sexpgpu.lower.interp import NOT_HANDLED, evaluate, run_graph, run_layer, split_params
  from sexpgpu.lower.optim import make_optimizer
  graph = c.stages[0].graph
  named, repeats = _layers(graph)
  ctx = LowerCtx(training=False)
  inputs = {k: jnp.asarray(v) for k, v in batch.items()}
  (out_name,) = list(graph.outputs)[:1]

  def acts(params):
    found: dict[str, jax.Array] = {}

    def rule(node, env):
      if node.op != "repeat":
        return NOT_HANDLED
      stacked, outer = split_params(node, params)
      y = env[node.inputs[0].uid]
      k = repeats.index(node)
      for i in range(node.attr("n")):
        y = run_layer(node, env, y, {**outer, **{p: v[i] for p, v in stacked.items()}},
                      inputs, ctx)
        found[f"{'repeat%d ' % k if len(repeats) > 1 else ''}block {i + 1}"] = y
      return y

    env: dict = {}
    evaluate([n for _, n in named] + list(graph.outputs.values()), env, params, inputs, ctx,
             rule=rule)
    values = {name: env[n.uid] for name, n in named if name != "logits"}
    values.update(found)
    values.update({name: env[n.uid] for name, n in named if name == "logits"})
    return {k: jnp.mean(jnp.abs(v.astype(jnp.float32))) for k, v in values.items()}

  opt, _ = make_optimizer(c.exp.optimizer, int(c.exp.run["steps"]) or steps, graph)
  loss = lambda p: run_graph(graph, p, inputs, ctx)[out_name].astype(jnp.float32)

  @jax.jit
  def step(params, state):  # one compile a width: the activations, then the update
    grads = jax.grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    return acts(params), optax.apply_updates(params, updates), state

  params = init_params(int(c.exp.run["seed"]), c.params)
  state = opt.init(params)
  out: dict[str, list[float]] = {}
  for _ in range(steps):
    measured, params, state = step(params, state)
    for k in sorted(measured, key=_order):  # a jitted dict comes back in sorted keys
      out.setdefault(k, []).append(float(measured[k]))
  return out


def _order(name: str):
  """Layers from the input to the logits: a repeat's input, its blocks, products, logits."""
  if name == "logits":
    return (3, 0, 0, name)
  if name == "embedding" or name.endswith(" in"):
    return (0, int(name[6:-3]) if name.startswith("repeat") else 0, -1, name)
  if "block " in name:
    k = int(name.split()[0][6:]) if name.startswith("repeat") else 0
    return (0, k, int(name.rsplit(" ", 1)[1]), name)
  return (2, 0, 0, name)


def coord_check(opts: Options) -> dict:
  """Runs the check; returns {"knob", "widths", "steps", "base_width", "runs": {param:
  {layer: [[value at step t for each t] for each width]}}}.

  Raises:
    SxError: E-KNOB-001/002 (the knob, --widths), E-FORM-001 (--parametrization, --steps),
      and any compile error of the file at a width.
  """
  import warnings

  from sexpgpu.ir.mup import MupWarning
  from sexpgpu.lang.program import load_program
  from sexpgpu.run.compile import compile_file
  if opts.parametrization not in CHOICES:
    raise SxError("E-FORM-001", f"--parametrization {opts.parametrization} is not one of "
                  f"{', '.join(CHOICES)}", where="--parametrization",
                  fix=(did_you_mean(opts.parametrization, CHOICES) or "") +
                  " --parametrization both draws the file under standard and under μP")
  if not 1 <= opts.steps <= 1000:
    raise SxError("E-FORM-001", f"--steps {opts.steps} is outside 1..1000", where="--steps",
                  fix="--steps 5: the check is about the first few steps")
  if opts.output is not None:  # refused before minutes of compiles, not after
    check_output(opts.output)
  program = load_program(opts.file)
  knob = width_knob(program, opts.knob)
  base = opts.base_width or _file_base(program) or min(opts.widths)
  kinds = ["standard", "mup"] if opts.parametrization == "both" else [opts.parametrization]
  runs: dict[str, dict[str, list[list[float]]]] = {}
  for kind in kinds:
    prog = _with_parametrization(program, kind, base)
    layers: dict[str, list[list[float]]] = {}
    for w in opts.widths:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", MupWarning)  # said once, by check --print params
        c = compile_file(opts.file, opts.variant, list(opts.sets) + [(knob, str(w))],
                         program=prog)
      for name, values in _measure(c, _batch(c), opts.steps).items():
        layers.setdefault(name, []).append(values)
    runs[kind] = layers
  return {"file": opts.file, "knob": knob, "widths": list(opts.widths), "steps": opts.steps,
          "base_width": base, "runs": runs}


def plot(result: dict, out: str) -> None:
  """Writes the check's figure: a row per parametrization, a panel per step, each layer's
  mean |activation| against the width (log-log).

  Raises:
    SxError: E-METRICS-001 when `out` cannot be written.
  """
  from sexpgpu.tools.plot import save_figure
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  kinds = list(result["runs"])
  steps = result["steps"]
  fig, axes = plt.subplots(len(kinds), steps, figsize=(3 * steps, 2.8 * len(kinds)),
                           squeeze=False, sharex=True)
  for row, kind in enumerate(kinds):
    for t in range(steps):
      ax = axes[row][t]
      for layer, per_width in result["runs"][kind].items():
        ax.plot(result["widths"], [v[t] for v in per_width], marker="o", label=layer)
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_title(f"{kind} step {t}", fontsize=9)
      if t == 0:
        ax.set_ylabel("mean |activation|")
      if row == len(kinds) - 1:
        ax.set_xlabel(result["knob"])
  axes[0][-1].legend(fontsize=7, loc="best")
  fig.suptitle(f"coordinate check: {result['file']} (base width {result['base_width']})")
  fig.tight_layout()
  try:  # as `sexpgpu plot` writes its figure: atomically, a bad -o an E-METRICS-001
    save_figure(fig, out)
  finally:
    plt.close(fig)


def table(result: dict) -> str:
  """The last step's numbers as text: each layer's value at each width, and its spread
  (largest over smallest across the widths)."""
  lines = []
  last = result["steps"] - 1
  for kind, layers in result["runs"].items():
    lines.append(f"{kind}: step {last}, mean |activation| at {result['knob']} "
                 + " ".join(map(str, result["widths"])))
    for layer, per_width in layers.items():
      vals = [v[last] for v in per_width]
      spread = max(vals) / min(vals) if min(vals) > 0 else float("inf")
      lines.append(f"  {layer:<16} " + " ".join(f"{v:.4g}" for v in vals)
                   + f"  (×{spread:.3g} across widths)")
  return "\n".join(lines) + "\n"


def to_json(result: dict) -> str:
  """The check as one JSON object (coord_check's)."""
  return json.dumps(result)

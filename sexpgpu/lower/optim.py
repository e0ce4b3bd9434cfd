"""Optimizers and schedules: the experiment's Specs as optax transformations."""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from sexpgpu.errors import SxError
from sexpgpu.ir import roles
from sexpgpu.ir import mup
from sexpgpu.ir.graph import Graph, Init
from sexpgpu.front.optimizers import KEYWORDS, OPTIMIZERS, SCHEDULES, names_text
from sexpgpu.front.values import Spec


def rate(value: Any, steps: int, where) -> tuple[dict, Callable[[dict], Any]]:
  """A learning rate as its numbers and how it is made of them.

  Args:
    value: a number, (constant V) or a schedule Spec (front/optimizers.py).
    steps: the run's steps (a schedule's length when it names none).
    where: the optimizer's location, for an error.

  Returns:
    (numbers, make): the numbers are Python ints and floats; `make(numbers)` is the rate (a
    number, or a schedule of the step count), with these numbers or with the train step's
    traced copies of them (lower/step.py: the same bits, one executable for any values).
  """
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return {"value": float(value)}, lambda n: n["value"]
  if isinstance(value, Init) and value.kind == "constant":
    return {"value": float(value.value)}, lambda n: n["value"]
  if isinstance(value, Spec) and value.kind == "schedule" and value.name in SCHEDULES:
    given = dict(value.args)
    kw = {**dict(SCHEDULES[value.name].keywords), **given}
    total = kw["steps"] if kw.get("steps") is not None else steps
    peak = float(kw["peak"])
    end = float(kw["min-lr"]) if kw.get("min-lr") is not None else peak * float(
        kw.get("floor", 0.0))
    entry = SCHEDULES[value.name]
    return (entry.numbers(peak, int(kw.get("warmup", 0)), end, int(total), kw),
            lambda n: entry.make(n, kw))
  raise SxError("E-RUN-002", "a learning rate is a number or a schedule", location=where,
                fix="(warmup-cosine :peak 1e-3 :warmup 100 :floor 0.1), or a number")


def schedule(value: Any, steps: int, where) -> Callable[[Any], Any] | float:
  """A learning rate made of its own numbers: a number or a schedule of the step count."""
  numbers, make = rate(value, steps, where)
  return make(numbers)


def _entry(spec: Spec):
  """The optimizer's table entry and its keyword values (defaults, then the Spec's)."""
  entry = OPTIMIZERS.get(spec.name)
  if entry is None:
    raise SxError("E-RUN-002", f"unknown optimizer {spec.name}", location=spec.loc,
                  fix="one of " + names_text())
  return entry, {**entry.defaults(), **dict(spec.args)}


def _rates(spec: Spec, entry, kw: dict, steps: int) -> dict[str, tuple[dict, Callable]]:
  """Each rate keyword of the optimizer (:lr, Muon's :adam-lr) given: (numbers, make)."""
  return {key: rate(kw[key], steps, spec.loc) for key in ("lr",) + tuple(entry.keywords)
          if kw.get(key) is not None and (key == "lr" or KEYWORDS[key].kind == "rate")}


def rate_numbers(spec: Spec, steps: int) -> dict[str, dict]:
  """The numbers of every learning rate of the optimizer, by keyword: what the train step
  takes as arguments (`make_optimizer(..., numbers=)` builds the optimizer from them)."""
  entry, kw = _entry(spec)
  return {key: numbers for key, (numbers, _) in _rates(spec, entry, kw, steps).items()}


def decay_mask(spec: Spec, graph: Graph) -> dict[str, bool]:
  """Whether the optimizer's weight decay reaches each parameter of `graph`, by path: each
  parameter's role decides (`ir.roles`: norms, biases and embeddings spared), the
  optimizer's `:decay` and `:no-decay` patterns over parameter paths win.

  Raises:
    SxError: E-RUN-002 for a pattern that matches nothing; E-ROLE-001 at a `param` whose
      decay its uses do not decide, when the optimizer decays.
  """
  return roles.decay_mask(graph, roles.roles(graph), tuple(spec.get("decay", ())),
                          tuple(spec.get("no-decay", ())), spec.loc,
                          need=float(spec.get("weight-decay", 0.0)) > 0)


def matrices(graph: Graph) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """Each hidden or expert matrix of `graph` (by its role) with its fan-in and fan-out axes
  in its full shape, the stacked axes (repeat's layers, experts) left out: what Muon
  orthogonalises, one matrix for each index of the stacked axes."""
  out = {}
  for path, r in roles.roles(graph).items():
    if r.role in ("hidden", "expert") and r.contracted and r.free:
      k = len(r.stack)
      out[path] = (tuple(k + a for a in r.contracted), tuple(k + a for a in r.free))
  return out


def optimizer_of(spec: Spec, graph: Graph) -> dict[str, str]:
  """Which optimizer updates each parameter: `muon` or `adamw` under Muon (by role), else
  the optimizer's own name."""
  if spec.name != "muon":
    return {path: spec.name for path in graph.params}
  found = matrices(graph)
  return {path: "muon" if path in found else "adamw" for path in graph.params}


def _by_rank(params):
  return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def _mask_of(spec: Spec, graph: Graph | None):
  """The mask optax's decay takes: by role from the graph; without one, by rank (≥ 2)."""
  if graph is None:
    return _by_rank
  decided = decay_mask(spec, graph)
  return lambda params: {k: decided[k] if k in decided else v.ndim >= 2
                         for k, v in params.items()}


def lr_factors(spec: Spec, graph: Graph | None) -> dict[str, float]:
  """Each parameter's μP learning-rate factor (lower/mup.py: TP5's Table 3, Adam's or SGD's
  column by the optimizer; Muon's matrices 1, its AdamW part Adam's); {} when the run is
  not under μP or there is no graph to read roles from."""
  base = mup.base_width(spec)
  if base is None or graph is None:
    return {}
  plan = mup.plan(graph, int(base), spec.loc)
  opts = optimizer_of(spec, graph)
  return {path: plan.lr(path, opts[path]) for path in graph.params}


def mup_cells(spec: Spec, graph: Graph):
  """For `check --print params` under μP: each parameter's cells (init-std multiplier,
  learning-rate multiplier under this optimizer, output multiplier), the columns' heads and
  a summary line; None when the run is standard."""
  base = mup.base_width(spec)
  if base is None:
    return None
  plan = mup.plan(graph, int(base), spec.loc)
  factors = lr_factors(spec, graph)
  cells = {path: (f"{r.init:.4g}", f"{factors[path]:.4g}", f"{r.output:.4g}" if r.output != 1
                  else "-") for path, r in plan.rules.items()}
  line = (f"mup: width {plan.width} (the readout's fan-in) / :base-width {plan.base} = m "
          f"{plan.ratio:g}; init× is what the written init's std was multiplied by (the init "
          f"column shows the result), lr× multiplies the {spec.name} "
          f"step, out× the readout's product (Tensor Programs V, Table 3 with its output "
          f"multiplier)")
  return cells, ("init×", "lr×", "out×"), "\n".join([line] + [f"warning: {w}"
                                                              for w in plan.warnings])


def scale_each(factors: dict[str, float]) -> optax.GradientTransformation:
  """Multiplies each parameter's update by its factor (1 for one not named): an
  optax.partition of optax.scale transforms, one for each distinct factor. Applied after the
  optimizer's chain, it scales the step as a per-parameter learning rate would (AdamW's
  decoupled decay too, as the `mup` package's MuAdamW scales each group's lr)."""
  groups = sorted(set(factors.values()) | {1.0})
  names = {f: f"x{i}" for i, f in enumerate(groups)}
  return optax.partition({names[f]: optax.scale(f) for f in groups},
                         lambda params: {k: names[factors.get(k, 1.0)] for k in params})


def make_optimizer(spec: Spec, steps: int, graph: Graph | None = None,
                   numbers: dict[str, dict] | None = None
                   ) -> tuple[optax.GradientTransformation, Any]:
  """The optax chain for an optimizer Spec, and its learning-rate schedule.

  The chain is the optimizer's entry in front/optimizers.py, behind clip_by_global_norm
  (`:clip`) and, for an optimizer that does not decouple it, add_decayed_weights
  (`:weight-decay`). Muon's split (hidden and expert matrices, the rest) is `matrices`. The
  decay reaches the parameters `decay_mask` chooses from `graph` (the loss graph), or without
  one those of rank ≥ 2. Under μP (`:parametrization mup`, carried by the Spec) each
  parameter's update is then scaled by its learning-rate factor (`lr_factors`). The learning
  rates are made of `numbers` (rate_numbers' shape: the train step's traced arguments) when
  given, else of their own.

  Raises:
    SxError: E-RUN-002 for an optimizer the table lacks, a bad learning rate or decay
      pattern; E-ROLE-001 (decay_mask).
  """
  entry, kw = _entry(spec)
  for key, (own, make) in _rates(spec, entry, kw, steps).items():
    kw[key] = make(own if numbers is None else numbers[key])
  lr = kw["lr"]
  wd = float(kw["weight-decay"])
  mask = _mask_of(spec, graph)
  parts = []
  if kw["clip"] is not None:
    parts.append(optax.clip_by_global_norm(float(kw["clip"])))
  if wd and not entry.decoupled:
    parts.append(optax.add_decayed_weights(wd, mask=mask))
  parts.append(entry.chain(lr, kw, mask, None if graph is None else matrices(graph)))
  factors = lr_factors(spec, graph)
  if factors:
    parts.append(scale_each(factors))
  sched = lr if callable(lr) else (lambda count, v=lr: v)
  return optax.chain(*parts), sched

"""Optimizers and schedules: the experiment's Specs as optax transformations."""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from sexpgpu.errors import SxError
from sexpgpu.ir import roles
from sexpgpu.ir.graph import Graph, Init
from sexpgpu.front.optimizers import KEYWORDS, OPTIMIZERS, SCHEDULES, names_text
from sexpgpu.front.values import Spec


def schedule(value: Any, steps: int, where) -> Callable[[Any], Any] | float:
  """A learning rate: a number, (constant V) or a schedule Spec (front/optimizers.py)."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, Init) and value.kind == "constant":
    return float(value.value)
  if isinstance(value, Spec) and value.kind == "schedule" and value.name in SCHEDULES:
    given = dict(value.args)
    kw = {**dict(SCHEDULES[value.name].keywords), **given}
    total = kw["steps"] if kw.get("steps") is not None else steps
    peak = float(kw["peak"])
    end = float(kw["min-lr"]) if kw.get("min-lr") is not None else peak * float(
        kw.get("floor", 0.0))
    return SCHEDULES[value.name].make(peak, int(kw.get("warmup", 0)), end, int(total), kw)
  raise SxError("E-RUN-002", "a learning rate is a number or a schedule", location=where,
                fix="(warmup-cosine :peak 1e-3 :warmup 100 :floor 0.1), or a number")


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


def make_optimizer(spec: Spec, steps: int, graph: Graph | None = None
                   ) -> tuple[optax.GradientTransformation, Any]:
  """The optax chain for an optimizer Spec, and its learning-rate schedule.

  The chain is the optimizer's entry in front/optimizers.py, behind clip_by_global_norm
  (`:clip`) and, for an optimizer that does not decouple it, add_decayed_weights
  (`:weight-decay`). Muon's split (hidden and expert matrices, the rest) is `matrices`. The decay reaches the parameters `decay_mask` chooses from `graph` (the
  loss graph), or without one those of rank ≥ 2.

  Raises:
    SxError: E-RUN-002 for an optimizer the table lacks, a bad learning rate or decay
      pattern; E-ROLE-001 (decay_mask).
  """
  entry = OPTIMIZERS.get(spec.name)
  if entry is None:
    raise SxError("E-RUN-002", f"unknown optimizer {spec.name}", location=spec.loc,
                  fix="one of " + names_text())
  kw = {**entry.defaults(), **dict(spec.args)}
  lr = schedule(kw["lr"], steps, spec.loc)
  for key in entry.keywords:  # a second rate (Muon's :adam-lr)
    if key != "lr" and kw.get(key) is not None and KEYWORDS[key].kind == "rate":
      kw[key] = schedule(kw[key], steps, spec.loc)
  wd = float(kw["weight-decay"])
  mask = _mask_of(spec, graph)
  parts = []
  if kw["clip"] is not None:
    parts.append(optax.clip_by_global_norm(float(kw["clip"])))
  if wd and not entry.decoupled:
    parts.append(optax.add_decayed_weights(wd, mask=mask))
  parts.append(entry.chain(lr, kw, mask, None if graph is None else matrices(graph)))
  sched = lr if callable(lr) else (lambda count, v=lr: v)
  return optax.chain(*parts), sched

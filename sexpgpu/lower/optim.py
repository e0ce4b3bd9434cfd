"""Optimizers and schedules: the experiment's Specs as optax transformations."""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from sexpgpu.errors import SxError
from sexpgpu.ir.graph import Init
from sexpgpu.front.values import Spec


def schedule(value: Any, steps: int, where) -> Callable[[Any], Any] | float:
  """A learning rate: a number, (constant V) or a schedule Spec."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return float(value)
  if isinstance(value, Init) and value.kind == "constant":
    return float(value.value)
  if isinstance(value, Spec) and value.kind == "schedule":
    peak = float(value.get("peak"))
    warmup = int(value.get("warmup", 0))
    floor = float(value.get("floor", 0.0))
    total = int(value.get("steps", steps))
    if value.name == "warmup-cosine":
      return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1), max(total, warmup + 1),
                                                end_value=peak * floor)
    if value.name == "warmup-linear":
      return optax.join_schedules([
          optax.linear_schedule(0.0, peak, max(warmup, 1)),
          optax.linear_schedule(peak, peak * floor, max(total - warmup, 1))], [warmup])
    if value.name == "rsqrt":
      w = max(warmup, 1)
      return lambda count: peak * jax.numpy.minimum((count + 1) / w, 1.0) * jax.lax.rsqrt(
          jax.numpy.maximum(count + 1.0, float(w)) / w)
  raise SxError("E-RUN-002", "a learning rate is a number or a schedule", location=where,
                fix="(warmup-cosine :peak 1e-3 :warmup 100 :floor 0.1), or a number")


def _decay_mask(params):
  return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def make_optimizer(spec: Spec, steps: int) -> tuple[optax.GradientTransformation, Any]:
  """The optax chain for an optimizer Spec, and its learning-rate schedule.

  `:clip` chains clip_by_global_norm; `:weight-decay` skips parameters of rank < 2.
  """
  lr = schedule(spec.get("lr"), steps, spec.loc)
  wd = float(spec.get("weight-decay", 0.0))
  name = spec.name
  if name == "sgd":
    core = optax.sgd(lr, nesterov=bool(spec.get("nesterov", False)))
  elif name == "momentum":
    core = optax.sgd(lr, momentum=float(spec.get("momentum", 0.9)),
                     nesterov=bool(spec.get("nesterov", False)))
  elif name == "adam":
    core = optax.adam(lr, b1=float(spec.get("b1", 0.9)), b2=float(spec.get("b2", 0.999)),
                      eps=float(spec.get("eps", 1e-8)))
  elif name == "adamw":
    core = optax.adamw(lr, b1=float(spec.get("b1", 0.9)), b2=float(spec.get("b2", 0.999)),
                       eps=float(spec.get("eps", 1e-8)), weight_decay=wd, mask=_decay_mask)
    wd = 0.0
  elif name == "lion":
    core = optax.lion(lr, b1=float(spec.get("b1", 0.9)), b2=float(spec.get("b2", 0.99)),
                      weight_decay=wd, mask=_decay_mask)
    wd = 0.0
  elif name == "adafactor":
    core = optax.adafactor(lr, decay_rate=float(spec.get("decay-rate", 0.8)),
                           min_dim_size_to_factor=int(spec.get("min-dim-size-to-factor", 128)))
  else:
    raise SxError("E-RUN-002", f"unknown optimizer {name}", location=spec.loc,
                  fix="sgd momentum adam adamw lion adafactor")
  parts = []
  if spec.get("clip") is not None:
    parts.append(optax.clip_by_global_norm(float(spec.get("clip"))))
  if wd:
    parts.append(optax.add_decayed_weights(wd, mask=_decay_mask))
  parts.append(core)
  sched = lr if callable(lr) else (lambda count, v=lr: v)
  return optax.chain(*parts), sched

"""A function from tokens to logits, as a jitted JAX call of its graph (the full forward)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower.fp8 import patterns
from sexpgpu.lower.interp import run_graph
from sexpgpu.models import source


def forward(c, fn: str, t: int, batch: int = 1, precision: str | None = None) -> Callable:
  """`logits = f(params, tokens)` for int32 tokens [batch t], jitted.

  Args:
    c: the Compiled experiment.
    fn: the function of the tokens that returns logits.
    t, batch: the tokens' shape.
    precision: "f32" or "bf16" (default: the run's :precision).
  """
  graph = source.logits_graph(c, fn, t, batch)
  ctx = LowerCtx(precision or str(c.exp.run["precision"]), None, False, [], None,
                 fp8_only=patterns(c.exp.run))

  def f(params, tokens):
    out = run_graph(graph, params, {"tokens": tokens}, ctx)["out"]
    return out.astype(jnp.float32)

  return jax.jit(f)


def device_params(c, params: dict[str, np.ndarray]) -> dict:
  """Host parameters as the graph reads them (its paths, its dtypes), on the default device."""
  from sexpgpu.ir.ops import DTYPES
  return {k: jnp.asarray(params[k], DTYPES[p.dtype]) for k, p in c.params.items()}

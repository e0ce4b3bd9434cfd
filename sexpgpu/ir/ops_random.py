"""Random draws in the graph, from the run's key as `dropout` draws.

In a training step the key is a pure function of the seed, the step, the
microbatch (and the layer, inside a repeat), so a run is the same twice and a
resume is bitwise; each call site folds in its own number, so two draws differ.
A pass draws from a key fixed per batch of the pass (`lower.step.PassStep`), so
an evaluation draws the same values each time it runs and its batches differ;
shape rules, which have no key, draw from a fixed one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sexpgpu.ir.opdef import DTYPES, REQUIRED, Attr, register

_SHAPE = Attr("shape", "shape", REQUIRED, "the shape drawn", positional=True)
_SITE = Attr("site", "int", internal=True)


def key(ctx, site: int):
  """The key of one call site: the run's (this microbatch's or pass batch's) key, or a fixed
  one where there is none (shape rules)."""
  base = ctx.rng if ctx.rng is not None else jax.random.key(0)
  return jax.random.fold_in(base, site)


def _float(dtype: str):
  if dtype not in ("f32", "bf16", "f16"):
    raise TypeError(f"draws floats; {dtype} is not a float dtype")
  return DTYPES[dtype]


@register("bernoulli", (), "true with probability P (bool), each element drawn apart",
          (_SHAPE, Attr("p", "float", 0.5, "the probability of true"), _SITE), random=True,
          kind="random")
def _bernoulli(ctx, *, shape, p, site):
  if not 0.0 <= p <= 1.0:
    raise ValueError(f"p {p} is outside [0, 1]")
  return jax.random.bernoulli(key(ctx, site), p, shape)


@register("random-normal", (), "normal draws of mean MEAN and standard deviation STD",
          (_SHAPE, Attr("mean", "float", 0.0, "the mean"),
           Attr("std", "float", 1.0, "the standard deviation"),
           Attr("dtype", "dtype", "f32", "a float dtype"), _SITE), random=True, kind="random")
def _random_normal(ctx, *, shape, mean, std, dtype, site):
  dt = _float(dtype)
  return (mean + std * jax.random.normal(key(ctx, site), shape, jnp.float32)).astype(dt)


@register("random-uniform", (), "uniform draws in [LOW, HIGH)",
          (_SHAPE, Attr("low", "float", 0.0, "the lower end"),
           Attr("high", "float", 1.0, "the upper end (left out)"),
           Attr("dtype", "dtype", "f32", "a float dtype"), _SITE), random=True, kind="random")
def _random_uniform(ctx, *, shape, low, high, dtype, site):
  if not low < high:
    raise ValueError(f"low {low} must be below high {high}")
  return jax.random.uniform(key(ctx, site), shape, jnp.float32, low, high).astype(_float(dtype))


@register("random-int", (), "int32 draws in [LOW, HIGH), each value equally likely",
          (_SHAPE, Attr("low", "int", 0, "the smallest value"),
           Attr("high", "int", REQUIRED, "one past the largest"), _SITE), random=True,
           kind="random")
def _random_int(ctx, *, shape, low, high, site):
  if not low < high:
    raise ValueError(f"low {low} must be below high {high}")
  return jax.random.randint(key(ctx, site), shape, low, high, jnp.int32)


@register("random-permutation", (), "a random order of 0 .. N-1 (int32)",
          (Attr("n", "int", REQUIRED, "how many", positional=True), _SITE), random=True,
          kind="random")
def _random_permutation(ctx, *, n, site):
  if n < 1:
    raise ValueError(f"n {n} must be at least 1")
  return jax.random.permutation(key(ctx, site), n).astype(jnp.int32)

"""Evaluates a graph with JAX values: the body of every jitted step."""

from __future__ import annotations

import dataclasses

from typing import Any, Callable

import jax

from sexpgpu.errors import SxError
from sexpgpu.front.pyops import op_error
from sexpgpu.ir.graph import Fn, Graph, Node, walk
from sexpgpu.ir.opdef import OPS
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower import fp8
from sexpgpu.lower.rules import lowering


UNROLL_MAX = 4

# What a rule returns for a node it leaves to the evaluator's own handling.
NOT_HANDLED = object()

# `rule(node, env)`: a node's value computed some other way (decoding's caches, a table
# read at an offset), or NOT_HANDLED. Looked up before the evaluator's own handling.
Rule = Callable[[Node, dict], Any]


def run_graph(graph: Graph, params: dict[str, Any], inputs: dict[str, Any], ctx: LowerCtx,
              taps: dict[str, list] | None = None, rule: Rule | None = None) -> dict[str, Any]:
  """The graph's outputs for these parameter and input values.

  Args:
    params: parameter path → array (stacked for those inside repeats).
    inputs: batch field → array.
    ctx: precision, rng, training flag and the platform whose lowering rules apply.
    taps: when given, filled with tap name → values recorded in this call.
    rule: asked first for each node outside bodies (see `evaluate`): decoding's caches.
  """
  env: dict[int, Any] = {}
  if ctx.precision == "fp8":  # the products FP8 takes, from the graph's parameter roles
    ctx = dataclasses.replace(ctx, fp8=fp8.selected(graph, ctx.fp8_only))
  roots = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  evaluate(roots, env, params, inputs, ctx, taps, rule)
  return {k: env[v.uid] for k, v in graph.outputs.items()}


def evaluate(roots: list[Node], env: dict, params: dict, inputs: dict, ctx: LowerCtx,
             taps=None, rule: Rule | None = None) -> None:
  """Puts into `env` (uid → value) the values of `roots` and of the nodes they read, inputs
  first, skipping those already there. `rule`, when given, is asked first for every node
  (not inside a repeat's or a scan's body: a rule that keeps state per layer evaluates its
  repeat's body itself, with a rule of its own)."""
  for node in walk(roots):
    if node.uid in env:
      continue
    if rule is not None:
      value = rule(node, env)
      if value is not NOT_HANDLED:
        env[node.uid] = value
        continue
    op = node.op
    if op == "param":
      env[node.uid] = params[node.attr("path")]
    elif op == "input":
      env[node.uid] = inputs[node.attr("field")]
    elif op == "repeat":
      env[node.uid] = repeat_value(node, env, params, inputs, ctx, taps)
    elif op == "part":
      env[node.uid] = env[node.inputs[0].uid][node.attr("index")]
    elif isinstance(node.attr("body"), Fn):
      env[node.uid] = scan_value(node, env, params, inputs, ctx)
    else:
      args = arguments(node, env)
      attrs = {k: v for k, v in node.attrs}
      value = lowered(node, ctx, args, attrs)
      if op == "tap" and taps is not None:
        taps.setdefault(attrs["name"], []).append(value)
      env[node.uid] = value


def lowered(node: Node, ctx, args: list, attrs: dict):
  """`node`'s value by its op's lowering rule; what an op written in Python raises is
  E-OP-001 at its `.sx` call (every caller of a rule goes through here)."""
  try:
    if node.uid in ctx.fp8:
      return fp8.matmul_rule(ctx, *args, **attrs)
    return lowering(node.op, ctx.platform)(ctx, *args, **attrs)
  except Exception as e:
    source = OPS[node.op].source
    if source is None or isinstance(e, SxError):
      raise
    raise op_error(node.op, source, e, node.loc) from None


def arguments(node: Node, env: dict) -> list:
  """A node's inputs' values (its constant inputs as they are), for its lowering rule."""
  return [env[i.uid] if isinstance(i, Node) else i for i in node.inputs]


def split_params(node: Node, params: dict) -> tuple[dict, dict]:
  """A repeat's stacked parameters (layers on the leading axis), and the others."""
  stacked = {p: params[p] for p in node.attr("body").params}
  return stacked, {k: v for k, v in params.items() if k not in stacked}


def run_layer(node: Node, env: dict, carry, params: dict, inputs: dict, ctx: LowerCtx,
              taps=None, rule: Rule | None = None) -> Any:
  """One layer of a repeat: its body's output for this carry, `params` holding this layer's
  slices of the stacked ones."""
  body = node.attr("body")
  local = dict(env)
  local[body.carry.uid] = carry
  evaluate([body.output], local, params, inputs, ctx, taps, rule)
  return local[body.output.uid]


def repeat_value(node: Node, env: dict, params: dict, inputs: dict, ctx: LowerCtx, taps,
                 rule_for=None) -> Any:
  """A repeat's output: unrolled up to UNROLL_MAX layers, else a scan; each layer's key
  folded from its index. `rule_for(params, inputs, ctx)` gives the per-node rule asked
  inside each layer's body (a layout's, lower/fsdp.py), from that layer's parameters."""
  n = node.attr("n")
  stacked, outer_params = split_params(node, params)

  def step(carry, xs):
    layer_params, i = xs
    sub = dataclasses.replace(ctx, rng=None if ctx.rng is None else
                              jax.random.fold_in(ctx.rng, i))
    layer_taps = {} if taps is not None else None
    here = {**outer_params, **layer_params}
    rule = rule_for(here, inputs, sub) if rule_for is not None else None
    out = run_layer(node, env, carry, here, inputs, sub, layer_taps, rule)
    return out, layer_taps or {}

  if node.attr("remat"):
    step = jax.checkpoint(step)
  # A short repeat is unrolled in Python, layer by layer on slices of the stacked
  # parameters (measured faster on the CPU than a scan, unrolled or not); a deep or
  # rematerialized one stays a loop, so compile time does not grow with depth.
  if n <= UNROLL_MAX and not node.attr("remat"):
    out, per_layer = env[node.inputs[0].uid], []
    for i in range(n):
      out, y = step(out, ({p: v[i] for p, v in stacked.items()}, jax.numpy.int32(i)))
      per_layer.append(y)
    ys = {name: [jax.numpy.stack([y[name][j] for y in per_layer]) for j in range(len(vals))]
          for name, vals in per_layer[0].items()}  # as scan stacks them
  else:
    out, ys = jax.lax.scan(step, env[node.inputs[0].uid], (stacked, jax.numpy.arange(n)))
  if taps is not None:
    for name, vals in ys.items():
      taps.setdefault(name, []).extend(vals)
  return out


def body_fn(node: Node, env: dict, params: dict, inputs: dict, ctx: LowerCtx):
  """A scan's function as a Python callable of tuples of arrays, for its lowering rule:
  `fn(carry, x, t) → (carry, y)` for a scan (`t` the position, folded into the key of
  random ops), `fn(a, b) → c` for an associative scan. It reads the outside values it
  uses from `env`, where they already are (they are the scan's inputs)."""
  body = node.attr("body")
  carries = node.attr("carries")

  def call(args: tuple, index=None) -> tuple:
    local = dict(env)
    for a, v in zip(body.args, args):
      local[a.uid] = v
    sub = ctx if index is None or ctx.rng is None else dataclasses.replace(
        ctx, rng=jax.random.fold_in(ctx.rng, index))
    evaluate(list(body.results), local, params, inputs, sub, None)
    return tuple(local[r.uid] for r in body.results)

  if node.op == "scan":
    def step(carry, x, t):
      out = call(tuple(carry) + tuple(x), t)
      return out[:carries], out[carries:]
    return step
  return lambda a, b: call(tuple(a) + tuple(b))


def scan_value(node: Node, env: dict, params: dict, inputs: dict, ctx: LowerCtx,
               fn=None) -> tuple:
  """The values of a scan node (a tuple: its carries, then its stacked outputs), by its
  lowering rule on this platform; `fn` replaces its function (decoding masks it)."""
  args = [env[i.uid] for i in node.inputs[:node.attr("operands")]]
  attrs = {k: v for k, v in node.attrs if k not in ("body", "types")}
  fn = fn or body_fn(node, env, params, inputs, ctx)
  return tuple(lowering(node.op, ctx.platform)(ctx, *args, fn=fn, **attrs))

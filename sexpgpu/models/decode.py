"""Incremental decoding derived from a model's graph: a prefill call and a one-position step.

The graph of `(FN tokens)` is built for a window of W positions. A pass over it finds, for
every node, which of its axes runs over positions (the time axis), starting at the tokens'
last axis, through reshapes, transposes, elementwise broadcasting, products and reductions
that keep it. Two kinds of node tie values to positions and have a rule:

- `sdpa` (causal): the step writes its one key and value into a cache of W positions at the
  current offset and attends over the cache up to it; the prefill fills the cache;
- a position table (`(slice table 0 0 W)` of a parameter, or of a value that does not depend
  on the tokens, such as a rotary table of more positions) and `(iota W)`: the step reads
  the row, or the index, of the current offset.

Any other node that mixes positions (a `causal-mask` or `einsum` over the time axis that is
not an `sdpa` region, a reduction over positions, a constant as long as the window, ...)
has no rule: `plan` names it, and sampling recomputes the window for every token instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sexpgpu.ir.graph import Fn, Graph, Node, walk
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.ir.printer import print_graph
from sexpgpu.lower import interp
from sexpgpu.lower.rules import lowering
from sexpgpu.models.decode_rules import (DECODE, NoRule, Plan, time_axis,  # noqa: F401 (NoRule: callers')
                                         part_axis)

def plan(graph: Graph, window: int) -> Plan:
  """The incremental plan of a logits graph built for `window` positions.

  Raises:
    NoRule: the first node that mixes positions without a rule.
  """
  p = Plan(graph, window, {}, set(), set(), [])
  _plan_nodes(p, graph.nodes(), {})
  out = graph.outputs["out"]
  if p.axes.get(out.uid) != len(out.shape) - 2:
    raise NoRule(out, "does not keep positions on the axis before the vocabulary")
  return p


def limits(p: Plan) -> list[tuple[int, str]]:
  """What bounds the positions the plan decodes: (the most positions, what) for each position
  table read at the offset (its rows) and for the key/value caches of its sdpa regions (the
  plan's window), the fewest first; none for a plan of carries and computed positions
  (iotas), which decodes any length."""
  found: list[tuple[int, str]] = []
  for n in _every_node(p.graph.nodes()):
    if n.uid not in p.tables:
      continue
    where = f" ({n.loc})" if n.loc is not None else ""
    if n.op == "param":
      found.append((n.shape[0], f"the learned position table `{n.attr('path')}`{where} of "
                    f"{n.shape[0]} rows"))
    else:
      src, axis = n.inputs[0], n.attr("axis")
      what = f"`{src.attr('path')}`" if src.op == "param" else "computed"
      found.append((src.shape[axis], f"the position table {what}{where} of "
                    f"{src.shape[axis]} rows"))
  if p.attention:
    n = p.attention[0]
    where = f" ({n.loc})" if n.loc is not None else ""
    found.append((p.window, f"the attention window of {p.window} positions (the key/value "
                  f"cache of {len(p.attention)} `sdpa` region{'s' if len(p.attention) != 1 else ''}"
                  f"{where})"))
  return sorted(found, key=lambda f: f[0])


def _every_node(nodes):
  """The nodes and, after each, those of its body (a repeat's layer, a scan's function)."""
  for n in nodes:
    yield n
    body = n.attr("body")
    if isinstance(body, Fn):
      yield from _every_node(walk(list(body.results)))
    elif body is not None and hasattr(body, "output"):
      yield from _every_node(walk([body.output]))


_CARRY_ROLES = {"running": "running total kept (carry)", "recurrence": "recurrence state kept (carry)",
                "window": "window cache of the last (kernel-1)×dilation inputs",
                "scan": "scan carry kept (carry)",
                "combination": "running combination kept (carry)"}


def explain(graph: Graph, window: int) -> str:
  """`check --print decode`: the path sampling takes for a logits graph of `window`
  positions, and the graph with each node's time axis and what the decode step does at it."""
  try:
    p = plan(graph, window)
  except NoRule as e:
    return (f"decode: recompute (the window of {window} positions for every token): "
            f"{e.describe()} has no incremental rule\n{print_graph(graph)}\n")
  roles = {n.uid: (f"key/value cache of the {p.grouped[n.uid][0].shape[1]} key/value heads"
                   if n.uid in p.grouped else "key/value cache") for n in p.attention}
  roles.update({u: "row at the offset" for u in p.tables})
  roles.update({u: _CARRY_ROLES[k] for u, k in p.carries.items()})
  roles.update({u: "the offset" for u in p.iotas})

  def note(n: Node) -> str:
    axis = p.axes.get(n.uid)
    found = [roles[n.uid]] if n.uid in roles else []
    return ", ".join(found + ([f"time axis {axis}"] if axis is not None else []))

  head = (f"decode: incremental over a window of {window} positions, the prompt prefilled, "
          f"then one position a step; sdpa regions keeping keys and values {len(p.attention)}, position tables "
          f"read at the offset {len(p.tables)}, iotas read as the offset {len(p.iotas)}, "
          f"carries kept {len(p.carries)}")
  return f"{head}\n{print_graph(graph, note=note)}\n"


def _plan_nodes(p: Plan, nodes: list[Node], carries: dict[int, int | None]) -> None:
  for n in nodes:
    if n.uid in p.axes:
      continue
    if n.op == "carry":
      p.axes[n.uid] = carries.get(n.uid)
      continue
    if n.op == "repeat":
      body = n.attr("body")
      inner = p.axes[n.inputs[0].uid]
      _plan_nodes(p, list(walk([body.output])), {body.carry.uid: inner})
      if p.axes[body.output.uid] != inner:
        raise NoRule(n, "changes the axis of positions from one layer to the next")
      p.axes[n.uid] = inner
      continue
    p.axes[n.uid] = _axis(p, n)


def _axis(p: Plan, n: Node) -> int | None:
  W = p.window
  ins = [i for i in n.inputs if isinstance(i, Node)]
  axes = [time_axis(p, i) for i in ins]
  timed = [(i, a) for i, a in zip(ins, axes) if a is not None]
  op = n.op
  if op == "input":
    return len(n.shape) - 1 if n.attr("field") == "tokens" else None
  if op == "param":
    return None
  if op == "iota":
    if n.attr("n") == W:
      p.iotas.add(n.uid)
      return 0
    return None
  if op == "full":
    return None
  if op == "part":
    return part_axis(p, n)
  if not timed:
    # rows 0..W of a table that does not depend on the tokens (learned, or computed like a
    # rotary table of more positions): the step reads the row at the offset
    if op == "slice" and n.attr("start") == 0 and n.attr("end") == W and W > 1:
      if ins[0].shape[n.attr("axis")] > W or n.attr("axis") == 0:
        p.tables.add(n.uid)
        return n.attr("axis")
    return None
  rule = DECODE[op]
  if isinstance(rule, str):
    raise NoRule(n, rule)
  return rule(p, n, ins, timed)


# --- evaluation ------------------------------------------------------------------------------

def run(p: Plan, params: dict, tokens, ctx: LowerCtx, cache: dict | None, offset=None,
        valid=None):
  """Evaluates the plan's graph.

  Args:
    params: path → array.
    tokens: int32 [b W] (the whole window: `cache` None), or [b n] (n positions from
      `offset` on: a prefill of the prompt into an empty cache, or one step's token).
    cache: None for the whole window, else the cache to read and extend (`empty_cache`
      for a prefill).
    offset: the position of the first token (a traced int32).
    valid: how many of the tokens are real (a traced int32; default all): a prefill of a
      prompt padded past its end keeps the carries of its last real position.

  Returns:
    (logits, cache): the cache holds, for each sdpa node, its keys and values [b h W d]
    (stacked in front by the repeats around it).
  """
  out_cache: dict = {}
  valid = tokens.shape[-1] if valid is None else valid
  rule = _rules(p, params, tokens, ctx, cache, out_cache, offset, valid)
  return interp.run_graph(p.graph, params, {}, ctx, rule=rule)["out"], out_cache


def empty_cache(p: Plan, params: dict, ctx: LowerCtx, batch: int = 1) -> dict:
  """Zeros in the shape of the cache a whole-window call returns (for a chunked prefill)."""
  shapes = jax.eval_shape(lambda prm: run(p, prm, jnp.zeros((batch, p.window), jnp.int32),
                                          ctx, None)[1], params)
  return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _rules(p, params, tokens, ctx, cache, out_cache, offset, valid) -> interp.Rule:
  """What decoding evaluates differently from the reference interpreter (which does the
  rest): the token input, the sdpa regions, carries, iotas and position tables of the plan,
  reshapes of the time axis to this call's positions, and repeats that keep a cache per
  layer. `params` are the ones the evaluator reads (a layer's, inside a repeat)."""
  step = cache is not None
  span = tokens.shape[-1]  # positions this call computes, from `offset` on

  def rule(n: Node, env: dict) -> Any:
    op = n.op
    if op == "param":
      if step and n.uid in p.tables:
        return jax.lax.dynamic_slice_in_dim(params[n.attr("path")], offset, span, axis=0)
      return interp.NOT_HANDLED
    if op == "input":
      return tokens
    if op == "repeat":
      return _repeat(p, n, env, params, tokens, ctx, cache, out_cache, offset, valid)
    if isinstance(n.attr("body"), Fn):
      return (_scan(n, env, params, ctx, cache, out_cache, offset, valid)
              if n.uid in p.carries else interp.NOT_HANDLED)
    if op == "sdpa":
      group = p.grouped.get(n.uid)
      sources = (env[group[0].uid], env[group[1].uid], group[2]) if group else None
      return _attend(n, interp.arguments(n, env), dict(n.attrs), ctx, cache, out_cache,
                     offset, sources)
    if n.uid in p.carries:
      return _carry(p.carries[n.uid], n, interp.arguments(n, env), dict(n.attrs), ctx, cache,
                    out_cache, valid)
    if step and n.uid in p.iotas:
      return offset + jnp.arange(span, dtype=jnp.int32)
    if step and n.uid in p.tables:
      return jax.lax.dynamic_slice_in_dim(env[n.inputs[0].uid], offset, span,
                                          axis=n.attr("axis"))
    if step and op in ("reshape", "broadcast") and p.axes.get(n.uid) is not None:
      attrs = dict(n.attrs)
      shape = list(attrs["shape"])
      shape[p.axes[n.uid]] = span
      attrs["shape"] = tuple(shape)
      return lowering(op, ctx.platform)(ctx, *interp.arguments(n, env), **attrs)
    return interp.NOT_HANDLED

  return rule


def _carry(kind, n, args, attrs, ctx, cache, out_cache, valid):
  """A node that keeps a carry along positions: its value over this call's positions from
  the carry of the ones before (the identity for a whole window or an empty cache), and the
  carry after the last real one (`valid`), kept in the cache."""
  rule = lowering(n.op, ctx.platform)
  axis = p_axis = attrs["axis"] % len(n.shape) if "axis" in attrs else 1
  prev = cache.get(n.uid) if cache is not None else None
  if kind == "window":  # a causal conv: the inputs before these, then a valid conv
    x, w = args
    k = (w.shape[0] - 1) * (attrs["dilation"] if isinstance(attrs["dilation"], int)
                            else attrs["dilation"][0])
    if prev is None:
      prev = jnp.zeros(x.shape[:1] + (k,) + x.shape[2:], x.dtype)
    xx = jnp.concatenate([prev.astype(x.dtype), x], axis=1)
    out = rule(ctx, xx, w, **{**attrs, "padding": "valid"})
    out_cache[n.uid] = jax.lax.dynamic_slice_in_dim(xx, valid, k, axis=1)
    return out
  if kind == "recurrence" and prev is not None and args[0].shape[p_axis] == 1:
    a, x = args  # one position a step: H = A · H_before + X, without a scan of one
    dt = jnp.result_type(a, x)
    out = a.astype(dt) * prev.astype(dt) + x.astype(dt)
    out_cache[n.uid] = out
    return out
  out = rule(ctx, *args, **attrs)
  if kind == "recurrence":  # H_t = (Π A up to t) · H_before + the recurrence from 0
    a, x = args
    if prev is not None:
      out = out + jax.lax.cumprod(a.astype(out.dtype), axis=p_axis) * prev
    last = jax.lax.dynamic_slice_in_dim(out, valid - 1, 1, axis=p_axis)
  else:  # a running sum or product: the total before these, then theirs
    x = args[0]
    total = jnp.add if n.op == "cumsum" else jnp.multiply
    # the cache keeps the total less the op's identity, so an empty cache (zeros) is none
    identity = jnp.asarray(0 if n.op == "cumsum" else 1, out.dtype)
    if prev is not None:
      out = total(prev.astype(out.dtype) + identity, out)
    inclusive = out if not attrs["exclusive"] else total(out, x.astype(out.dtype))
    last = jax.lax.dynamic_slice_in_dim(inclusive, valid - 1, 1, axis=axis) - identity
  out_cache[n.uid] = last
  return out


def _scan(n, env, params, ctx, cache, out_cache, offset, valid):
  """A scan along positions: this call's positions from the carry of the ones before (INIT
  at offset 0), keeping the carry after the last real one (`valid`); an associative scan
  combines the positions before (kept as one element) with this call's running
  combination."""
  k, m, axis = n.attr("carries"), n.attr("operands"), n.attr("axis")
  args = [env[i.uid] for i in n.inputs[:m]]
  attrs = {a: v for a, v in n.attrs if a not in ("body", "types")}
  fn = interp.body_fn(n, env, params, {}, ctx)
  prev = cache.get(n.uid) if cache is not None else None
  start = offset == 0 if offset is not None else True
  rule = lowering(n.op, ctx.platform)
  if n.op == "scan":
    init = args[:k]
    if prev is not None:
      init = [jnp.where(start, i, c.astype(i.dtype)) for i, c in zip(init, prev)]

    def masked(carry, x, t):  # positions past the real ones leave the carry as it is
      new, y = fn(carry, x, t)
      return tuple(jnp.where(t < valid, a, b) for a, b in zip(new, carry)), y

    out = tuple(rule(ctx, *init, *args[k:], fn=masked, **attrs))
    out_cache[n.uid] = out[:k]
    return out
  out = tuple(rule(ctx, *args, fn=fn, **attrs))
  if prev is not None:
    before = jax.vmap(fn, in_axes=(None, axis), out_axes=axis)(
        tuple(c.astype(o.dtype) for c, o in zip(prev, out)), out)
    out = tuple(jnp.where(start, o, b) for o, b in zip(out, before))
  out_cache[n.uid] = tuple(jax.lax.dynamic_index_in_dim(o, valid - 1, axis, keepdims=False)
                           for o in out)
  return out


def _attend(n, args, attrs, ctx, cache, out_cache, offset, grouped=None):
  """One sdpa region: the whole window (a prefill, its keys and values kept), or positions
  from `offset` on against the cache. `grouped` (keys, values, n): the kv heads that the
  region's keys and values repeat n times; the cache keeps those and each group of n query
  heads attends to its one head, so the cache is n times smaller."""
  q, k, v = args[:3]
  if grouped is not None:
    k, v, rep = grouped
  if cache is None:  # prefill: the full window, its keys and values kept
    out_cache[n.uid] = (k, v)
    return lowering("sdpa", ctx.platform)(ctx, *args, **attrs)
  ck, cv = cache[n.uid]
  ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), offset, axis=2)
  cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), offset, axis=2)
  out_cache[n.uid] = (ck, cv)
  ct = ctx.compute_dtype(q)
  b, h, span, dh = q.shape
  groups = ck.shape[1]
  qg = q.reshape(b, groups, h // groups, span, dh)  # [b kv n s dh]: n query heads a group
  s = jnp.einsum("bgrqd,bgkd->bgrqk", qg.astype(ct), ck.astype(ct),
                 preferred_element_type=jnp.float32) * attrs["scale"]
  # query i (at offset + i) sees the keys up to its own position
  keep = jnp.arange(ck.shape[2])[None, :] <= offset + jnp.arange(span)[:, None]
  s = jnp.where(keep, s, jnp.array(-jnp.inf, s.dtype))
  probs = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("bgrqk,bgkd->bgrqd", probs.astype(ct), cv.astype(ct),
                   preferred_element_type=jnp.float32)
  return out.reshape(b, h, span, dh).astype(q.dtype)


# A repeat of up to this many layers is unrolled when decoding; a deeper one is scanned.
UNROLL_MAX = 48


def _repeat(p, node, env, params, tokens, ctx, cache, out_cache, offset, valid):
  stacked, outer = interp.split_params(node, params)
  mine = cache.get(node.uid) if cache is not None else None

  def layer(carry, xs):
    layer_params, layer_cache = xs
    layer_params = {**outer, **layer_params}
    inner: dict = {}
    rule = _rules(p, layer_params, tokens, ctx, layer_cache, inner, offset, valid)
    return interp.run_layer(node, env, carry, layer_params, {}, ctx, rule=rule), inner

  n = jax.tree_util.tree_leaves(stacked)[0].shape[0] if stacked else node.attr("n")
  if n > UNROLL_MAX:
    out, caches = jax.lax.scan(layer, env[node.inputs[0].uid], (stacked, mine))
    out_cache[node.uid] = caches
    return out
  # Unrolled, each layer's cache its own array: a scan would carry the stacked caches as
  # xs and ys, copying all of them at every step (53 -> 84 ms a 128-token call in an A/B).
  out, caches = env[node.inputs[0].uid], []
  for i in range(n):
    out, inner = layer(out, ({k: v[i] for k, v in stacked.items()},
                             mine[i] if mine is not None else None))
    caches.append(inner)
  out_cache[node.uid] = tuple(caches)
  return out

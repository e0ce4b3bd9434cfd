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

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sexpgpu.ir.graph import Graph, Node, walk
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.ir.printer import print_graph
from sexpgpu.lower.rules import lowering

class NoRule(Exception):
  """A node that mixes positions and has no incremental rule."""

  def __init__(self, node: Node, why: str):
    super().__init__(f"{node.op} at {node.loc or node.scope}: {why}")
    self.node = node
    self.why = why

  def describe(self) -> str:
    where = f" ({self.node.loc})" if self.node.loc is not None else ""
    return f"`{self.node.op}`{where} {self.why}"


@dataclasses.dataclass
class Plan:
  """The time axis of every node (uid → axis or None) and the special nodes."""

  graph: Graph
  window: int
  axes: dict[int, int | None]
  tables: set[int]  # position-table slices read at the offset
  iotas: set[int]  # iota(W) read as the offset
  attention: list[Node]  # sdpa nodes keeping a cache
  # sdpa uid → (keys, values, n): grouped-query attention whose keys and values are those
  # nodes' [b kv t dh] with each head repeated n times; the cache keeps the kv heads only
  grouped: dict[int, tuple[Node, Node, int]] = dataclasses.field(default_factory=dict)
  # node uid → what it keeps between calls along positions: "running" (a cumsum's or
  # cumprod's total), "recurrence" (a linear recurrence's last state), "window" (the last
  # (kernel - 1) × dilation inputs of a causal conv)
  carries: dict[int, str] = dataclasses.field(default_factory=dict)


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


_CARRY_ROLES = {"running": "running total kept (carry)", "recurrence": "recurrence state kept (carry)",
                "window": "window cache of the last (kernel-1)×dilation inputs"}


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


def _ax(p: Plan, x) -> int | None:
  return p.axes.get(x.uid) if isinstance(x, Node) else None


def _axis(p: Plan, n: Node) -> int | None:
  W = p.window
  ins = [i for i in n.inputs if isinstance(i, Node)]
  axes = [_ax(p, i) for i in ins]
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


# op name → rule(plan, node, inputs, timed) giving the node's time axis, or the reason the
# op has no incremental rule when an input runs over positions. A rule is asked only for a
# node with such an input; every op of the IR has an entry (tests/test_op_table.py).
DECODE: dict[str, Callable | str] = {}


def register_decode(rule: Callable | str, *ops: str) -> None:
  """Registers the decode rule (or the reason there is none) of `ops`.

  Raises:
    ValueError: an op already has an entry.
  """
  for op in ops:
    if op in DECODE:
      raise ValueError(f"op {op} has a decode rule already")
    DECODE[op] = rule


def register_pointwise(op: str) -> None:
  """Gives `op` the rule of elementwise ops (a user op declared pointwise), replacing any."""
  DECODE[op] = _pointwise


def _pointwise(p: Plan, n: Node, ins, timed) -> int:
  W = p.window
  rank = len(n.shape)
  ends = {a - len(i.shape) for i, a in timed}
  if len(ends) != 1:
    raise NoRule(n, "combines operands whose positions lie on different axes")
  end = ends.pop()
  for i in ins:
    if _ax(p, i) is None and len(i.shape) >= -end and i.shape[end] == W and W > 1:
      if i.op == "param" and len(i.shape) + end == 0:  # a learned table, one row a position
        p.tables.add(i.uid)
        p.axes[i.uid] = 0
        continue
      raise NoRule(n, f"combines positions with a tensor of {W} along them that does "
                   "not depend on the tokens")
  return rank + end


def _sdpa(p: Plan, n: Node, ins, timed) -> int:
  q, k, v = ins[:3]
  if len(ins) > 3:
    raise NoRule(n, "masks segments (packed documents), which decoding does not keep")
  if not n.attr("causal"):
    raise NoRule(n, "is not causal: every position sees the later ones")
  if not all(_ax(p, t) == 2 for t in (q, k, v)):
    raise NoRule(n, "attends along an axis other than positions")
  p.attention.append(n)
  kv = [_repeated_heads(t) for t in (k, v)]
  if kv[0] and kv[1] and kv[0][1] == kv[1][1]:
    p.grouped[n.uid] = (kv[0][0], kv[1][0], kv[0][1])
  return 2


def _reshape(p: Plan, n: Node, ins, timed) -> int:
  (x, a), = timed[:1]
  shape_in, shape_out = x.shape, n.shape
  before = 1
  for d in shape_in[:a]:
    before *= d
  acc = 1
  for b, d in enumerate(shape_out):
    if acc == before and d == shape_in[a]:
      return b
    acc *= d
  raise NoRule(n, "merges positions with another axis")


def _transpose(p, n, ins, timed):
  return list(n.attr("perm")).index(timed[0][1])


def _broadcast(p, n, ins, timed):  # new axes in front, as numpy's
  x, a = timed[0]
  return a + len(n.shape) - len(x.shape)


def _expand(p, n, ins, timed):
  a = timed[0][1]
  ax = n.attr("axis") % len(n.shape)
  return a + 1 if ax <= a else a


def _squeeze(p, n, ins, timed):
  x, a = timed[0]
  ax = n.attr("axis") % len(x.shape)
  if ax == a:
    raise NoRule(n, "removes the axis of positions")
  return a - 1 if ax < a else a


def _along(why: str, attr: str = "axis"):
  """The rule of an op that works along one axis: positions pass through any other axis."""
  def rule(p, n, ins, timed):
    x, a = timed[0]
    if timed[0][0] is not ins[0] or (n.attr(attr) % len(x.shape)) == a:
      raise NoRule(n, why)
    return a
  return rule


def _along_last(why: str):
  def rule(p, n, ins, timed):
    x, a = timed[0]
    if a == len(x.shape) - 1:
      raise NoRule(n, why)
    return a
  return rule


def _reduction(p, n, ins, timed):
  x, a = timed[0]
  axes = n.attr("axes") if n.op != "argmax" else (n.attr("axis"),)
  axes = tuple(range(len(x.shape))) if axes is None or axes == (None,) else (
      (axes,) if isinstance(axes, int) else tuple(axes))
  axes = {ax % len(x.shape) for ax in axes}
  if a in axes:
    raise NoRule(n, "reduces over positions")
  return a if n.attr("keep") else a - sum(1 for ax in axes if ax < a)


def _take(p, n, ins, timed):
  if timed[0][0] is ins[0]:
    raise NoRule(n, "gathers from a tensor along positions")
  return timed[0][1]


def _concat(p, n, ins, timed):
  a = timed[0][1]
  if n.attr("axis") % len(n.shape) == a or len({ax for _, ax in timed}) != 1:
    raise NoRule(n, "joins along positions")
  return a


def _matmul(p, n, ins, timed):
  A, B = ins
  aa, ab = _ax(p, A), _ax(p, B)
  if ab is not None and ab >= len(B.shape) - 2:
    raise NoRule(n, "multiplies by a matrix over positions")
  if aa is not None and aa == len(A.shape) - 1:
    raise NoRule(n, "sums over positions")
  if aa is not None:
    return len(n.shape) - (len(A.shape) - aa)
  return len(n.shape) - (len(B.shape) - ab)


def _einsum(p, n, ins, timed):
  lhs, out = n.attr("spec").replace(" ", "").split("->")
  letters = set()
  for term, t in zip(lhs.split(","), ins):
    ta = _ax(p, t)
    if ta is not None:
      letters.add(term[ta])
  if len(letters) != 1 or next(iter(letters)) not in out:
    raise NoRule(n, "sums over positions (attention that is not one sdpa region)")
  return out.index(letters.pop())


def _last_two(why: str):
  def rule(p, n, ins, timed):
    x, a = timed[0]
    if a >= len(x.shape) - 2:
      raise NoRule(n, why)
    return a
  return rule


def _per_axis(attr: str, keeps, why: str):
  """Positions pass through when the op leaves their axis as it is (`keeps(value)`)."""
  def rule(p, n, ins, timed):
    x, a = timed[0]
    if not keeps(n.attr(attr)[a]):
      raise NoRule(n, why)
    return a
  return rule


def _spatial(why: str):
  """conv and pooling: positions pass through the batch axis only."""
  def rule(p, n, ins, timed):
    x, a = timed[0]
    if timed[0][0] is not ins[0] or a != 0:
      raise NoRule(n, why)
    return a
  return rule


def _running(p, n, ins, timed):
  x, a = timed[0]
  if n.attr("axis") % len(x.shape) != a:
    return a
  if n.attr("reverse"):
    raise NoRule(n, "runs backwards along positions: each sees the later ones")
  p.carries[n.uid] = "running"
  return a


def _recurrence(p, n, ins, timed):
  axes = {a for _, a in timed}
  if len(axes) != 1 or len(timed) != 2:
    raise NoRule(n, "combines operands whose positions lie on different axes")
  a = axes.pop()
  if n.attr("axis") % len(n.shape) != a:
    return a
  if n.attr("reverse"):
    raise NoRule(n, "runs backwards along positions: each sees the later ones")
  p.carries[n.uid] = "recurrence"
  return a


def _conv(p, n, ins, timed):
  x, a = timed[0]
  if x is not ins[0] or len(timed) > 1:
    raise NoRule(n, "convolves with a kernel that depends on the tokens")
  if a == 0:
    return a
  strides = n.attr("stride")
  strides = (strides,) if isinstance(strides, int) else tuple(strides)
  if len(x.shape) != 3 or a != 1 or n.attr("padding") != "causal" or set(strides) != {1}:
    raise NoRule(n, "convolves over positions without causal padding and stride 1")
  p.carries[n.uid] = "window"
  return a


def _scatter(p, n, ins, timed):
  x, a = timed[0]
  if x is not ins[0] or len(timed) > 1 or a == 0:
    raise NoRule(n, "scatters along positions")
  return a


register_decode(
    _pointwise, "+", "-", "*", "/", "pow", "max", "min", "mod", "neg", "abs", "exp", "log",
    "sqrt", "rsqrt", "square", "tanh", "cos", "sin", "sigmoid", "relu", "gelu", "silu", "erf",
    "softplus", "log1p", "expm1", "floor", "ceil", "round", "sign", "isfinite", "logical-not",
    "logical-and", "logical-or", "<", "<=", ">", ">=", "=", "!=", "where", "cast", "clip",
    "dropout", "tap", "stop-gradient")
register_decode(_sdpa, "sdpa")
register_decode(_reshape, "reshape")
register_decode(_transpose, "transpose")
register_decode(_broadcast, "broadcast")
register_decode(_expand, "expand")
register_decode(_squeeze, "squeeze")
register_decode(_along("slices positions"), "slice")
register_decode(_reduction, "sum", "mean", "max-of", "min-of", "logsumexp", "argmax")
register_decode(_along("normalizes over positions"), "softmax", "log-softmax")
register_decode(_take, "take")
register_decode(lambda p, n, ins, timed: timed[0][1], "one-hot")
register_decode(_concat, "concat")
register_decode(_matmul, "matmul")
register_decode(_einsum, "einsum")
register_decode(_along("sorts along positions"), "sort", "argsort")
register_decode(_along("gathers along positions"), "take-along")
register_decode(_running, "cumsum", "cumprod")
register_decode(_recurrence, "linear-recurrence")
register_decode(_along("reverses positions"), "flip")
register_decode(_along_last("chooses among positions"), "top-k", "top-k-indices")
register_decode(_last_two("keeps a triangle of positions"), "tril", "triu")
register_decode(_per_axis("reps", lambda r: r == 1, "tiles positions"), "tile")
register_decode(_per_axis("widths", lambda w: tuple(w) == (0, 0), "pads positions"), "pad")
register_decode(_scatter, "scatter-add")
register_decode(_conv, "conv")
register_decode(_spatial("pools over positions"), "max-pool", "avg-pool")
register_decode("mixes positions (a mask over them outside one sdpa region)",
                "causal-mask", "segment-mask")
register_decode("reduces over positions (a loss, not logits)",
                "cross-entropy", "chunked-cross-entropy")
register_decode("has no tensor inputs, so none runs over positions", "full", "iota",
                "bernoulli", "random-normal", "random-uniform", "random-int",
                "random-permutation")


def _repeated_heads(x: Node) -> tuple[Node, int] | None:
  """(source [b kv t dh], n) when `x` is the source's heads each repeated n times in a row
  (`repeat-heads`: reshape(broadcast(expand(source, 2), [b kv n t dh]), [b kv·n t dh]))."""
  if x.op != "reshape" or not isinstance(x.inputs[0], Node):
    return None
  bc = x.inputs[0]
  if bc.op != "broadcast" or not isinstance(bc.inputs[0], Node):
    return None
  ex = bc.inputs[0]
  if ex.op != "expand" or ex.attr("axis") % len(ex.shape) != 2 or not isinstance(
      ex.inputs[0], Node):
    return None
  src = ex.inputs[0]
  if len(src.shape) != 4 or len(bc.shape) != 5:
    return None
  b, kv, t, dh = src.shape
  n = bc.shape[2]
  if tuple(bc.shape) != (b, kv, n, t, dh) or tuple(x.shape) != (b, kv * n, t, dh):
    return None
  return src, n


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
  env: dict[int, Any] = {}
  valid = tokens.shape[-1] if valid is None else valid
  _run(p, p.graph.nodes(), env, params, tokens, ctx, cache, out_cache, offset, valid)
  return env[p.graph.outputs["out"].uid], out_cache


def empty_cache(p: Plan, params: dict, ctx: LowerCtx, batch: int = 1) -> dict:
  """Zeros in the shape of the cache a whole-window call returns (for a chunked prefill)."""
  shapes = jax.eval_shape(lambda prm: run(p, prm, jnp.zeros((batch, p.window), jnp.int32),
                                          ctx, None)[1], params)
  return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _run(p, nodes, env, params, tokens, ctx, cache, out_cache, offset, valid):
  step = cache is not None
  span = tokens.shape[-1]  # positions this call computes, from `offset` on
  for n in nodes:
    if n.uid in env:
      continue
    op = n.op
    if op == "param":
      value = params[n.attr("path")]
      if step and n.uid in p.tables:
        value = jax.lax.dynamic_slice_in_dim(value, offset, span, axis=0)
      env[n.uid] = value
      continue
    if op == "input":
      env[n.uid] = tokens
      continue
    if op == "repeat":
      env[n.uid] = _repeat(p, n, env, params, tokens, ctx, cache, out_cache, offset, valid)
      continue
    args = [env[i.uid] if isinstance(i, Node) else i for i in n.inputs]
    attrs = dict(n.attrs)
    if op == "sdpa":
      group = p.grouped.get(n.uid)
      sources = (env[group[0].uid], env[group[1].uid], group[2]) if group else None
      env[n.uid] = _attend(n, args, attrs, ctx, cache, out_cache, offset, sources)
      continue
    if n.uid in p.carries:
      env[n.uid] = _carry(p.carries[n.uid], n, args, attrs, ctx, cache, out_cache, valid)
      continue
    if step and n.uid in p.iotas:
      env[n.uid] = offset + jnp.arange(span, dtype=jnp.int32)
      continue
    if step and n.uid in p.tables:
      env[n.uid] = jax.lax.dynamic_slice_in_dim(args[0], offset, span, axis=attrs["axis"])
      continue
    if step and op in ("reshape", "broadcast") and p.axes.get(n.uid) is not None:
      shape = list(attrs["shape"])
      shape[p.axes[n.uid]] = span
      attrs["shape"] = tuple(shape)
    env[n.uid] = lowering(op, ctx.platform)(ctx, *args, **attrs)


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
  body = node.attr("body")
  stacked = {k: params[k] for k in body.params}
  outer = {k: v for k, v in params.items() if k not in stacked}
  nodes = list(walk([body.output]))
  mine = cache.get(node.uid) if cache is not None else None

  def layer(carry, xs):
    layer_params, layer_cache = xs
    local = dict(env)
    local[body.carry.uid] = carry
    inner: dict = {}
    _run(p, nodes, local, {**outer, **layer_params}, tokens, ctx, layer_cache, inner, offset,
         valid)
    return local[body.output.uid], inner

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

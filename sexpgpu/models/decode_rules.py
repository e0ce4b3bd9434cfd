"""The decode table: what each op does along the time axis, one entry an op.

An entry is a rule `rule(plan, node, inputs, timed)` giving the node's time axis (and
noting in the plan what the step must keep: a key/value cache, a carry, a row read at the
offset), or the reason the op has no incremental rule when an input runs over positions.
`models.decode` walks a graph through this table; tests/test_op_table.py checks that every
op of the IR has an entry.
"""

from __future__ import annotations

import dataclasses

from sexpgpu.ir.graph import Graph, Node
from sexpgpu.ir.opdef import OPS, OpTable


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
  # (kernel - 1) × dilation inputs of a causal conv), "scan" (a scan's carry),
  # "combination" (an associative scan's combination of the positions so far)
  carries: dict[int, str] = dataclasses.field(default_factory=dict)


def time_axis(p: Plan, x) -> int | None:
  """The time axis the plan gave `x`, None for a constant or a value with none."""
  return p.axes.get(x.uid) if isinstance(x, Node) else None


# op name → rule(plan, node, inputs, timed) giving the node's time axis, or the reason the
# op has no incremental rule when an input runs over positions. A rule is asked only for a
# node with such an input; every op of the IR has an entry (tests/test_op_table.py).
DECODE = OpTable("decode", "sexpgpu/models/decode_rules.py")  # kinds' defaults: below
register_decode = DECODE.register


def _pointwise(p: Plan, n: Node, ins, timed) -> int:
  W = p.window
  rank = len(n.shape)
  ends = {a - len(i.shape) for i, a in timed}
  if len(ends) != 1:
    raise NoRule(n, "combines operands whose positions lie on different axes")
  end = ends.pop()
  for i in ins:
    if time_axis(p, i) is None and len(i.shape) >= -end and i.shape[end] == W and W > 1:
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
  if not all(time_axis(p, t) == 2 for t in (q, k, v)):
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
  aa, ab = time_axis(p, A), time_axis(p, B)
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
    ta = time_axis(p, t)
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


def _scan(p, n, ins, timed):
  """A scan along positions keeps its carry (an associative scan, its running combination);
  its function sees one position at a time, so nothing inside it runs over positions."""
  k, m = n.attr("carries"), n.attr("operands")
  if any(time_axis(p, i) is not None for i in ins[m:]):
    raise NoRule(n, "reads values along positions inside its function")
  if any(time_axis(p, i) is not None for i in ins[:k]):
    raise NoRule(n, "starts its carry from values along positions")
  if {time_axis(p, x) for x in ins[k:m]} != {n.attr("axis")}:
    raise NoRule(n, "scans along an axis other than positions, or not all its inputs run"
                 " over positions")
  if n.attr("reverse"):
    raise NoRule(n, "runs backwards along positions: each sees the later ones")
  p.carries[n.uid] = "scan" if n.op == "scan" else "combination"
  return n.attr("axis")


def part_axis(p: Plan, n: Node) -> int | None:
  """The time axis of value `index` of a scan's: its stacked outputs keep the scan's; a
  scan's last carry along positions is none that decoding keeps per position."""
  src = n.inputs[0]
  axis = p.axes.get(src.uid)
  if axis is None:
    return None
  if n.attr("index") < src.attr("carries"):
    raise NoRule(n, "is a scan's carry after the last position: it depends on every position")
  return axis


def _scatter(p, n, ins, timed):
  x, a = timed[0]
  if x is not ins[0] or len(timed) > 1 or a == 0:
    raise NoRule(n, "scatters along positions")
  return a


DECODE.register_kind(_pointwise, "pointwise")
DECODE.register_kind(_reduction, "reduction")
DECODE.register_kind(_spatial("pools over positions"), "window")
DECODE.register_kind("mixes positions (a mask over them outside one sdpa region)", "mask")
DECODE.register_kind("reduces over positions (a loss, not logits)", "loss")
DECODE.register_kind("has no tensor inputs, so none runs over positions", "constant", "random")
register_decode(_sdpa, "sdpa")
register_decode(_reshape, "reshape")
register_decode(_transpose, "transpose")
register_decode(_broadcast, "broadcast")
register_decode(_expand, "expand")
register_decode(_squeeze, "squeeze")
register_decode(_along("slices positions"), "slice")
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
register_decode(_scan, "scan", "associative-scan")
register_decode("reduces over positions (a loss, not logits)", "chunked-cross-entropy")


def _opaque(p, n, ins, timed):
  raise NoRule(n, f"is an op written in Python ({OPS[n.op].source}) that is not declared "
               'kind="pointwise": no incremental rule')


DECODE.register_kind(_opaque, "opaque")


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

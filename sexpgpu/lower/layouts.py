"""Layouts past FSDP: a mesh of named axes, each op's split rule, and Megatron's pairs.

`:sharding` takes a mesh, `fsdp:2,tensor:2` (axes data, fsdp, tensor, expert; their
product is the device count; parsed and checked in sexpgpu/lang/mesh.py). Each parameter's PartitionSpec comes from the graph:

- SPLIT, an op table as lower/flops.py's FLOPS (a default rule for each kind of op, and
  the ops that are its exceptions): for every op, how a split axis of its inputs maps to
  its output (an axis, SUM when the op sums over it, None when the split cannot pass), or
  the reason it takes no split;
- `find_pairs` walks the training graph with those rules: a matmul by a parameter
  [in out] starts a split of its columns; through ops that keep it (pointwise, the
  reshape to heads, sdpa over heads) it reaches a matmul by a parameter [in out] that
  sums it, whose rows split (Megatron's pair), or a softmax over the vocabulary (an
  untied head). An embedding table read by `take` splits on the vocabulary;
- `param_specs`: those parameters split on `tensor`, and the `fsdp` axis splits the
  largest remaining axis as `fsdp.spec_for` does; a stacked repeat's layer axes stay
  whole. Everything else about the step is fsdp.py's: XLA's partitioner places the
  collectives. Numbers do not depend on the pairs found (the partitioner is exact for
  any placement); only the bytes a device holds and the collectives do.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

from sexpgpu.errors import SxError
from sexpgpu.ir.graph import Graph, Node, walk
from sexpgpu.ir.opdef import OPS, OpTable

# the axes the batch splits over (and `node`, outermost, over several nodes)
DATA_AXES = ("node", "data", "fsdp", "expert")
SUM = "sum"  # a rule's answer when the op sums over the split axis (a pair's end)


# --- the rules ---------------------------------------------------------------------------
# op name → rule(node, axes) → the output's split axis, SUM or None, given each input's
# split axis (None: not split, or not a tensor); or the reason the op takes no split.
Rule = Callable[[Node, tuple], "int | str | None"]


def _opaque(node: Node, axes) -> None:
  """An op written in Python that is not pointwise: a split ends before it."""
  return None


def _rank(x) -> int:
  return len(x.shape) if isinstance(x, Node) else 0


def _one(axes) -> tuple[int, int] | None:
  """(input index, axis) of the one split input; None when inputs are split on several."""
  split = [(i, a) for i, a in enumerate(axes) if a is not None]
  return split[0] if len(split) == 1 else None


def _pointwise(node: Node, axes) -> int | None:
  """Every axis kept, inputs aligned from the right (broadcasting)."""
  outs = {len(node.shape) - _rank(node.inputs[i]) + a for i, a in enumerate(axes)
          if a is not None}
  return outs.pop() if len(outs) == 1 else None


def _reduce(node: Node, axes) -> int | str | None:
  """Kept unless reduced over (then the op sums a split axis: SUM)."""
  a = axes[0]
  x = node.inputs[0]
  over = node.attr("axes", node.attr("axis"))
  over = tuple(range(len(x.shape))) if over is None else (
      (over,) if isinstance(over, int) else tuple(over))
  over = {o % len(x.shape) for o in over}
  if a in over:
    return SUM
  return a if node.attr("keep", True) and len(node.shape) == len(x.shape) else \
      a - sum(1 for o in over if o < a)


def _along(node: Node, axes) -> int | None:
  """Kept unless the op runs along the split axis (a sort, a cumulative sum, a slice)."""
  a = axes[0]
  axis = node.attr("axis")
  return None if axis is not None and axis % len(node.inputs[0].shape) == a else a


def _matmul(node: Node, axes) -> int | str | None:
  a, b = node.inputs[:2]
  sa, sb = axes[:2]
  if sa is not None and sa == len(a.shape) - 1:
    return SUM if sb in (None, len(b.shape) - 2) else None
  if sb is not None:
    return len(node.shape) - 1 if sb == len(b.shape) - 1 and sa is None else None
  return len(node.shape) - len(a.shape) + sa


def _reshape(node: Node, axes) -> int | None:
  """The split moves to the output axis that starts where it starts and divides it (the
  reshape of [.. width] to [.. heads dhead] moves it to heads)."""
  shape, out = node.inputs[0].shape, node.shape
  a = axes[0]
  before = math.prod(shape[:a])
  for j in range(len(out)):
    if math.prod(out[:j]) == before and out[j] > 1 and shape[a] % out[j] == 0 or \
        math.prod(out[:j]) == before and out[j] % shape[a] == 0 and out[j] > 1:
      return j
  return None


def _transpose(node: Node, axes) -> int:
  return list(node.attr("perm")).index(axes[0])


def _sdpa(node: Node, axes) -> int | None:
  """Keeps the heads axis (-3 of [.. heads seq dhead]) when q, k and v split there."""
  heads = [len(x.shape) - 3 for x in node.inputs[:3]]
  if all(axes[i] == heads[i] for i in range(3)):
    return len(node.shape) - 3
  return None


def _letters(node: Node) -> tuple[list[str], str] | None:
  """An einsum's operands' letters and its output's (None with an ellipsis)."""
  spec = node.attr("spec").replace(" ", "")
  if "..." in spec:
    return None
  lhs, out = spec.split("->")
  return lhs.split(","), out


def _einsum(node: Node, axes) -> int | str | None:
  """The split letter kept where the output has it, else summed over (SUM)."""
  got = _letters(node)
  if got is None:
    return None
  subs, out = got
  letters = {sub[a] for sub, a in zip(subs, axes) if a is not None}
  if len(letters) != 1:
    return None
  letter = letters.pop()
  return out.index(letter) if letter in out else SUM


def _take(node: Node, axes) -> int | None:
  table, idx = node.inputs
  if axes[0] is not None:  # a table split on its width: the rows keep it
    return len(node.shape) - 1 if axes[0] == len(table.shape) - 1 and axes[1] is None else None
  return axes[1]


def _expand(node: Node, axes) -> int:
  axis = node.attr("axis") % len(node.shape)
  return axes[0] + (1 if axes[0] >= axis else 0)


def _squeeze(node: Node, axes) -> int | None:
  axis = node.attr("axis") % len(node.inputs[0].shape)
  return None if axes[0] == axis else axes[0] - (1 if axes[0] > axis else 0)


def _first(node: Node, axes) -> int | None:
  """The split of the first input, kept when it is the only one (masks, dropout, taps)."""
  return axes[0] if all(a is None for a in axes[1:]) else None


def _stops(node: Node, axes) -> None:
  return None


def _last_two(node: Node, axes) -> int | None:
  """Kept outside the last two axes (triangles of a matrix, masks of scores)."""
  a = _first(node, axes)
  return a if a is not None and a < len(node.shape) - 2 else None


# Every kind's default, and the ops that are its exceptions. An op written in Python gets
# its kind's rule as the table's own ops do.
SPLIT = OpTable("split", "sexpgpu/lower/layouts.py", {
    "pointwise": _pointwise, "reduction": _reduce, "along": _along, "mask": _last_two,
    "product": "a product without a rule of its own takes no split",
    "loss": lambda n, axes: SUM if axes[0] == len(n.inputs[0].shape) - 1 else _first(n, axes),
    "window": _stops, "opaque": _opaque,
    "function": "a split does not enter a scan's function: its parameters stay as fsdp "
                "places them",
    "constant": "makes a value from no input, so nothing is split",
    "random": "makes a value from no input, so nothing is split"})
register_split = SPLIT.register
register_split(_pointwise, "broadcast")
register_split(_reduce, "softmax", "log-softmax")
register_split(_along, "slice", "flip", "concat", "take-along")
register_split(_matmul, "matmul")
register_split(_reshape, "reshape")
register_split(_transpose, "transpose")
register_split(_sdpa, "sdpa")
register_split(_take, "take")
register_split(_expand, "expand")
register_split(_squeeze, "squeeze")
register_split(_first, "dropout", "tap", "one-hot", "segment-mask", "tile")
register_split(_last_two, "tril", "triu")
register_split(_stops, "top-k", "top-k-indices", "pad", "scatter-add", "conv",
               "chunked-cross-entropy")
register_split(lambda n, axes: _einsum(n, axes), "einsum")

# What the pair finder reads an op as: a product by a weight matrix (a pair's start or end),
# an embedding's gather, an einsum of expert weights, or a normalization over the vocabulary
# that ends an untied head's split.
ROLES = OpTable("tensor-parallel role", "sexpgpu/lower/layouts.py", complete=False)
ROLES.register("weights", "matmul")
ROLES.register("embedding", "take")
ROLES.register("experts", "einsum")
ROLES.register("vocabulary", "softmax", "log-softmax", "logsumexp", "cross-entropy")


# --- Megatron's pairs --------------------------------------------------------------------
@dataclasses.dataclass
class Pairs:
  """What `find_pairs` found: parameter path → (per-layer axis split on `tensor`, why),
  the expert weights (path → per-layer axis split on `expert`), and the sizes a split
  must divide as (size, what), for `tensor` and for `expert`."""

  split: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
  sizes: list[tuple[int, str]] = dataclasses.field(default_factory=list)
  experts: dict[str, int] = dataclasses.field(default_factory=dict)
  expert_sizes: list[tuple[int, str]] = dataclasses.field(default_factory=list)
  # an expert einsum's uid → (its token operand's index, that operand's expert axis, the
  # output's): where the step holds the tokens on `expert` (lower/fsdp.py)
  dispatch: dict[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
  # sequence parallel (lower/fsdp.py): the uids of the pairs' ends (a row half's matmul, an
  # embedding's take), whose output is split on the sequence, and of their starts (a column
  # half's matmul), whose input is gathered whole
  ends: set = dataclasses.field(default_factory=set)
  starts: set = dataclasses.field(default_factory=set)
  # inside the pairs: a value's uid → its axis split on `tensor` (columns, heads, vocabulary)
  inner: dict = dataclasses.field(default_factory=dict)
  # the uids of the row halves' products, of the embeddings' gathers, and of the products by
  # a head's weights split on the vocabulary (run/planning/layout_plan.py sizes their values)
  rows: set = dataclasses.field(default_factory=set)
  embeds: set = dataclasses.field(default_factory=set)
  heads: set = dataclasses.field(default_factory=set)


def _is_param(x) -> bool:
  return isinstance(x, Node) and x.op == "param" and len(x.shape) == 2


def _walk_body(nodes: list[Node], out: Pairs, starts: dict, inner: dict) -> None:
  # uid → (axis, column parameters, sizes on the way); `starts`: a matmul's uid → the
  # parameter whose columns it would split; `inner`: every value so split, uid → (axis,
  # the columns it comes from)
  state: dict[int, tuple[int, frozenset, tuple]] = {}
  for node in nodes:
    if node.op == "repeat":
      _walk_body(list(walk([node.attr("body").output])), out, starts, inner)
      continue
    ins = [state.get(i.uid) if isinstance(i, Node) else None for i in node.inputs]
    role = ROLES.get(node.op)
    if role == "experts" and _letters(node) is not None:  # an MoE layer's [experts ..]
      subs, letters = _letters(node)
      for i, (sub, x) in enumerate(zip(subs, node.inputs)):
        if (isinstance(x, Node) and x.op == "param" and len(x.shape) >= 3 and sub[0] in letters
            and any(sub[0] in o for j, o in enumerate(subs) if j != i)):
          out.experts[x.attr("path")] = 0
          other = next(j for j, o in enumerate(subs) if j != i and sub[0] in o)
          out.dispatch[node.uid] = (other, subs[other].index(sub[0]), letters.index(sub[0]))
          out.expert_sizes.append((x.shape[0], f"the {x.shape[0]} experts of {x.attr('path')}"))
    if role == "embedding" and _is_param(node.inputs[0]):
      t = node.inputs[0]
      out.split[t.attr("path")] = (0, "vocabulary")
      out.sizes.append((t.shape[0], f"the vocabulary of {t.attr('path')}"))
      out.ends.add(node.uid)
      out.embeds.add(node.uid)
    if role == "weights" and _is_param(node.inputs[1]) and ins[0] is None:
      w = node.inputs[1]
      starts[node.uid] = w.attr("path")
      state[node.uid] = (len(node.shape) - 1, frozenset([w.attr("path")]),
                         ((w.shape[1], f"the {w.shape[1]} columns of {w.attr('path')}"),))
      inner[node.uid] = state[node.uid][:2]
      continue
    if all(s is None for s in ins):
      continue
    rule = SPLIT.get(node.op)
    if not callable(rule):
      continue
    got = rule(node, tuple(s[0] if s else None for s in ins))
    cols = frozenset().union(*(s[1] for s in ins if s))
    sizes = tuple(x for s in ins if s for x in s[2])
    if got == SUM:
      if role == "weights" and _is_param(node.inputs[1]):  # the pair's row half
        w = node.inputs[1]
        out.split[w.attr("path")] = (0, "rows")
        out.ends.add(node.uid)
        out.rows.add(node.uid)
        out.sizes += list(sizes) + [(w.shape[0], f"the {w.shape[0]} rows of {w.attr('path')}")]
        out.split.update({c: (1, "columns") for c in cols if c not in out.split})
      elif role == "vocabulary":
        why = "vocabulary" if OPS[node.op].kind == "loss" else "softmax"
        out.split.update({c: (1, why) for c in cols if c not in out.split})
        out.sizes += list(sizes)
    elif got is not None:
      x = node.inputs[0]
      if ins[0] is not None and len(node.shape) > len(x.shape) and \
          node.shape[got] < x.shape[ins[0][0]]:  # a reshape of [.. width] to [.. heads dhead]
        sizes += ((node.shape[got], f"the {node.shape[got]} heads after {node.op} at "
                   f"{node.loc or node.scope}"),)
      state[node.uid] = (got, cols, sizes)
      inner[node.uid] = (got, cols)


def find_pairs(graph: Graph) -> Pairs:
  """The tensor-parallel split of each parameter the rules find in `graph` (above)."""
  out, starts, inner = Pairs(), {}, {}
  _walk_body(graph.nodes(), out, starts, inner)
  columns = {path for path, (axis, _) in out.split.items() if axis == 1}
  out.starts = {uid for uid, path in starts.items() if path in columns}
  out.heads = {uid for uid, path in starts.items()
               if out.split.get(path, (0, ""))[1] in ("vocabulary", "softmax")}
  out.inner = {uid: axis for uid, (axis, cols) in inner.items() if cols and cols <= columns}
  return out


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def param_specs(graph: Graph, params: dict, mesh: tuple[tuple[str, int], ...]) -> dict:
  """Each parameter's PartitionSpec (full shape, stack axes first) under `mesh`.

  Raises:
    SxError: E-KNOB-003 when the tensor size does not divide a size the pairs split,
      naming that size and the tensor sizes that would divide it.
  """
  from jax.sharding import PartitionSpec as P
  sizes = dict(mesh)
  t, f, x = sizes.get("tensor", 1), sizes.get("fsdp", 1), sizes.get("expert", 1)
  pairs = find_pairs(graph) if t > 1 or x > 1 else Pairs()
  text = ",".join(f"{a}:{s}" for a, s in mesh)
  for axis, n, split in (("tensor", t, pairs.sizes), ("expert", x, pairs.expert_sizes)):
    for size, what in split if n > 1 else ():
      if size % n:
        fit = [d for d in divisors(math.gcd(*[s for s, _ in split])) if d > 1]
        raise SxError("E-KNOB-003", f"{axis}:{n} does not divide {what} ({size})",
                      where=f"--set sharding={text}",
                      fix=f"{axis} sizes that divide {size}: "
                      + ", ".join(map(str, divisors(size)))
                      + (f"; every size the rules split: {', '.join(map(str, fit))}"
                         if fit else ""))
  out = {}
  for path, p in params.items():
    shape, skip = tuple(p.full_shape), len(p.stack)
    spec: list = [None] * len(shape)
    if x > 1 and path in pairs.experts:
      spec[skip + pairs.experts[path]] = "expert"
    elif t > 1 and path in pairs.split:
      spec[skip + pairs.split[path][0]] = "tensor"
    if f > 1:
      best = None
      for i in range(skip, len(shape)):
        if spec[i] is None and shape[i] % f == 0 and (best is None or shape[i] > shape[best]):
          best = i
      if best is not None:
        spec[best] = "fsdp"
    out[path] = P(*spec) if any(s is not None for s in spec) else P()
  return out


def make_mesh(devices: list, mesh: tuple[tuple[str, int], ...]):
  """A jax Mesh of the devices in their order, with the named axes as written."""
  import numpy as np
  from jax.sharding import Mesh
  return Mesh(np.array(devices).reshape([s for _, s in mesh]), tuple(a for a, _ in mesh))


def spec_text(spec) -> str:
  """`P(None, 'tensor')` written short: `(·, tensor)`, or `replicated`."""
  parts = tuple(spec)
  if not any(parts):
    return "replicated"
  return "(" + ", ".join("·" if a is None else (a if isinstance(a, str) else "+".join(a))
                         for a in parts) + ")"


# --- the collectives of a compiled step ----------------------------------------------------
_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")
_ARRAY = re.compile(r"(pred|[su]8|[su]16|[su]32|[su]64|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def collectives(hlo: str) -> list[tuple[str, int]]:
  """(kind, bytes of its result) of each collective in a compiled module's text; an async
  all-gather's result is its pair (operand, gathered), of which the gathered counts. A
  loop's body counts once, as in XLA's cost analysis."""
  out = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    arrays = [_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
              for t, dims in _ARRAY.findall(m.group(1))]
    if m.group(3) and m.group(2) == "all-gather":
      arrays = arrays[len(arrays) // 2:]
    out.append((m.group(2), sum(arrays)))
  return out

"""Graph IR: immutable, hash-consed nodes; parameters; graphs with repeat and scan bodies."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator

from sexpgpu.errors import Loc

_ids = itertools.count()


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
  """One value of the graph.

  Attributes:
    op: a primitive name from `ir.ops.OPS`, or a leaf/structural op:
      "input" (a batch field), "param" (a parameter), "carry" (a repeat body's
      input, or a scan function's argument), "repeat" (a repeated body), "scan" and
      "associative-scan" (a function over an axis: several values, dtype "tuple"), "part"
      (value `index` of a scan's).
    inputs: tensor inputs (Nodes) or weakly typed literals (int, float, bool).
    attrs: static attributes, a tuple of (name, value) pairs, sorted by name.
    dtype: the IR dtype name ("f32", "i32", "bool", ...).
    shape: the static shape.
    loc: the `.sx` place that built it.
    scope: the parameter scope path it was built in ("lm/transformer-lm").
  """

  op: str
  inputs: tuple[Any, ...]
  attrs: tuple[tuple[str, Any], ...]
  dtype: str
  shape: tuple[int, ...]
  loc: Loc | None
  scope: str
  uid: int = dataclasses.field(default_factory=lambda: next(_ids))

  def attr(self, name: str, default: Any = None) -> Any:
    """The attribute `name`, or `default` when the node has none."""
    for k, v in self.attrs:
      if k == name:
        return v
    return default

  @property
  def type_str(self) -> str:
    if self.dtype == TUPLE:
      return "(" + " ".join(type_str(d, s) for d, s in self.attr("types")) + ")"
    return type_str(self.dtype, self.shape)

  def __hash__(self) -> int:
    return self.uid

  def __repr__(self) -> str:
    return f"<{self.op}:{self.type_str} #{self.uid}>"


# The dtype of a node holding several values (a scan's), each read by a "part" node; its
# attribute "types" holds each value's (dtype, shape).
TUPLE = "tuple"


def type_str(dtype: str, shape: tuple[int, ...]) -> str:
  """`f32[4,16,64]`."""
  return f"{dtype}[{','.join(str(d) for d in shape)}]"


@dataclasses.dataclass(frozen=True)
class Init:
  """A parameter initializer: kind in zeros, ones, constant, normal, truncated-normal, uniform, fan-in."""

  kind: str
  value: float = 0.0

  def __str__(self) -> str:
    return self.kind if self.kind in ("zeros", "ones") else f"({self.kind} {self.value:g})"


@dataclasses.dataclass(frozen=True)
class Param:
  """A trained parameter: its path, per-layer shape, the repeat axes stacked in front."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  init: Init
  loc: Loc | None
  stack: tuple[int, ...] = ()

  @property
  def full_shape(self) -> tuple[int, ...]:
    return self.stack + self.shape

  @property
  def count(self) -> int:
    n = 1
    for d in self.full_shape:
      n *= d
    return n


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
  """A repeat's body: its carry input, its output and the parameters it reads."""

  carry: Node
  output: Node
  params: tuple[str, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Fn:
  """A scan's function: its argument leaves ("carry" nodes), its result nodes, and the
  parameters it reads (shared by every trip, not stacked).

  The nodes outside it that it reads are the scan node's inputs after its own operands, so
  every walk of the graph meets them before the scan, and a walk of the body stops there.
  """

  args: tuple[Node, ...]
  results: tuple[Node, ...]
  params: tuple[str, ...]


def walk(outputs: list[Node], stop: frozenset[int] | set[int] = frozenset()) -> Iterator[Node]:
  """Yields every node reachable from `outputs` (not entering bodies), inputs first.

  Args:
    stop: uids of nodes not yielded nor entered (a body's walk stops at the values it reads
      from outside).
  """
  seen: set[int] = set(stop)
  order: list[Node] = []
  stack: list[tuple[Node, bool]] = [(o, False) for o in reversed(outputs) if o.uid not in seen]
  while stack:
    node, done = stack.pop()
    if done:
      order.append(node)
      continue
    if node.uid in seen:
      continue
    seen.add(node.uid)
    stack.append((node, True))
    for i in reversed(node.inputs):
      if isinstance(i, Node) and i.uid not in seen:
        stack.append((i, False))
  return iter(order)


@dataclasses.dataclass
class Graph:
  """One entry function built on abstract inputs.

  Attributes:
    name: what it computes ("loss", "eval/loss", ...).
    inputs: the batch fields, by name, as "input" nodes.
    outputs: named scalar or tensor results.
    params: every parameter the graph reads, by path.
    taps: tap name → nodes recorded by `(tap NAME X)` for selected diagnostics.
  """

  name: str
  inputs: dict[str, Node]
  outputs: dict[str, Node]
  params: dict[str, Param]
  taps: dict[str, list[Node]] = dataclasses.field(default_factory=dict)

  def nodes(self) -> list[Node]:
    roots = list(self.outputs.values()) + [n for ns in self.taps.values() for n in ns]
    return list(walk(roots))


def body_nodes(node: Node) -> list[Node]:
  """The nodes of a scan's function in order, without the outside values it reads (the
  scan's inputs after its own operands)."""
  outside = {i.uid for i in node.inputs[node.attr("operands"):] if isinstance(i, Node)}
  return list(walk(list(node.attr("body").results), outside))

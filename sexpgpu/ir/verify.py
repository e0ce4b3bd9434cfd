"""The verifier: what is legal in the IR, stated once and checked between passes."""

from __future__ import annotations

from sexpgpu.ir.graph import Graph, Node, walk
from sexpgpu.ir.ops import OPS
from sexpgpu.ir.shapes import infer, literal_type

LEAVES = ("input", "param", "carry")


class IRError(Exception):
  """An ill-formed graph: a compiler bug, never a user's mistake."""


def verify(graph: Graph) -> None:
  """Checks every node of `graph` (and of each repeat body).

  Raises:
    IRError: a node whose type disagrees with its op's shape rule, an unknown op, a
      parameter missing from the table, or a repeat body that changes its carry's type.
  """
  roots = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  _verify(roots, graph, set())


def _verify(roots: list[Node], graph: Graph, seen: set[int]) -> None:
  for node in walk(roots):
    if node.uid in seen:
      continue
    seen.add(node.uid)
    if node.op in LEAVES:
      if node.inputs:
        raise IRError(f"{node}: a {node.op} has no inputs")
      if node.op == "param":
        p = graph.params.get(node.attr("path"))
        if p is None or p.shape != node.shape or p.dtype != node.dtype:
          raise IRError(f"{node}: parameter {node.attr('path')} disagrees with the table")
      continue
    if node.op == "repeat":
      body = node.attr("body")
      x = node.inputs[0]
      if not (body.carry.shape == body.output.shape == x.shape == node.shape):
        raise IRError(f"{node}: repeat body changes its carry's shape")
      for path in body.params:
        if path not in graph.params or not graph.params[path].stack:
          raise IRError(f"{node}: body parameter {path} is not stacked in the table")
      _verify([body.output], graph, seen)
      continue
    if node.op not in OPS:
      raise IRError(f"{node}: unknown op {node.op}")
    in_types = tuple(("T", i.dtype, i.shape) if isinstance(i, Node) else literal_type(i)
                     for i in node.inputs)
    dtype, shape = infer(node.op, node.attrs, in_types)
    if (dtype, shape) != (node.dtype, node.shape):
      raise IRError(f"{node}: its op says {dtype}{list(shape)}")

"""The verifier: what is legal in the IR, stated once and checked between passes."""

from __future__ import annotations

from sexpgpu.ir.graph import TUPLE, Fn, Graph, Node, walk
from sexpgpu.ir.opdef import ARGUMENTS
from sexpgpu.ir.ops import OPS
from sexpgpu.ir.shapes import infer, literal_type


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
    if node.op in ARGUMENTS:  # a leaf with no inputs (a part is checked against its tuple below)
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
    if node.op == "part":
      src = node.inputs[0]
      if src.dtype != TUPLE or src.attr("types")[node.attr("index")] != (node.dtype, node.shape):
        raise IRError(f"{node}: a part disagrees with the type of value {node.attr('index')} "
                      f"of {src}")
      continue
    if isinstance(node.attr("body"), Fn):
      _verify_scan(node, graph)
      _verify(list(node.attr("body").results), graph, seen)
      continue
    if node.op not in OPS:
      raise IRError(f"{node}: unknown op {node.op}")
    in_types = tuple(("T", i.dtype, i.shape) if isinstance(i, Node) else literal_type(i)
                     for i in node.inputs)
    dtype, shape = infer(node.op, node.attrs, in_types)
    if (dtype, shape) != (node.dtype, node.shape):
      raise IRError(f"{node}: its op says {dtype}{list(shape)}")


def _types(nodes) -> tuple:
  return tuple((n.dtype, n.shape) for n in nodes)


def _verify_scan(node: Node, graph: Graph) -> None:
  """A scan's function keeps its carry's type, and its node's types are what it makes."""
  body, k, m = node.attr("body"), node.attr("carries"), node.attr("operands")
  axis, types = node.attr("axis"), node.attr("types")
  ops = node.inputs[:m]
  if node.dtype != TUPLE or not ops or not all(isinstance(i, Node) for i in node.inputs):
    raise IRError(f"{node}: a scan holds a tuple of values of its tensor operands")
  xs = ops[k:]
  n = xs[0].shape[axis]
  element = tuple((x.dtype, x.shape[:axis] + x.shape[axis + 1:]) for x in xs)
  if any(x.shape[axis] != n for x in xs):
    raise IRError(f"{node}: its operands differ in length along axis {axis}")
  if node.op == "scan":
    want_args = _types(ops[:k]) + element
    carry, ys = body.results[:k], body.results[k:]
    if _types(carry) != _types(ops[:k]):
      raise IRError(f"{node}: its function changes its carry's type")
    made = _types(ops[:k]) + tuple((y.dtype, y.shape[:axis] + (n,) + y.shape[axis:])
                                   for y in ys)
  else:
    want_args = element + element
    if _types(body.results) != element:
      raise IRError(f"{node}: its function does not return one element of its operands' type")
    made = _types(xs)
  if _types(body.args) != want_args or any(a.op != "carry" for a in body.args):
    raise IRError(f"{node}: its function's arguments are not of its operands' types")
  if tuple(types) != made:
    raise IRError(f"{node}: its types {types} are not those its function makes {made}")
  for path in body.params:
    if path not in graph.params:
      raise IRError(f"{node}: body parameter {path} is not in the table")

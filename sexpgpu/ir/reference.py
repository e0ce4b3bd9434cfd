"""The frozen reference model: a value recomputed with the parameters the run started from.

`(reference x)` (front/reference.py) copies the part of the graph that computes `x`, every
parameter `P` it reads replaced by `reference/P`: a parameter of P's shape that the run fills
with P's starting value and never trains (no gradient, no optimizer state) nor saves (a resume
fills it again from `:init-from`, or the seed, and checks its digest, run/reference.py).
Dropout is off in the copy and its taps are dropped, as TRL evaluates its reference model.
"""

from __future__ import annotations

from sexpgpu.ir.graph import Body, Fn, Node, Param
from sexpgpu.ir.rewrite import Frame, Rewriter

PREFIX = "reference/"


def is_reference(path: str) -> bool:
  """Whether `path` is a reference copy's."""
  return path.startswith(PREFIX)


def reference_of(path: str) -> str:
  """The reference copy's path of the trained parameter `path`."""
  return PREFIX + path


def references(params) -> dict[str, str]:
  """Each reference copy's path → the path of the parameter it copies, among `params`."""
  return {p: p[len(PREFIX):] for p in params
          if is_reference(p) and p[len(PREFIX):] in params}


def trained_model(params: dict) -> dict:
  """`params` without the reference copies (what the run trains, saves and exports)."""
  return {k: v for k, v in params.items() if not is_reference(k)}


class _Copier(Rewriter):
  """The rewrite's walk (ir/rewrite.py) with each parameter renamed to its reference copy."""

  def __init__(self):
    super().__init__(False, {}, 0, 1)
    self.read: list[str] = []

  def rebuild(self, node: Node, frame: Frame) -> Node:
    if node.op == "param":
      path = node.attr("path")
      if is_reference(path):
        return node
      if path not in self.read:
        self.read.append(path)
      attrs = tuple((k, reference_of(v) if k == "path" else v) for k, v in node.attrs)
      return Node("param", (), attrs, node.dtype, node.shape, node.loc, node.scope)
    if node.op in ("dropout", "tap") and isinstance(node.inputs[0], Node):
      return frame.get(node.inputs[0])  # evaluated without dropout; its taps are the policy's
    new = super().rebuild(node, frame)
    body = new.attr("body")
    if isinstance(body, (Body, Fn)) and any(not is_reference(p) for p in body.params):
      renamed = tuple(p if is_reference(p) else reference_of(p) for p in body.params)
      body = (Body(body.carry, body.output, renamed) if isinstance(body, Body)
              else Fn(body.args, body.results, renamed))
      attrs = tuple((k, body if k == "body" else v) for k, v in new.attrs)
      new = Node(new.op, new.inputs, attrs, new.dtype, new.shape, new.loc, new.scope)
    return new


def copy(x: Node, params: dict[str, Param]) -> tuple[Node, dict[str, Param]]:
  """`x` as the reference computes it, and the reference copies it reads (new Params of
  their trained parameters' shapes, dtypes, initializers and stacking).

  Args:
    x: a value of the graph being built.
    params: every parameter built so far, by path (the trained ones `x` reads among them).
  """
  copier = _Copier()
  frame = Frame(None, 1)
  copier.run([x], frame)
  out: dict[str, Param] = {}
  for path in copier.read:
    p = params[path]
    ref = reference_of(path)
    out[ref] = Param(ref, p.shape, p.dtype, p.init, p.loc, p.stack)
  return frame.get(x), out

"""Prints graphs as text, one node a line, in the style of a jaxpr."""

from __future__ import annotations

import hashlib
import os

from sexpgpu.ir.graph import Body, Fn, Graph, Node, walk


def _attr_str(v) -> str:
  if isinstance(v, (Body, Fn)):
    return "…"
  if isinstance(v, tuple):
    return "(" + ",".join(_attr_str(i) for i in v) + ")"
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, float):
    return repr(v)
  if isinstance(v, str):
    return v if v.replace("-", "").replace("_", "").isalnum() else repr(v)
  return str(v)


class _Printer:
  def __init__(self, with_locs: bool, note=None):
    self.names: dict[int, str] = {}
    self.lines: list[str] = []
    self.with_locs = with_locs
    self.note = note  # node → a remark for the end of its line, or ""

  def name(self, v) -> str:
    if isinstance(v, Node):
      return self.names[v.uid]
    return repr(v)

  def emit(self, outputs: list[Node], indent: str) -> None:
    for node in walk(outputs):
      if node.uid in self.names:
        continue
      self.names[node.uid] = f"%{len(self.names)}"
      attrs = [(k, v) for k, v in node.attrs if k not in ("body", "frame", "types")]
      head = node.op + ("[" + ", ".join(f"{k}={_attr_str(v)}" for k, v in attrs) + "]"
                        if attrs else "")
      args = " ".join(self.name(i) for i in node.inputs)
      line = f"{indent}{self.names[node.uid]}:{node.type_str} = {head}" + (f" {args}" if args else "")
      body = node.attr("body")
      if self.with_locs and node.loc is not None:
        where = f"{os.path.basename(node.loc.file) if not node.loc.file.startswith('std/') else node.loc.file}:{node.loc.line}:{node.loc.col}"
        line += f"  ; {where}" + (f" {node.scope}" if node.scope else "")
      remark = self.note(node) if self.note is not None else ""
      if remark:
        line += f"  | {remark}"
      if isinstance(body, Fn):  # a scan's function: its arguments, then what it computes
        self.lines.append(line + " {")
        self.emit(list(body.args) + list(body.results), indent + "    ")
        self.lines.append(f"{indent}  }} -> " + ", ".join(self.name(r) for r in body.results))
      elif body is not None:
        self.lines.append(line + " {")
        self.emit([body.carry, body.output], indent + "    ")
        self.lines.append(f"{indent}  }} -> {self.name(body.output)}")
      else:
        self.lines.append(line)


def print_graph(graph: Graph, with_locs: bool = True, note=None) -> str:
  """The graph as text: parameters, then nodes in order, then the outputs.

  Args:
    note: node → a remark printed at the end of its line (an analysis's finding), or "".
  """
  p = _Printer(with_locs, note)
  lines = [f"graph {graph.name}"]
  for path, prm in graph.params.items():
    lines.append(f"  param {path}: {prm.dtype}[{','.join(map(str, prm.full_shape))}] init {prm.init}")
  roots = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  p.emit(roots, "  ")
  lines.extend(p.lines)
  lines.append("  return " + ", ".join(f"{k}={p.name(v)}" for k, v in graph.outputs.items()))
  return "\n".join(lines)


def fingerprint(text: str) -> str:
  """A short hash of printed IR and knobs."""
  return hashlib.sha256(text.encode()).hexdigest()[:16]

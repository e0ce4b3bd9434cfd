"""Rewrites of the graph IR: attention → sdpa, large-vocabulary loss → chunked, CSE, dead nodes.

Nodes are immutable, so a rewrite rebuilds the graph bottom-up: every node is
re-interned on its (possibly new) inputs, which merges duplicates that a
rewrite created (CSE), and only what the outputs and taps reach is kept (dead
nodes go). Patterns match the original nodes and are structural: they read
einsum specs by the role of each index letter, never by names or letters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sexpgpu.errors import Loc
from sexpgpu.ir.graph import Body, Fn, Graph, Node, walk
from sexpgpu.ir.shapes import infer, literal_type

XENT_MIN_VOCAB = 8192  # a vocabulary at least this large gets the chunked loss
XENT_CHUNK = 8192      # the largest vocabulary chunk the chunked loss holds at once
FLOATS = ("f32", "bf16", "f16")


@dataclasses.dataclass(frozen=True)
class Region:
  """A set of nodes a rewrite recognized.

  Attributes:
    kind: "attention" or "cross-entropy".
    nodes: how many original nodes the region replaced.
    detail: what was recognized ("causal, 4 heads, head dim 16").
    scope: the scope path of the region's last node.
    loc: the `.sx` place of the region's last node.
    times: how often it runs per step (the product of the enclosing repeats' counts).
  """

  kind: str
  nodes: int
  detail: str
  scope: str = ""
  loc: Loc | None = None
  times: int = 1


def rewrite(graph: Graph, patterns: bool = True, *, xent_min_vocab: int = XENT_MIN_VOCAB,
            xent_chunk: int = XENT_CHUNK) -> tuple[Graph, list[Region]]:
  """A rewritten copy of `graph` and the regions its patterns recognized.

  Args:
    graph: the graph to rewrite; it is not changed.
    patterns: False (SEXPGPU_PATTERNS=off) keeps only CSE and dead-node removal.
    xent_min_vocab: the smallest vocabulary the chunked cross-entropy takes over.
    xent_chunk: the largest vocabulary chunk it computes at once.

  Returns:
    (the new graph, the recognized regions, one per occurrence in the IR: a
    region inside a repeat body is listed once, with `times` set to the count).
  """
  roots = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  rw = Rewriter(patterns, use_counts(roots), xent_min_vocab, xent_chunk)
  frame = Frame(None, 1)
  rw.run(roots, frame)
  new = Graph(graph.name, {k: frame.get(v) or v for k, v in graph.inputs.items()},
              {k: frame.get(v) for k, v in graph.outputs.items()}, dict(graph.params),
              {k: [frame.get(n) for n in ns] for k, ns in graph.taps.items()})
  return new, rw.regions


def use_counts(roots: list[Node]) -> dict[int, int]:
  """How many times each node is read (as an input, or as a root), bodies included."""
  uses: dict[int, int] = {}
  for r in roots:
    uses[r.uid] = uses.get(r.uid, 0) + 1
  pending, seen = [roots], set()
  while pending:
    for node in walk(pending.pop()):
      if node.uid in seen:
        continue
      seen.add(node.uid)
      for i in node.inputs:
        if isinstance(i, Node):
          uses[i.uid] = uses.get(i.uid, 0) + 1
      body = node.attr("body")
      if isinstance(body, Body):
        uses[body.output.uid] = uses.get(body.output.uid, 0) + 1
        pending.append([body.output])
      elif isinstance(body, Fn):
        for r in body.results:
          uses[r.uid] = uses.get(r.uid, 0) + 1
        pending.append(list(body.results))
  return uses


class Frame:
  """The top level or a repeat body: old uid → new node, and the intern table."""

  def __init__(self, parent: Frame | None, times: int):
    self.parent = parent
    self.times = times
    self.map: dict[int, Node] = {}
    self.interned: dict[tuple, Node] = {}

  def get(self, node: Node) -> Node | None:
    f = self
    while f is not None:
      if node.uid in f.map:
        return f.map[node.uid]
      f = f.parent
    return None


def _key(op: str, inputs: tuple, attrs: tuple) -> tuple:
  return (op, tuple(i.uid if isinstance(i, Node) else (type(i).__name__, i) for i in inputs),
          attrs)


class Rewriter:
  """Rebuilds a graph bottom-up, putting the fused patterns in (ir/lora.py extends it)."""

  def __init__(self, patterns: bool, uses: dict[int, int], xent_min_vocab: int,
               xent_chunk: int):
    self.patterns = patterns
    self.uses = uses
    self.xent_min_vocab = xent_min_vocab
    self.xent_chunk = max(xent_chunk, 1)
    self.regions: list[Region] = []

  def run(self, roots: list[Node], frame: Frame) -> None:
    for node in walk(roots):
      if frame.get(node) is None:
        frame.map[node.uid] = self.rebuild(node, frame)

  def rebuild(self, node: Node, frame: Frame) -> Node:
    if self.patterns:
      for pattern in (self._attention, self._cross_entropy):
        out = pattern(node, frame)
        if out is not None:
          return out
    inputs = tuple(frame.get(i) if isinstance(i, Node) else i for i in node.inputs)
    attrs = node.attrs
    if node.op == "repeat":
      body = node.attr("body")
      inner = Frame(frame, frame.times * node.attr("n"))
      inner.map[body.carry.uid] = body.carry
      self.run([body.output], inner)
      out = inner.map[body.output.uid]
      if out is not body.output:
        attrs = tuple((k, Body(body.carry, out, body.params) if k == "body" else v)
                      for k, v in attrs)
    elif isinstance(node.attr("body"), Fn):  # a scan's function runs once a position
      body = node.attr("body")
      xs = node.inputs[node.attr("carries")]
      inner = Frame(frame, frame.times * xs.shape[node.attr("axis")])
      for a in body.args:
        inner.map[a.uid] = a
      self.run(list(body.results), inner)
      results = tuple(inner.map.get(r.uid) or frame.get(r) for r in body.results)
      if any(a is not b for a, b in zip(results, body.results)):
        attrs = tuple((k, Fn(body.args, results, body.params) if k == "body" else v)
                      for k, v in attrs)
    key = _key(node.op, inputs, attrs)
    found = frame.interned.get(key)
    if found is not None:
      return found
    same = attrs is node.attrs and all(a is b for a, b in zip(inputs, node.inputs))
    new = node if same else Node(node.op, inputs, attrs, node.dtype, node.shape, node.loc,
                                 node.scope)
    frame.interned[key] = new
    return new

  def make(self, frame: Frame, op: str, inputs: list, attrs: dict, like: Node) -> Node:
    """A new node of `op` (typed by its shape rule) at `like`'s place and scope."""
    attrs_t = tuple(sorted(attrs.items()))
    key = _key(op, tuple(inputs), attrs_t)
    found = frame.interned.get(key)
    if found is not None:
      return found
    in_types = tuple(("T", i.dtype, i.shape) if isinstance(i, Node) else literal_type(i)
                     for i in inputs)
    dtype, shape = infer(op, attrs_t, in_types)
    node = Node(op, tuple(inputs), attrs_t, dtype, shape, like.loc, like.scope)
    frame.interned[key] = node
    return node

  def transpose(self, frame: Frame, x: Node, perm: list[int], like: Node) -> Node:
    if perm == list(range(len(perm))):
      return x
    return self.make(frame, "transpose", [x], {"perm": tuple(perm)}, like)

  def single_use(self, *nodes: Node) -> bool:
    return all(self.uses.get(n.uid, 0) == 1 for n in nodes)

  # --- attention ---------------------------------------------------------------
  def _attention(self, node: Node, frame: Frame) -> Node | None:
    m = match_attention(node, self.single_use)
    if m is None:
      return None
    q, k, v = (frame.get(x) for x in (m.q, m.k, m.v))
    canon = [self.transpose(frame, x, perm, node) for x, perm in zip((q, k, v), m.perms)]
    axis = min(m.batch_axes, 1)  # no heads axis: [b, 1, t, d]; no batch either: [1, 1, t, d]
    for _ in range(2 - m.batch_axes):
      canon = [self.make(frame, "expand", [x], {"axis": axis}, node) for x in canon]
    # The segment mask stays an input of the region, so its lowering can serve it.
    segments = [frame.get(m.segments)] if m.segments is not None else []
    out = self.make(frame, "sdpa", canon + segments, {"causal": m.causal,
                                                      "scale": float(m.scale)}, node)
    for _ in range(2 - m.batch_axes):
      out = self.make(frame, "squeeze", [out], {"axis": axis}, node)
    out = self.transpose(frame, out, m.out_perm, node)
    heads = (f"{canon[0].shape[1]} heads" if m.batch_axes == 2 else "no heads axis")
    detail = f"{'causal' if m.causal else 'not causal'}, {heads}, head dim {canon[0].shape[-1]}"
    detail += ", segment mask" if m.segments is not None else ""
    self.regions.append(Region("attention", m.count, detail, node.scope, node.loc, frame.times))
    return out

  # --- cross-entropy -----------------------------------------------------------
  def _cross_entropy(self, node: Node, frame: Frame) -> Node | None:
    if node.op != "cross-entropy":
      return None
    logits = node.inputs[0]
    if not (isinstance(logits, Node) and logits.op == "matmul" and self.single_use(logits)):
      return None
    h, w = logits.inputs
    if not (isinstance(h, Node) and isinstance(w, Node) and len(w.shape) == 2
            and len(h.shape) >= 1 and h.dtype in FLOATS and w.dtype in FLOATS):
      return None
    vocab = w.shape[1]
    if vocab < max(self.xent_min_vocab, 1):
      return None
    chunks = math.ceil(vocab / self.xent_chunk)
    ins = [frame.get(h), frame.get(w)] + [frame.get(i) for i in node.inputs[1:]]
    out = self.make(frame, "chunked-cross-entropy", ins, {"chunks": chunks}, node)
    size = math.ceil(vocab / chunks)
    detail = f"vocab {vocab}, {chunks} chunk{'s' if chunks > 1 else ''} of {size}"
    self.regions.append(Region("cross-entropy", 2, detail, node.scope, node.loc, frame.times))
    return out


# --- the attention pattern, structurally -----------------------------------------
@dataclasses.dataclass
class AttentionMatch:
  """How an einsum/softmax/einsum chain maps onto sdpa's [batch, heads, seq, dim].

  Attributes:
    q, k, v: the original operands.
    perms: each operand's transpose into [batch axes.., seq, dim].
    batch_axes: 0, 1 or 2 shared leading axes (missing ones are inserted as size 1).
    out_perm: the transpose from sdpa's layout to the einsum's output layout.
    causal, scale: sdpa's attributes.
    count: how many nodes the chain has.
    segments: the [batch, seq] segment ids of a `segment-mask` in the chain, or None.
  """

  q: Node
  k: Node
  v: Node
  perms: tuple[list[int], list[int], list[int]]
  batch_axes: int
  out_perm: list[int]
  causal: bool
  scale: float
  count: int
  segments: Node | None = None


def parse_spec(spec: str, ranks: list[int]) -> tuple[list[str], str] | None:
  """An einsum spec as (operand letters, output letters); None for forms the pattern skips."""
  s = spec.replace(" ", "")
  if "..." in s or "->" not in s:
    return None
  lhs, out = s.split("->")
  ins = lhs.split(",")
  if len(ins) != len(ranks) or any(len(a) != r for a, r in zip(ins, ranks)):
    return None
  if any(len(set(a)) != len(a) for a in ins + [out]) or not all(c.isalpha() for c in lhs.replace(",", "") + out):
    return None
  return ins, out


def _literal(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scale_of(x: Node) -> tuple[Node, float] | None:
  """(scores, scale) for `s * c`, `c * s`, `s / c`; None for any other product."""
  a, b = x.inputs
  if x.op == "*" and isinstance(a, Node) and _literal(b):
    return a, float(b)
  if x.op == "*" and isinstance(b, Node) and _literal(a):
    return b, float(a)
  if x.op == "/" and isinstance(a, Node) and _literal(b) and b != 0:
    return a, 1.0 / float(b)
  return None


def match_attention(node: Node, single_use) -> AttentionMatch | None:
  """Matches `einsum(softmax(masks(einsum(q, k) * scale?)), v)` at `node`.

  The masks are an optional `causal-mask` and an optional `segment-mask`, in
  either order.

  Args:
    node: the candidate output einsum.
    single_use: a predicate: every intermediate node is read only by the chain.

  Returns:
    the match, or None.
  """
  if node.op != "einsum" or len(node.inputs) != 2 or node.dtype not in FLOATS:
    return None
  p, v = node.inputs
  if not (isinstance(p, Node) and isinstance(v, Node) and p.op == "softmax"):
    return None
  chain = [p]
  x = p.inputs[0]
  causal, segments = False, None
  while (x.op == "causal-mask" and not causal) or (x.op == "segment-mask" and segments is None):
    if x.op == "causal-mask":
      causal = True
    else:
      segments = x.inputs[1]
    chain.append(x)
    x = x.inputs[0]
  scale = 1.0
  if x.op in ("*", "/"):
    found = _scale_of(x)
    if found is None:
      return None
    chain.append(x)
    x, scale = found
  s = x
  if s.op != "einsum" or len(s.inputs) != 2 or not single_use(*chain, s):
    return None
  q, k = s.inputs
  if not (isinstance(q, Node) and isinstance(k, Node)) or len({q.dtype, k.dtype, v.dtype}) != 1:
    return None
  roles = _score_roles(s.attr("spec"), q, k)
  if roles is None:
    return None
  a, b, c, qi, ki, d, batch = roles
  if p.attr("axis") != c.index(ki) or (causal and c[-2:] != qi + ki):
    return None
  if segments is not None and (c[-2:] != qi + ki or not batch or c[0] != batch[0]
                               or q.shape[a.index(qi)] != k.shape[b.index(ki)]):
    return None
  pv = parse_spec(node.attr("spec"), [len(p.shape), len(v.shape)])
  if pv is None:
    return None
  (pl, vl), ol = pv
  name = dict(zip(c, pl))  # a score letter → its letter in the second einsum
  kp, qp, bp = name[ki], name[qi], [name[g] for g in batch]
  rest = [ch for ch in vl if ch != kp and ch not in bp]
  if len(vl) != len(batch) + 2 or kp not in vl or qp in vl or len(rest) != 1:
    return None
  e = rest[0]
  if sorted(ol) != sorted(bp + [qp, e]) or e in pl:
    return None
  if v.shape[vl.index(kp)] != k.shape[b.index(ki)] or any(
      v.shape[vl.index(name[g])] != q.shape[a.index(g)] for g in batch):
    return None
  perms = ([a.index(g) for g in batch] + [a.index(qi), a.index(d)],
           [b.index(g) for g in batch] + [b.index(ki), b.index(d)],
           [vl.index(g) for g in bp] + [vl.index(kp), vl.index(e)])
  layout = bp + [qp, e]
  return AttentionMatch(q, k, v, perms, len(batch), [layout.index(ch) for ch in ol], causal,
                        scale, len(chain) + 2, segments)


def _score_roles(spec: str, q: Node, k: Node):
  """The letters' roles in a q·k einsum: (a, b, c, query, key, head dim, batch letters)."""
  parsed = parse_spec(spec, [len(q.shape), len(k.shape)])
  if parsed is None:
    return None
  (a, b), c = parsed
  contracted = (set(a) | set(b)) - set(c)
  qs = [ch for ch in a if ch in c and ch not in b]
  ks = [ch for ch in b if ch in c and ch not in a]
  batch = [ch for ch in c if ch in a and ch in b]
  if len(contracted) != 1 or len(qs) != 1 or len(ks) != 1 or len(batch) > 2:
    return None
  d = contracted.pop()
  if d not in a or d not in b or len(a) != len(batch) + 2 or len(b) != len(batch) + 2 \
      or len(c) != len(batch) + 2:
    return None
  if any(q.shape[a.index(ch)] != k.shape[b.index(ch)] for ch in batch + [d]):
    return None
  return a, b, c, qs[0], ks[0], d, batch

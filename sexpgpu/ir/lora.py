"""LoRA as a graph rewrite, and the partition of the parameters into trained and frozen.

`apply` puts a low-rank adapter beside each `matmul` whose weight a `:targets` pattern
names: `x·W` becomes `x·W + (alpha/rank)·(x·A)·B`, A [in rank] with a fan-in init and B
[rank out] at zero, so the rewritten model starts as the base model computes. An adapter
is stacked as its base weight is (a `repeat`'s layers, in the repeat body's parameters),
and its paths are the base's with `.lora_a` and `.lora_b`, so `:sharding` layouts and
checkpoints see two more parameters of the ordinary kind. `trained` reads `:trainable`'s
glob patterns (matched as the optimizer's `:decay` patterns are, ir/roles.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from typing import Any

from sexpgpu.errors import Loc, SxError
from sexpgpu.ir.graph import Body, Fn, Graph, Init, Node, Param
from sexpgpu.ir.reference import is_reference
from sexpgpu.ir.rewrite import Frame, Rewriter, use_counts
from sexpgpu.ir.roles import all_nodes

KEYWORDS = ("rank", "alpha", "dropout", "targets")
SUFFIXES = (".lora_a", ".lora_b")
DROPOUT_SITE = 1 << 20  # adapters' dropout sites, above any the builder numbers


@dataclasses.dataclass(frozen=True)
class Lora:
  """A `(lora ...)`: the adapters' rank, alpha, dropout on their input, and target patterns."""

  rank: int
  alpha: float
  dropout: float
  targets: tuple[str, ...]
  loc: Loc | None = None
  targets_loc: Loc | None = None  # the :targets vector's place

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def options(values: dict[str, Any], locs: dict[str, Loc], where: Loc | None) -> Lora:
  """A validated `(lora :rank R :alpha A :dropout D :targets [...])` from its evaluated values.

  Args:
    values: keyword → evaluated value (keywords already checked against KEYWORDS).
    locs: keyword → the `.sx` place of its value.
    where: the `(lora ...)` form's place.

  Raises:
    SxError: E-RUN-002 for a missing :rank or :targets, a rank that is no integer ≥ 1, an
      alpha that is no number > 0, a dropout outside [0, 1), or targets that are no
      vector of patterns.
  """
  for key in ("rank", "targets"):
    if key not in values:
      raise SxError("E-RUN-002", f"lora has no :{key}", location=where,
                    fix="(lora :rank 8 :alpha 16 :targets [\"*/q_proj/w\" \"*/v_proj/w\"])")
  rank = values["rank"]
  if not (_number(rank) and float(rank).is_integer() and rank >= 1):
    raise SxError("E-RUN-002", f"lora :rank is {rank!r}; it is an integer from 1",
                  location=locs.get("rank", where), fix=":rank 8 (the adapters' inner size)")
  alpha = values.get("alpha", 2 * int(rank))
  if not (_number(alpha) and alpha > 0):
    raise SxError("E-RUN-002", f"lora :alpha is {alpha!r}; it is a number above 0",
                  location=locs.get("alpha", where),
                  fix=":alpha 16 (the adapters' output is scaled by alpha/rank)")
  dropout = values.get("dropout", 0.0)
  if not (_number(dropout) and 0 <= dropout < 1):
    raise SxError("E-RUN-002", f"lora :dropout is {dropout!r}; it is a probability in [0, 1)",
                  location=locs.get("dropout", where), fix=":dropout 0.05, or 0.0 for none")
  targets = values["targets"]
  if not (isinstance(targets, tuple) and targets
          and all(isinstance(t, str) and t for t in targets)):
    raise SxError("E-RUN-002", f"lora :targets is {targets!r}; it is a vector of glob "
                  "patterns over the matmul weights' parameter paths",
                  location=locs.get("targets", where),
                  fix=":targets [\"*/q_proj/w\" \"*/v_proj/w\"]")
  return Lora(int(rank), float(alpha), float(dropout), tuple(targets), where,
              locs.get("targets", where))


def nearest(pattern: str, paths: list[str]) -> list[str]:
  """The paths nearest a glob that matches none: each path's tail as long as the pattern's
  literal text after its last `*`, compared with that text (a typo in "*/q_prj/w")."""
  lit = pattern.rsplit("*", 1)[-1] or pattern
  tails: dict[str, list[str]] = {}
  for p in paths:
    tails.setdefault(p[-len(lit):], []).append(p)
  close = difflib.get_close_matches(lit, list(tails), n=3, cutoff=0.6)
  return [p for t in close for p in tails[t]][:4]


def _near_text(pattern: str, paths: list[str]) -> str:
  near = nearest(pattern, paths)
  return "nearest: " + ", ".join(f"`{p}`" for p in near) + "; " if near else ""


def adapter_paths(base: str) -> tuple[str, str]:
  """The paths of a base weight's adapters: (A, B)."""
  return base + SUFFIXES[0], base + SUFFIXES[1]


def base_of(path: str) -> str | None:
  """The base weight an adapter's path belongs to, or None for a path that is no adapter's."""
  for s in SUFFIXES:
    if path.endswith(s):
      return path[:-len(s)]
  return None


def base_params(params: dict[str, Any]) -> dict[str, Any]:
  """`params` without LoRA's adapters and the reference's frozen copies (ir/reference.py):
  what a Hugging Face twin of the base model holds."""
  return {k: v for k, v in params.items() if base_of(k) not in params and not is_reference(k)}


def _weights(graph: Graph) -> tuple[set[str], set[str]]:
  """(the parameters some matmul reads as its 2-D weight, those read any other way too)."""
  weights, other = set(), set()
  for node in all_nodes(graph):
    for i, x in enumerate(node.inputs):
      if isinstance(x, Node) and x.op == "param" and not is_reference(x.attr("path")):
        path = x.attr("path")
        if node.op == "matmul" and i == 1 and len(x.shape) == 2:
          weights.add(path)
        else:
          other.add(path)
  return weights, other


def targets_of(graph: Graph, lora: Lora, strict: bool = True) -> set[str]:
  """The matmul weights `lora`'s patterns name (`strict`: each pattern must name one, as in
  the loss; a pass's metric may read none).

  Raises:
    SxError: E-RUN-002 at the `(lora ...)` for a pattern that names no matmul weight, and for
      a named weight that is also read other than as a matmul's weight (an embedding table
      read by `take`), which a merged adapter would change there too.
  """
  weights, other = _weights(graph)
  chosen = set()
  for pat in lora.targets:
    found = {p for p in weights if fnmatch.fnmatchcase(p, pat)}
    if not found and strict:
      raise SxError("E-RUN-002", f"lora :targets pattern \"{pat}\" names no matmul weight",
                    location=lora.targets_loc or lora.loc,
                    fix=_near_text(pat, sorted(weights)) + "targets are globs over the paths "
                    "of weights that a matmul reads (`check --print params` lists them), e.g. "
                    "\"*/q_proj/w\"")
    chosen |= found
  for path in sorted(chosen & other):
    raise SxError("E-RUN-002", f"lora target {path} is read other than as a matmul's weight "
                  "(a shared or tied parameter)", location=lora.loc,
                  fix="narrow :targets to weights that only matmuls read, e.g. \"*/q_proj/w\"")
  return chosen


def apply(graph: Graph, lora: Lora | None, strict: bool = True) -> Graph:
  """`graph` with an adapter beside each matmul whose weight `lora` targets (None: `graph`).
  `strict`: a pattern that names no weight of `graph` is an error (targets_of).

  Raises:
    SxError: E-RUN-002 (targets_of).
  """
  if lora is None:
    return graph
  chosen = targets_of(graph, lora, strict)
  if not chosen:
    return graph
  roots = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  rw = _LoraRewriter(lora, chosen, graph.params, use_counts(roots))
  frame = Frame(None, 1)
  rw.run(roots, frame)
  params = dict(graph.params)
  params.update(rw.added)
  return Graph(graph.name, {k: frame.get(v) or v for k, v in graph.inputs.items()},
               {k: frame.get(v) for k, v in graph.outputs.items()}, params,
               {k: [frame.get(n) for n in ns] for k, ns in graph.taps.items()})


class _LoraRewriter(Rewriter):
  """The rewrite's walk (ir/rewrite.py: CSE, bodies rebuilt) with the adapters put in."""

  def __init__(self, lora: Lora, chosen: set[str], params: dict[str, Param], uses):
    super().__init__(False, uses, 0, 1)
    self.lora, self.chosen, self.params = lora, chosen, params
    self.added: dict[str, Param] = {}

  def rebuild(self, node: Node, frame: Frame) -> Node:
    new = super().rebuild(node, frame)
    body = new.attr("body")
    if isinstance(body, (Body, Fn)):  # a body reads its adapters as it reads their base
      extra = tuple(a for p in body.params if p in self.chosen for a in adapter_paths(p))
      if extra:
        body = (Body(body.carry, body.output, body.params + extra) if isinstance(body, Body)
                else Fn(body.args, body.results, body.params + extra))
        attrs = tuple((k, body if k == "body" else v) for k, v in new.attrs)
        new = Node(new.op, new.inputs, attrs, new.dtype, new.shape, new.loc, new.scope)
    w = node.inputs[1] if node.op == "matmul" else None
    if not (isinstance(w, Node) and w.op == "param" and w.attr("path") in self.chosen):
      return new
    return self._adapted(new, frame, w)

  def _param(self, w: Node, path: str, shape: tuple[int, int], init: Init) -> Node:
    base = self.params[w.attr("path")]
    self.added[path] = Param(path, shape, base.dtype, init, base.loc, base.stack)
    return Node("param", (), (("path", path),), w.dtype, shape, w.loc, w.scope)

  def _adapted(self, base: Node, frame: Frame, w: Node) -> Node:
    """x·W + (alpha/rank)·(dropout(x)·A)·B, at the matmul's place."""
    x = base.inputs[0]
    n_in, n_out = w.shape
    pa, pb = adapter_paths(w.attr("path"))
    a = self._param(w, pa, (n_in, self.lora.rank), Init("fan-in", 1.0))
    b = self._param(w, pb, (self.lora.rank, n_out), Init("zeros"))
    if self.lora.dropout > 0:
      site = DROPOUT_SITE + sorted(self.chosen).index(w.attr("path"))
      x = self.make(frame, "dropout", [x], {"rate": self.lora.dropout, "site": site}, base)
    low = self.make(frame, "matmul", [self.make(frame, "matmul", [x, a], {}, base), b], {}, base)
    scaled = self.make(frame, "*", [low, self.lora.scale], {}, base)
    return self.make(frame, "+", [base, scaled], {}, base)


def trained(params: dict[str, Param], patterns: tuple[str, ...] | None, where: Loc | None
            ) -> frozenset[str] | None:
  """The parameters a step trains: those `:trainable`'s patterns match, and every LoRA
  adapter; None when every parameter trains (no `:trainable`, no adapters, no reference).
  The reference's copies (ir/reference.py) are never trained, whatever the patterns say.

  Raises:
    SxError: E-RUN-002 at `:trainable` for a pattern that matches no parameter (the nearest
      paths named).
  """
  adapters = {p for p in params if base_of(p) is not None and base_of(p) in params}
  model = [p for p in params if not is_reference(p)]
  if patterns is None:
    if adapters:
      return frozenset(adapters)
    return None if len(model) == len(params) else frozenset(model)
  paths = sorted(model)
  chosen = set(adapters)
  for pat in patterns:
    found = {p for p in paths if fnmatch.fnmatchcase(p, pat)}
    if not found:
      raise SxError("E-RUN-002", f":trainable pattern \"{pat}\" matches no parameter",
                    location=where, fix=_near_text(pat, paths) + "patterns are globs over "
                    "parameter paths, `*` matching any text, `/` too (`check --print params`)")
    chosen |= found
  return frozenset(chosen)

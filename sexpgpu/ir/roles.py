"""Each parameter's role, read from its uses in the graph: what weight decay, and later the
recipes that depend on it (Muon, μP), need to know about a parameter.

A parameter's uses are found by following it through views (transpose, cast, slice, tap,
stop-gradient, expand) to the op that reads it:

- `take` reads a table: an **embedding** (fan-in its rows, fan-out the rest);
- the matmul or einsum whose product is a loss's logits reads the **readout** (an
  embedding that is also the readout is *tied*);
- `matmul`/`einsum` read a **hidden** matrix: fan-in the contracted axes, fan-out the free
  ones; an axis that each operand and the product keep (an einsum's `e` in
  "ecd,edh->ech"), or that a gated sum contracts, is an experts axis, and such a matrix is an
  **expert** matrix;
- `conv` reads a **conv** kernel ([k.. in out]: fan-in the window and the in-channels);
- a vector multiplying a normalised tensor (an `rsqrt` in the product's making) is a
  **norm** scale; a vector added is a **bias**; a table added to a tensor is an embedding
  (a position table);
- anything else is **other**.

`repeat` stacks a parameter's per-layer shape behind its layer axes (`Param.stack`); those
and the experts axes are named apart from the matrix's own axes. `(param w SHAPE :role R)`
settles a role the graph cannot: where the uses disagree and the difference decides
something (weight decay), an undeclared parameter is E-ROLE-001 at its `param`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.ir.graph import Body, Fn, Graph, Node, Param, walk

ROLES = ("embedding", "readout", "hidden", "expert", "conv", "norm", "bias", "other")
# What weight decay does to each role by default (`other`: a matrix is decayed, a vector not)
DECAYED = {"embedding": False, "readout": True, "hidden": True, "expert": True, "conv": True,
           "norm": False, "bias": False}
# Ops a parameter passes through unchanged in its axes (slice keeps them, only shorter)
_SAME_AXES = ("cast", "slice", "tap", "stop-gradient")
# Ops whose input 0 is a loss's logits
_LOGIT_USERS = ("cross-entropy", "log-softmax")
# Ops between a readout's product and the logits a loss reads
_TO_LOGITS = ("reshape", "slice", "cast", "transpose", "tap", "+", "-", "*", "/")
_HOPS = 4


@dataclasses.dataclass(frozen=True)
class Role:
  """One parameter's role.

  Attributes:
    path: the parameter's path.
    role: one of ROLES.
    tied: an embedding that is also the readout.
    stack: the `repeat` layer axes stacked in front of its own shape.
    experts: its own axes (indices into `Param.shape`) that hold experts.
    fan_in, fan_out: the products of the contracted and the free own axes of the use that
      decided the role (None where nothing is contracted: norms, biases, added tables).
    declared: the role was written with `:role`.
    contracted, free: the own axes (indices into `Param.shape`, experts apart) that the
      deciding use contracts and keeps: a matrix's fan-in and fan-out axes (Muon's).
    candidates: the roles its uses imply, when they disagree (the first is taken).
  """

  path: str
  role: str
  tied: bool = False
  stack: tuple[int, ...] = ()
  experts: tuple[int, ...] = ()
  fan_in: int | None = None
  fan_out: int | None = None
  declared: bool = False
  candidates: tuple[str, ...] = ()
  contracted: tuple[int, ...] = ()
  free: tuple[int, ...] = ()

  def text(self) -> str:
    """`embedding+readout (tied)`, `hidden`, `norm (declared)`, `hidden? (or embedding)`."""
    out = "embedding+readout (tied)" if self.tied else self.role
    if self.declared:
      out += " (declared)"
    elif len(self.candidates) > 1:
      out += "? (or " + ", ".join(c for c in self.candidates if c != self.role) + ")"
    return out

  def stacked_text(self, param: Param) -> str:
    """`repeat[12]`, `repeat[2] experts[8]` or `-`."""
    parts = [f"repeat[{n}]" for n in self.stack]
    parts += [f"experts[{param.shape[a]}]" for a in self.experts]
    return " ".join(parts) or "-"


@dataclasses.dataclass(frozen=True)
class _Use:
  kind: str  # embed, matmul, conv, scale, add, other
  contracted: tuple[int, ...] = ()
  free: tuple[int, ...] = ()
  batch: tuple[int, ...] = ()
  node: Node | None = None  # the op that reads it
  other: Node | None = None  # for scale and add: the other operand


def all_nodes(graph: Graph) -> list[Node]:
  """Every node of the graph, those inside `repeat` and `scan` bodies too, each once."""
  seen: dict[int, Node] = {}
  todo = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  while todo:
    more = []
    for node in walk(todo, set(seen)):
      seen[node.uid] = node
      for _, v in node.attrs:
        if isinstance(v, Body):
          more.append(v.output)
        elif isinstance(v, Fn):
          more.extend(v.results)
    todo = [n for n in more if n.uid not in seen]
  return list(seen.values())


def _users(nodes: Iterable[Node]) -> dict[int, list[tuple[Node, int]]]:
  out: dict[int, list[tuple[Node, int]]] = {}
  for node in nodes:
    for i, x in enumerate(node.inputs):
      if isinstance(x, Node):
        out.setdefault(x.uid, []).append((node, i))
  return out


def _uses(param: Node, users) -> list[_Use]:
  """Where a param node is read, followed through views, each use in its own axes."""
  found: list[_Use] = []
  todo = [(param, tuple(range(len(param.shape))))]
  while todo:
    node, axes = todo.pop()
    for user, i in users.get(node.uid, ()):
      op = user.op
      if op in _SAME_AXES and i == 0:
        todo.append((user, axes))
      elif op == "transpose":
        todo.append((user, tuple(axes[p] for p in user.attr("perm"))))
      elif op == "expand":
        at = user.attr("axis")
        at = at if at >= 0 else len(axes) + 1 + at
        todo.append((user, axes[:at] + (None,) + axes[at:]))
      else:
        found.append(_read(user, i, axes))
  return found


def _own(axes, picks) -> tuple[int, ...]:
  return tuple(axes[p] for p in picks if axes[p] is not None)


def _read(user: Node, i: int, axes: tuple) -> _Use:
  """How op `user` reads its input `i`, a view of a parameter whose axes are `axes`."""
  op, n = user.op, len(axes)
  others = [x for j, x in enumerate(user.inputs) if j != i and isinstance(x, Node)]
  if op == "take" and i == 0 and n >= 1:
    return _Use("embed", _own(axes, [0]), _own(axes, range(1, n)), node=user)
  if op in ("matmul", "chunked-cross-entropy") and i == 1 and n >= 1:
    if n == 1:
      return _Use("matmul", _own(axes, [0]), node=user)
    return _Use("matmul", _own(axes, [n - 2]), _own(axes, [n - 1]), _own(axes, range(n - 2)),
                node=user)
  if op == "matmul" and i == 0 and n >= 2:
    return _Use("matmul", _own(axes, [n - 1]), _own(axes, [n - 2]), _own(axes, range(n - 2)),
                node=user)
  if op == "einsum" and "..." not in user.attr("spec") and "->" in user.attr("spec"):
    lhs, out = user.attr("spec").replace(" ", "").split("->")
    subs = lhs.split(",")
    if len(subs) == len(user.inputs) and len(subs[i]) == n:
      con, free, batch = [], [], []
      for a, letter in enumerate(subs[i]):
        shared = sum(letter in s for j, s in enumerate(subs) if j != i)
        if letter in out:
          (batch if shared else free).append(a)
        else:
          (con if shared <= 1 else batch).append(a)
      return _Use("matmul", _own(axes, con), _own(axes, free), _own(axes, batch), node=user)
  if op == "conv" and i == 1 and n >= 2:
    return _Use("conv", _own(axes, range(n - 1)), _own(axes, [n - 1]), node=user)
  if op == "*" and others:
    return _Use("scale", node=user, other=others[0])
  if op in ("+", "-") and others:
    return _Use("add", node=user, other=others[0])
  return _Use("other", node=user)


def _normalised(node: Node, depth: int = 2) -> bool:
  """Whether `node` is a tensor divided by its norm: an `rsqrt` (or a `/` by a `sqrt`) that
  multiplies it, within `depth` products or casts (`(* (* x (rsqrt var)) scale)`)."""
  if not isinstance(node, Node) or depth < 0:
    return False
  if node.op == "rsqrt" or (node.op == "/" and any(isinstance(x, Node) and x.op == "sqrt"
                                                    for x in node.inputs[1:])):
    return True
  return node.op in ("*", "/", "cast") and any(
      _normalised(x, depth - 1) for x in node.inputs if isinstance(x, Node))


def _readouts(nodes: list[Node]) -> set[int]:
  """The uids of the nodes a loss's logits read as the readout's weight: the operands of the
  matmul or einsum that makes the logits, and chunked-cross-entropy's weight."""
  out: set[int] = set()
  for node in nodes:
    if node.op == "chunked-cross-entropy":
      out.add(node.inputs[1].uid)
      continue
    if node.op not in _LOGIT_USERS:
      continue
    # a few ops at most between the product and the loss (a bias, a reshape, a scale), so
    # that a walk past a product-less head never reaches the blocks' own matrices
    todo, seen = [(node.inputs[0], 0)], set()
    while todo:
      x, hops = todo.pop()
      if not isinstance(x, Node) or x.uid in seen:
        continue
      seen.add(x.uid)
      if x.op in ("matmul", "einsum"):
        out.update(i.uid for i in x.inputs if isinstance(i, Node))
      elif x.op in _TO_LOGITS and hops < _HOPS:
        todo.extend((i, hops + 1) for i in x.inputs)
  return out


def _reaches(node: Node, targets: set[int], users) -> bool:
  """Whether `node`, followed through views, is one of `targets`."""
  todo = [node]
  while todo:
    x = todo.pop()
    if x.uid in targets:
      return True
    todo.extend(u for u, i in users.get(x.uid, ()) if i == 0 and
                (u.op in _SAME_AXES or u.op in ("transpose", "expand")))
  return False


def _product(shape, axes) -> int | None:
  if not axes:
    return None
  n = 1
  for a in axes:
    n *= shape[a]
  return n


def _decide(param: Param, uses: list[_Use], readout: bool) -> Role:
  """The role a parameter's uses imply (the first of several that disagree)."""
  implied: list[tuple[str, _Use | None]] = []
  rank = len(param.shape)
  for u in uses:
    if u.kind == "embed":
      implied.append(("embedding", u))
    elif u.kind == "conv":
      implied.append(("conv", u))
    elif u.kind == "matmul":
      experts = _experts(u, rank)
      implied.append(("expert" if experts else "hidden", u))
    elif u.kind == "scale" and rank == 1:
      implied.append(("norm" if _normalised(u.other) else "other", u))
    elif u.kind == "add":
      implied.append(("bias" if rank == 1 else "embedding", u))
  if readout:  # its product is the logits: not a hidden matrix as well
    implied = [(r, u) for r, u in implied if r not in ("hidden", "expert")]
    implied.insert(0, ("readout", next((u for u in uses if u.kind == "matmul"), None)))
  if not implied:
    return Role(param.path, "other", stack=param.stack)
  order = {r: k for k, r in enumerate(ROLES)}
  names = sorted({r for r, _ in implied}, key=order.__getitem__)
  tied = "embedding" in names and "readout" in names
  role = names[0]
  use = next(u for r, u in implied if r == role)
  rest = [n for n in names if n != role and not (tied and n == "readout")]
  # a vector both scaled and shifted, or a matrix whose one use is plain, is still one role
  candidates = tuple([role] + [n for n in rest if n != "other"]) if rest else ()
  if use is None or role in ("norm", "bias", "other") or (role == "embedding" and
                                                           use.kind == "add"):
    return Role(param.path, role, tied, param.stack, candidates=_many(candidates))
  experts = _experts(use, rank) if use.kind == "matmul" else ()
  con = tuple(a for a in use.contracted if a not in experts)
  free = tuple(a for a in use.free if a not in experts)
  return Role(param.path, role, tied, param.stack, experts, _product(param.shape, con),
              _product(param.shape, free), candidates=_many(candidates), contracted=con,
              free=free)


def _many(candidates: tuple[str, ...]) -> tuple[str, ...]:
  return candidates if len(candidates) > 1 else ()


def _experts(use: _Use, rank: int) -> tuple[int, ...]:
  """The experts axes of a matrix use: its batch axes, or, where a 3-axis weight has two free
  axes (an einsum that keeps the experts apart, "btd,edh->bteh"), its leading one."""
  if use.batch:
    return use.batch
  if rank >= 3 and len(use.free) + len(use.contracted) == rank and len(use.free) >= 2:
    return (min(use.free),)
  return ()


def roles(graph: Graph) -> dict[str, Role]:
  """Each parameter's role in `graph` (a loss graph), by path, in the graph's order.

  Raises:
    SxError: E-FORM-001 at a `param` whose `:role` names no role.
  """
  nodes = all_nodes(graph)
  users = _users(nodes)
  readouts = _readouts(nodes)
  by_path: dict[str, list[Node]] = {}
  declared: dict[str, str] = {}
  for node in nodes:
    if node.op == "param":
      path = node.attr("path")
      by_path.setdefault(path, []).append(node)
      if node.attr("role") is not None:
        declared[path] = check_role(node.attr("role"), node)
  out = {}
  for path, param in graph.params.items():
    ps = by_path.get(path, [])
    uses = [u for p in ps for u in _uses(p, users)]
    readout = any(_reaches(p, readouts, users) for p in ps)
    role = _decide(param, uses, readout)
    if path in declared:
      role = dataclasses.replace(role, role=declared[path], declared=True, candidates=(),
                                 tied=role.tied and declared[path] == "embedding")
    out[path] = role
  return out


def check_role(name, node: Node | None = None, loc=None) -> str:
  """`name` when it is one of ROLES; else E-FORM-001 at the `param` that wrote it."""
  if isinstance(name, str) and name in ROLES:
    return name
  raise SxError("E-FORM-001", f"param :role is `{name}`; a role is one of {', '.join(ROLES)}",
                location=loc if loc is not None else getattr(node, "loc", None),
                fix=did_you_mean(str(name), ROLES) or "write :role hidden, :role norm, …")


def decay_mask(graph: Graph, found: dict[str, Role], decay: tuple[str, ...] = (),
               no_decay: tuple[str, ...] = (), where=None, need: bool = True) -> dict[str, bool]:
  """Whether weight decay reaches each parameter: its role's default, or the optimizer's
  `:decay` / `:no-decay` glob patterns over parameter paths, which win.

  Args:
    graph: the loss graph (its parameters, their `.sx` places).
    found: `roles(graph)`.
    decay, no_decay: the optimizer's patterns.
    where: the optimizer's `.sx` place, for a pattern that matches nothing.
    need: whether the decision matters (a weight decay above 0): an undecidable role is then
      E-ROLE-001.

  Raises:
    SxError: E-RUN-002 for a pattern that matches no parameter or a parameter both patterns
      match; E-ROLE-001 at a `param` whose uses disagree on its decay and whose decay no
      pattern and no `:role` settles.
  """
  paths = list(graph.params)
  for key, pats in (("decay", decay), ("no-decay", no_decay)):
    for pat in pats:
      if not any(fnmatch.fnmatchcase(p, pat) for p in paths):
        raise SxError("E-RUN-002", f":{key} pattern \"{pat}\" matches no parameter",
                      location=where, fix=_pattern_fix(pat, paths))
  out = {}
  for path, param in graph.params.items():
    yes = any(fnmatch.fnmatchcase(path, p) for p in decay)
    no = any(fnmatch.fnmatchcase(path, p) for p in no_decay)
    if yes and no:
      raise SxError("E-RUN-002", f"parameter {path} matches both :decay and :no-decay",
                    location=where, fix="narrow one of the two patterns so that each "
                    "parameter matches at most one of them")
    role = found[path]
    if yes or no:
      out[path] = yes
      continue
    if need and len({_default(param, c) for c in role.candidates}) > 1:
      raise SxError("E-ROLE-001", f"parameter {path} is read as {' and as '.join(role.candidates)}"
                    f", which weight decay treats apart: its role is needed and the graph does "
                    f"not decide it", location=param.loc,
                    fix=f"write :role {role.candidates[0]} (or another role) on this param, or "
                    f"name it in the optimizer's :decay or :no-decay")
    out[path] = _default(param, role.role)
  return out


def _default(param: Param, role: str) -> bool:
  return DECAYED[role] if role in DECAYED else len(param.shape) >= 2


def _pattern_fix(pat: str, paths: list[str]) -> str:
  near = did_you_mean(pat, paths)
  return (near + " " if near else "") + ("patterns are globs over parameter paths "
                                         "(`check --print params` lists them), e.g. \"*/ln_*/*\"")

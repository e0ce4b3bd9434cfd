"""μP, the maximal-update parametrization (Yang et al. 2022, "Tensor Programs V"), derived
from each parameter's role (`ir.roles`) and the width ratio m = width / `:base-width`.

TP5's Table 3 states μP with the fans themselves (SP in brackets):

    |             | input weights & all biases | output weights      | hidden weights |
    | init. var.  | 1/fan_in                   | 1/fan_in² (1/fan_in)| 1/fan_in       |
    | SGD LR      | fan_out (1)                | 1/fan_in (1)        | 1              |
    | Adam LR     | 1                          | 1/fan_in (1)        | 1/fan_in (1)   |

We apply it relative to the model as written at the base width (so that at m = 1 μP is
exactly the file), and in TP5's equivalent form with an output multiplier (its Table 9, the
`mup` package's MuReadout): the readout's product is multiplied by 1/m, which takes the place
of Table 3's 1/fan_in² init variance and 1/fan_in Adam rate on the output weights, and is the
one form a tied embedding and readout can take. Relative to the file at base width:

    role                      init std    Adam LR   SGD LR   forward
    hidden, expert, conv      1/√m        1/m       1        -
    embedding (tied too)      1           1         m        tied: readout product × 1/m
    norm scale, bias          1           1         m        -
    readout (untied)          1 (const.)  1         m        readout product × 1/m
    other                     1           1         1        -

"init std" is what the written initializer is multiplied by; where the initializer already
scales with the width (`fan-in`) the factor is relative to that (a hidden `fan-in` init is
already 1/fan_in: factor 1; an untied readout's `fan-in` init gets √m, making it constant, as
`mup.set_base_shapes` rescales MuReadout). Zeros, ones and constants stay. Adam's column is
used for adam, adamw, lion and adafactor (TP5 App. B.3: adaptive optimizers), SGD's for sgd and
momentum; under Muon the orthogonalised hidden matrices keep factor 1 (their update's spectral
norm is fan-out/fan-in-scaled already, width-independent under proportional scaling) and the
AdamW part takes Adam's column.

The model's width is the readout's fan-in (the contracted axes of the matmul that makes the
logits), or without a readout the fan-in most hidden matrices share; every hidden matrix is
taken to scale by the same m. Attention's scores should be scaled by 1/d under μP: where the
graph scales them by 1/√(head dim), `plan` says so in a warning with the fix (std's attentions
take `:attn-scale (/ heads width)`) and changes nothing. (When the heads grow with the width and
the head size stays, 1/√d is a constant and μP's transfer does not need the change.)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import warnings

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.ir import roles as roles_mod
from sexpgpu.ir.graph import Graph, Init, Node, Param, walk

PARAMETRIZATIONS = ("standard", "mup")
# defrun's keywords for it
KEYS = ("parametrization", "base-width")
# The optimizer Spec's argument that carries `:base-width` under μP (front/experiment.py)
BASE_ARG = "mup-base-width"
SGD_LIKE = ("sgd", "momentum")
_HIDDEN = ("hidden", "expert", "conv")
_RANDOM = ("normal", "truncated-normal", "uniform", "fan-in")


class MupWarning(UserWarning):
  """A μP finding that changes nothing (attention scaled by 1/√d)."""


@dataclasses.dataclass(frozen=True)
class Rule:
  """One parameter's μP factors, relative to the file at the base width.

  Attributes:
    role: its role text (`ir.roles.Role.text`).
    init: what its initializer's std is multiplied by.
    adam, sgd: its learning-rate factor under an Adam-like and an SGD-like optimizer.
    output: the factor on the readout products it makes (1 for all but readouts).
  """

  role: str
  init: float
  adam: float
  sgd: float
  output: float = 1.0


@dataclasses.dataclass(frozen=True)
class Plan:
  """μP for one graph: the width, the base, each parameter's Rule and the warnings."""

  width: int
  base: int
  rules: dict[str, Rule]
  warnings: tuple[str, ...] = ()

  @property
  def ratio(self) -> float:
    """m = width / base-width."""
    return self.width / self.base

  def lr(self, path: str, optimizer: str) -> float:
    """The learning-rate factor of `path` under `optimizer` (a name of OPTIMIZERS, or
    `adamw` / `muon` for Muon's two parts)."""
    r = self.rules[path]
    if optimizer == "muon":
      return 1.0
    return r.sgd if optimizer in SGD_LIKE else r.adam


def check_parametrization(value, loc=None) -> str:
  """`standard` or `mup` from what `:parametrization` holds.

  Raises:
    SxError: E-MUP-001 for any other value, with the nearest names.
  """
  name = getattr(value, "name", value)
  if isinstance(name, str) and name in PARAMETRIZATIONS:
    return name
  shown = str(name) if isinstance(name, str) else repr(value)
  raise SxError("E-MUP-001", f"defrun :parametrization is `{shown}`; it is one of "
                f"{', '.join(PARAMETRIZATIONS)}", location=loc,
                fix=(did_you_mean(shown, PARAMETRIZATIONS) + " " if isinstance(name, str) and
                     did_you_mean(shown, PARAMETRIZATIONS) else "") +
                ":parametrization mup :base-width 64 (or leave it out: standard)")


def check_base_width(value, loc=None) -> int:
  """`:base-width` as a positive int.

  Raises:
    SxError: E-MUP-002 for anything else (absent under mup, 0, negative, a float, a string).
  """
  if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
    return value
  raise SxError("E-MUP-002", f"defrun :base-width is {'absent' if value is None else repr(value)}"
                "; under :parametrization mup it is the width (a positive integer) at which "
                "μP equals the model as written", location=loc,
                fix=":base-width 64, the width your learning rate was tuned at (the smallest "
                "width you train is a good choice)")


def settle(optimizer, run: dict, kws: dict, evaluate, loc):
  """defrun's `:parametrization` and `:base-width` (forms in `kws`) checked and recorded in
  `run`; under mup the optimizer Spec returned carries the base width (BASE_ARG), which is
  how the lowering's learning-rate factors and the compile's graph pass find it.

  `evaluate(form)` evaluates a form: a knob or def named after `:parametrization` gives its
  value, and a bare name bound to nothing (`mup`) is read as written.

  Raises:
    SxError: E-MUP-001 (an unknown parametrization), E-MUP-002 (a bad base width).
  """
  p, w = kws.get("parametrization"), kws.get("base-width")
  value = "standard"
  if p is not None:
    try:
      value = evaluate(p)
    except SxError as e:
      if e.code != "E-NAME-001" or not isinstance(getattr(p, "value", None), str):
        raise
      value = str(p.value)
  name = check_parametrization(value, p.loc if p is not None else loc)
  base = evaluate(w) if w is not None else None
  run["parametrization"] = name
  if name == "standard":
    if w is not None:
      check_base_width(base, w.loc)
    return optimizer
  run["base-width"] = check_base_width(base, w.loc if w is not None else loc)
  return dataclasses.replace(optimizer, args=optimizer.args + ((BASE_ARG, run["base-width"]),))


def base_width(spec) -> int | None:
  """The `:base-width` an optimizer Spec carries under μP (None: standard)."""
  return spec.get(BASE_ARG) if spec is not None else None


def _axes_scaling(role: roles_mod.Role, param: Param) -> set[int]:
  """Which of the parameter's own axes grow with the width, by role."""
  own = set(range(len(param.shape))) - set(role.experts)
  if role.role in _HIDDEN:
    return own
  if role.role == "readout":
    return set(role.contracted)
  if role.role == "embedding":
    return own - {0}
  if role.role in ("norm", "bias"):
    return own
  return set()


def _init_factor(role: roles_mod.Role, param: Param, m: float) -> float:
  if param.init.kind not in _RANDOM:
    return 1.0
  target = 1 / math.sqrt(m) if role.role in _HIDDEN else 1.0
  natural = 1.0
  if param.init.kind == "fan-in":  # its std is 1/√(all but the last axis) already
    fan_axes = set(range(len(param.shape) - 1)) if len(param.shape) > 1 else {0}
    if fan_axes & _axes_scaling(role, param):
      natural = 1 / math.sqrt(m)
  return target / natural


def rule(role: roles_mod.Role, param: Param, m: float) -> Rule:
  """One parameter's μP factors at width ratio `m` (the table in this module's docstring)."""
  text = role.text()
  init = _init_factor(role, param, m)
  if role.role in _HIDDEN:
    return Rule(text, init, 1 / m, 1.0)
  if role.role == "readout" or role.tied:
    return Rule(text, init, 1.0, m, 1 / m)
  if role.role in ("embedding", "norm", "bias"):
    return Rule(text, init, 1.0, m)
  return Rule(text, init, 1.0, 1.0)


def _product_uses(graph: Graph, found: dict) -> list[tuple[str, Node, int]]:
  """(readout path, the op reading it, input index) for each readout use making logits."""
  nodes = roles_mod.all_nodes(graph)
  users = roles_mod._users(nodes)
  out = []
  for node in nodes:
    if node.op != "param":
      continue
    path = node.attr("path")
    r = found.get(path)
    if r is None or not (r.role == "readout" or r.tied):
      continue
    for use in roles_mod._uses(node, users):
      if use.kind == "matmul" and use.node is not None:
        out.append((path, use.node, use.contracted))
  return out


def model_width(graph: Graph, found: dict | None = None) -> int | None:
  """The model's width: the readout's fan-in (the axes its logits' product contracts), else
  the fan-in most hidden matrices share; None when the graph has neither."""
  found = found if found is not None else roles_mod.roles(graph)
  for path, node, contracted in _product_uses(graph, found):
    shape = graph.params[path].shape
    if contracted:
      return math.prod(shape[a] for a in contracted)
  fans = collections.Counter(r.fan_in for r in found.values()
                             if r.role in ("hidden", "expert") and r.fan_in)
  return fans.most_common(1)[0][0] if fans else None


def plan(graph: Graph, base: int, where=None) -> Plan:
  """μP's factors for every parameter of `graph` (a loss graph) against `base`.

  Raises:
    SxError: E-MUP-003 when the graph has no readout and no hidden matrix to read a width
      from.
  """
  found = roles_mod.roles(graph)
  width = model_width(graph, found)
  if width is None:
    raise SxError("E-MUP-003", "μP needs the model's width, read from the readout's fan-in "
                  "or the hidden matrices' fan-in, and this loss graph has neither",
                  location=where, fix="write :role readout (or hidden) on the param whose "
                  "fan-in is the model's width, or drop :parametrization mup")
  m = width / base
  rules = {path: rule(found[path], p, m) for path, p in graph.params.items()}
  return Plan(width, base, rules, tuple(attention_warnings(graph)))


def attention_warnings(graph: Graph) -> list[str]:
  """A line for each attention that scales its scores by 1/√(head dim), μP's 1/d not."""
  out, seen = [], set()
  for node in roles_mod.all_nodes(graph):
    dh = scale = None
    if node.op == "sdpa":
      dh, scale = node.inputs[0].shape[-1], node.attr("scale")
    elif node.op in ("*", "/") and len(node.inputs) == 2:
      a, b = node.inputs
      if isinstance(a, Node) and a.op == "einsum" and isinstance(b, (int, float)):
        lhs = a.attr("spec").replace(" ", "").split("->")[0].split(",")
        if len(lhs) == 2 and lhs[0][-1] == lhs[1][-1] and a.inputs[0].shape:
          dh = a.inputs[0].shape[-1]
          scale = float(b) if node.op == "*" else 1 / float(b) if b else None
    if dh and scale and dh > 1 and math.isclose(scale, dh ** -0.5, rel_tol=1e-4):
      where = str(node.loc) if node.loc is not None else node.scope
      if where not in seen:
        seen.add(where)
        out.append(f"attention at {where} scales its scores by 1/√d (d = {dh}); μP scales "
                   f"them by 1/d: pass :attn-scale (/ heads width) to std's model (transformer-lm, "
                   "gpt2, llama, their blocks and attentions take it), or in your own attention "
                   "write (* scores (/ 1.0 dh)) where it writes (* scores (rsqrt dh))")
  return out


def apply(graph: Graph, p: Plan, warn: bool = True) -> Graph:
  """`graph` under μP: each random initializer scaled by its Rule's `init`, each product
  that a readout parameter (by path) makes by matmul or einsum multiplied by its Rule's
  `output` (1/m: a graph-level `*` after the product; for rewrite.py's fused
  chunked-cross-entropy, on its hidden input, which is the same product), the attention
  warnings issued as MupWarning."""
  if warn:
    for line in p.warnings:
      warnings.warn(line, MupWarning, stacklevel=2)
  params = {path: _scaled(prm, p.rules[path].init) if path in p.rules else prm
            for path, prm in graph.params.items()}
  out = {path for path, r in p.rules.items() if r.output != 1.0}
  nodes = roles_mod.all_nodes(graph)
  users = roles_mod._users(nodes)
  targets: dict[int, float] = {}
  for node in nodes:
    if node.op == "param" and node.attr("path") in out:
      factor = p.rules[node.attr("path")].output
      for use in roles_mod._uses(node, users):
        if use.kind == "matmul" and use.node is not None:
          targets[use.node.uid] = factor
    elif node.op == "chunked-cross-entropy" and _param_path(node.inputs[1]) in out:
      targets[node.uid] = p.rules[_param_path(node.inputs[1])].output
  new = _rewrite(graph, targets)
  return Graph(graph.name, graph.inputs, new["outputs"], params, new["taps"])


def apply_stages(stages: list, passes: dict, spec) -> None:
  """The compiled experiment under μP when its optimizer Spec carries a base width: each
  stage's loss graph and each pass's metric graphs rewritten by `apply` with the plan read
  from the first stage's loss graph (its roles decide the readout); nothing otherwise.

  Raises:
    SxError: E-MUP-003 (`plan`, `apply`).
  """
  base = base_width(spec)
  if base is None:
    return
  p = plan(stages[0].graph, int(base), spec.loc)
  for i, st in enumerate(stages):
    st.graph = apply(st.graph, p, warn=i == 0)
  for name, graphs in passes.items():
    passes[name] = {m: apply(g, p, warn=False) for m, g in graphs.items()}


def follow(graph: Graph, loss_graph: Graph, spec) -> Graph:
  """Another graph of the same model (sample's and eval's logits) under the run's μP: the
  readout's output multiplier that `apply_stages` put in the loss graph, the plan read from
  `loss_graph`; `graph` itself when the run is standard."""
  base = base_width(spec)
  if base is None:
    return graph
  return apply(graph, plan(loss_graph, int(base), spec.loc), warn=False)


def output_multipliers(graph: Graph, spec) -> dict[str, tuple[float, bool]]:
  """Under the run's μP (`spec`, the optimizer Spec, carries the base width), each readout
  parameter's output multiplier (1/m) and whether it is tied to the embedding, the plan read
  from `graph` (the loss graph); {} when the run is standard. What an export to a format that
  has no output multiplier (a Hugging Face twin) folds into the readout's weight.

  Raises:
    SxError: E-MUP-003 (`plan`).
  """
  base = base_width(spec)
  if base is None:
    return {}
  found = roles_mod.roles(graph)
  p = plan(graph, int(base), spec.loc)
  return {path: (r.output, bool(found[path].tied)) for path, r in p.rules.items()
          if r.output != 1.0}


def _param_path(node: Node) -> str | None:
  while isinstance(node, Node):
    if node.op == "param":
      return node.attr("path")
    if node.op not in roles_mod._SAME_AXES + ("transpose",):
      return None
    node = node.inputs[0]
  return None


def _scaled(prm: Param, factor: float) -> Param:
  if factor == 1.0 or prm.init.kind not in _RANDOM:
    return prm
  return dataclasses.replace(prm, init=Init(prm.init.kind, prm.init.value * factor))


def _rewrite(graph: Graph, targets: dict[int, float]) -> dict:
  """The graph's outputs and taps with each target node's product multiplied by its factor
  (every node downstream rebuilt; bodies are left as they are)."""
  roots = list(graph.outputs.values()) + [n for ns in graph.taps.values() for n in ns]
  order = list(walk(roots))
  missing = set(targets) - {n.uid for n in order}
  if missing:
    raise SxError("E-MUP-003", "μP's output multiplier goes on the readout's product, and "
                  "this graph computes it inside a repeat or scan body",
                  fix="compute the logits outside the repeat (after the blocks), or drop "
                  ":parametrization mup")
  done: dict[int, Node] = {}
  for node in order:
    ins = tuple(done.get(x.uid, x) if isinstance(x, Node) else x for x in node.inputs)
    if node.uid in targets and node.op == "chunked-cross-entropy":
      h = ins[0]
      ins = (Node("*", (h, targets[node.uid]), (), h.dtype, h.shape, node.loc, node.scope),
             ) + ins[1:]
    if ins != node.inputs:
      node_new = Node(node.op, ins, node.attrs, node.dtype, node.shape, node.loc, node.scope)
    else:
      node_new = node
    if node.uid in targets and node.op != "chunked-cross-entropy":
      node_new = Node("*", (node_new, targets[node.uid]), (), node.dtype, node.shape,
                      node.loc, node.scope)
    if node_new is not node:
      done[node.uid] = node_new
  return {"outputs": {k: done.get(v.uid, v) for k, v in graph.outputs.items()},
          "taps": {k: [done.get(v.uid, v) for v in vs] for k, vs in graph.taps.items()}}

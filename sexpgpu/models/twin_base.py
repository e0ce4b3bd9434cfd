"""What every Hugging Face twin shares: a tensor of the twin as a parameter here holds it, a
standard model's place in an experiment, and the readers of a model's graph (its scope's
nodes, a norm's epsilon, the rotary table) that the twins' tables use."""

from __future__ import annotations

import dataclasses
import math

from sexpgpu.errors import SxError
from sexpgpu.ir.graph import Node, walk


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One of the twin's tensors, as a parameter here holds it."""

  name: str  # the twin's name; "{i}" stands for the layer
  shape: tuple[int, ...]  # its shape here, one layer's (the twin's reversed when transposed)
  layers: int | None  # stacked here over this many layers, else None
  transposed: bool = False  # the twin keeps it transposed ([out in] for [in out])
  experts: int | None = None  # stacked here over this many experts (after the layers);
  # "{e}" in the name stands for the expert


@dataclasses.dataclass(frozen=True)
class Twin:
  """A standard model's place in an experiment and its twin."""

  kind: str  # "gpt2", "llama", "mixtral" or "mamba"
  root: str  # "lm/gpt2/"
  config: dict  # the twin's config.json
  positions: int  # the longest window: n_positions, max_position_embeddings
  tensors: dict[str, Tensor]  # .sx path → its twin tensor
  prefix: str  # the twin's base-model prefix, absent from some folders ("transformer.")
  tied_head: bool  # the head is the token embedding (not saved as its own tensor)
  embed: str = "wte"  # the token embedding's path under the root (a tied head's twin)

  @property
  def architecture(self) -> str:
    return self.config["architectures"][0]


def config_differences(theirs: dict, ours: dict, keys) -> list[str]:
  """One line for each of `keys` whose value in a `config.json` (theirs) differs from ours."""
  return [f"config.json {k} {theirs.get(k)!r} there, {ours[k]!r} here" for k in keys
          if theirs.get(k) != ours[k]]


# A llama-shaped block's norms and attention (llama's, mixtral's): .sx path under the block
# → (the Hugging Face name under `model.layers.N.`, whether it is stored transposed).
LLAMA_ATTENTION = {
    "input_layernorm/scale": ("input_layernorm.weight", False),
    "self_attn/q_proj/w": ("self_attn.q_proj.weight", True),
    "self_attn/k_proj/w": ("self_attn.k_proj.weight", True),
    "self_attn/v_proj/w": ("self_attn.v_proj.weight", True),
    "self_attn/o_proj/w": ("self_attn.o_proj.weight", True),
    "post_attention_layernorm/scale": ("post_attention_layernorm.weight", False),
}

# The sizes a llama-shaped config.json (llama's, mixtral's) must give exactly as here.
LLAMA_SIZES = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "max_position_embeddings")


def llama_shaped_problems(theirs: dict, ours: dict, defaults: dict) -> list[str]:
  """What of a llama-shaped config.json differs from the model here: its sizes exactly, and
  the keys it may leave out against the family's `defaults` (the key/value heads default
  to the heads, the head's width to the width over the heads)."""
  defaults = {"num_key_value_heads": theirs.get("num_attention_heads"), **defaults,
              "head_dim": ours["hidden_size"] // max(ours["num_attention_heads"] or 1, 1)}
  return (config_differences(theirs, ours, LLAMA_SIZES)
          + _differ_from_defaults(theirs, ours, defaults))


def _differ_from_defaults(theirs: dict, ours: dict, defaults: dict) -> list[str]:
  """Keys a config.json may leave out, each read with the twin's default when it does.

  A `head_dim` of null is the default too; the norm's eps and rope's theta compare as floats.
  """
  out = []
  for key, default in defaults.items():
    value = theirs.get(key, default)
    value = default if value is None and key == "head_dim" else value
    same = (math.isclose(float(value), float(ours[key]), rel_tol=1e-9)
            if key in ("rms_norm_eps", "rope_theta") else value == ours[key])
    if not same:
      out.append(f"config.json {key} {value!r} there, {ours[key]!r} here")
  return out


def layer_count(params: dict, scope: str) -> int:
  """The depth of the repeat stack under `scope` (its parameters' first axis), else 0."""
  stacked = [p for path, p in params.items() if path.startswith(scope)]
  return stacked[0].stack[0] if stacked and stacked[0].stack else 0


def scope_nodes(graph, root: str) -> list[Node]:
  """The nodes under the model's scope, the bodies of repeats included."""
  scope = root.rstrip("/")
  out, todo = [], list(graph.nodes())
  while todo:
    n = todo.pop()
    if n.scope.startswith(scope):
      out.append(n)
    if n.op == "repeat":
      todo.extend(walk([n.attr("body").output]))
  return out


def scope_literal(node: Node, scope_end: str, op: str, default: float) -> float:
  """The float operand of an `op` node in a scope ending `scope_end` (a norm's epsilon)."""
  if node.op == op and node.scope.endswith(scope_end):
    lits = [i for i in node.inputs if isinstance(i, float)]
    if lits:
      return lits[0]
  return default




def rotary(graph, root: str, layers: int, width: int, kind: str,
           fix: str) -> tuple[int, int, float, float]:
  """(context, half, base, eps) of a model built on std/llama's attention: the rotary table
  [context half] of the first rope (head width 2·half), its base read from the frequencies'
  exponent (-log(base)/half), and the final norm's epsilon.

  Raises:
    SxError: E-EXPORT-001 when a model with layers has no rotary table in its graph.
  """
  context = half = base = None
  eps = 1e-6
  for node in scope_nodes(graph, root):
    if node.op == "cos" and "/rope" in node.scope and context is None and len(node.shape) == 2:
      context, half = node.shape
    if (node.op == "*" and "/rope" in node.scope and base is None and len(node.shape) == 1
        and any(isinstance(i, float) and i < 0 for i in node.inputs)):
      lit = next(i for i in node.inputs if isinstance(i, float))
      base = float(f"{math.exp(-lit * node.shape[0]):.10g}")
    eps = scope_literal(node, "/norm", "+", eps)
  if context is None or base is None:
    if layers:
      raise SxError("E-EXPORT-001", f"the {kind} model's rotary table cannot be read from "
                    "its graph", where=root, fix=fix)
    context, half, base = 0, max(width // 2, 1), 10000.0
  return context, half, base, eps

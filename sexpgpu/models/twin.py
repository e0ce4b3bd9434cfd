"""The GPT-2 twin: `.sx` parameter paths of a `gpt2` model ↔ `GPT2LMHeadModel`'s names.

A model built from `std/gpt2` keeps its parameters under one root (`lm/gpt2/`): `wte`,
`wpe`, `ln_f/…` and the layers stacked under `h/gpt2-block/…`. Its twin's tensors are
`transformer.wte.weight`, `transformer.h.<i>.attn.c_attn.weight`, … (PyTorch's names, the
ones `from_pretrained` reads); a folder saved by the Flax twin (`kernel`, `scale`,
`embedding`, Conv1D kernels transposed) imports too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.ir.graph import Node, walk

# path under the root → the twin's name under `transformer.` ("{i}": the layer)
TOP = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f/scale": "ln_f.weight",
       "ln_f/bias": "ln_f.bias"}
BLOCK = {
    "ln_1/scale": "ln_1.weight", "ln_1/bias": "ln_1.bias",
    "attn/c_attn/w": "attn.c_attn.weight", "attn/c_attn/b": "attn.c_attn.bias",
    "attn/c_proj/w": "attn.c_proj.weight", "attn/c_proj/b": "attn.c_proj.bias",
    "ln_2/scale": "ln_2.weight", "ln_2/bias": "ln_2.bias",
    "mlp/c_fc/w": "mlp.c_fc.weight", "mlp/c_fc/b": "mlp.c_fc.bias",
    "mlp/c_proj/w": "mlp.c_proj.weight", "mlp/c_proj/b": "mlp.c_proj.bias",
}
BLOCK_SCOPE = "h/gpt2-block/"
FIX = ("build the model with (gpt2 tokens ...) from (require std/gpt2), or export with "
       "--format safetensors, which keeps every parameter under its .sx path")


@dataclasses.dataclass(frozen=True)
class Gpt2:
  """A `gpt2` model's place in an experiment and its twin's configuration."""

  root: str  # "lm/gpt2/"
  vocab: int
  width: int
  layers: int
  heads: int
  positions: int
  eps: float
  drop: float

  def sx_to_twin(self) -> dict[str, tuple[str, int | None]]:
    """.sx path → (the twin's name for layer 0 (with `{i}`) or its one name, stacked?)."""
    out: dict[str, tuple[str, int | None]] = {}
    for rel, name in TOP.items():
      out[self.root + rel] = ("transformer." + name, None)
    for rel, name in BLOCK.items():
      out[self.root + BLOCK_SCOPE + rel] = ("transformer.h.{i}." + name, self.layers)
    return out

  def hf_config(self, eos: int | None = None) -> dict:
    """The twin's config.json (GPT2Config's keys)."""
    eos = min(50256, self.vocab - 1) if eos is None else eos
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": self.vocab, "n_positions": self.positions, "n_embd": self.width,
            "n_layer": self.layers, "n_head": self.heads, "n_inner": None,
            "activation_function": "gelu_new", "resid_pdrop": self.drop,
            "embd_pdrop": self.drop, "attn_pdrop": self.drop,
            "layer_norm_epsilon": self.eps, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
            "bos_token_id": eos, "eos_token_id": eos, "use_cache": True,
            "torch_dtype": "float32"}


def find_gpt2(params: dict, graph: Any, what: str) -> Gpt2:
  """The `gpt2` model among an experiment's parameters.

  Args:
    params: path → Param (the experiment's parameter table).
    graph: a graph that reads them (the loss's), to read heads, eps and dropout from.
    what: the command that needs the twin, for the error ("--format hf").

  Raises:
    SxError: E-EXPORT-001 naming every parameter that has no place in the twin.
  """
  roots = sorted(p[:-len("wte")] for p in params if p == "wte" or p.endswith("/wte"))
  roots = [r for r in roots if r + "wpe" in params]
  if len(roots) != 1:
    names = sorted(params)
    raise SxError("E-EXPORT-001", f"{what}: the model is not one gpt2 "
                  f"({'no' if not roots else len(roots)} wte/wpe pair found); parameters "
                  f"with no place in GPT2LMHeadModel: {', '.join(names[:12])}"
                  + (f" and {len(names) - 12} more" if len(names) > 12 else ""),
                  where=what, fix=FIX)
  root = roots[0]
  wte, wpe = params[root + "wte"], params[root + "wpe"]
  vocab, width = wte.full_shape
  layer_ps = [p for path, p in params.items() if path.startswith(root + BLOCK_SCOPE)]
  layers = layer_ps[0].stack[0] if layer_ps and layer_ps[0].stack else 0
  probe = Gpt2(root, vocab, width, layers, 1, wpe.full_shape[0], 1e-5, 0.0)
  want = {path: _twin_shape(path, probe) for path in probe.sx_to_twin()}
  extra = sorted(p for p in params if p not in want)
  wrong = sorted(f"{p} {list(params[p].full_shape)} (the twin's is {list(want[p])})"
                 for p in params if p in want and tuple(params[p].full_shape) != want[p])
  missing = sorted(p for p in want if p not in params)
  if extra or wrong or missing:
    parts = ([f"no place in GPT2LMHeadModel: {', '.join(extra)}"] if extra else []) + (
        [f"another shape: {'; '.join(wrong)}"] if wrong else []) + (
        [f"missing: {', '.join(missing)}"] if missing else [])
    raise SxError("E-EXPORT-001", f"{what}: parameters that do not map onto the gpt2 twin: "
                  + " | ".join(parts), where=what, fix=FIX)
  heads, eps, drop = _read_graph(graph, root, width)
  return dataclasses.replace(probe, heads=heads, eps=eps, drop=drop)


def _twin_shape(path: str, g: Gpt2) -> tuple[int, ...]:
  rel = path[len(g.root):]
  d, v, n, L = g.width, g.vocab, g.positions, g.layers
  top = {"wte": (v, d), "wpe": (n, d), "ln_f/scale": (d,), "ln_f/bias": (d,)}
  if rel in top:
    return top[rel]
  rel = rel[len(BLOCK_SCOPE):]
  shapes = {"attn/c_attn/w": (d, 3 * d), "attn/c_attn/b": (3 * d,), "attn/c_proj/w": (d, d),
            "mlp/c_fc/w": (d, 4 * d), "mlp/c_fc/b": (4 * d,), "mlp/c_proj/w": (4 * d, d)}
  return (L,) + shapes.get(rel, (d,))


def _all_nodes(graph) -> list[Node]:
  out, todo = [], list(graph.nodes())
  while todo:
    n = todo.pop()
    out.append(n)
    if n.op == "repeat":
      body = n.attr("body")
      todo.extend(walk([body.output]))
  return out


def _read_graph(graph, root: str, width: int) -> tuple[int, float, float]:
  """Heads (the attention's [b t heads dh] reshape), layernorm eps and dropout rate."""
  heads, eps, drop = None, 1e-5, 0.0
  scope = root.rstrip("/")
  for n in _all_nodes(graph):
    if not n.scope.startswith(scope):
      continue
    if (n.op == "reshape" and n.scope.endswith("/attn") and len(n.shape) == 4
        and n.shape[2] * n.shape[3] == width):
      heads = n.shape[2]
    if n.op == "+" and n.scope.endswith("/ln_f"):
      lits = [i for i in n.inputs if isinstance(i, float)]
      if lits:
        eps = lits[0]
    if n.op == "dropout":
      drop = max(drop, float(n.attr("rate")))
  if heads is None:
    raise SxError("E-EXPORT-001", "the gpt2 model's attention heads cannot be read from its "
                  "graph", where=root, fix=FIX)
  return heads, eps, drop


def to_twin(g: Gpt2, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The twin's tensors (PyTorch names; the tied lm_head is left out, as transformers does)."""
  out = {}
  for path, (name, stacked) in g.sx_to_twin().items():
    value = np.asarray(params[path])
    if stacked is None:
      out[name] = np.ascontiguousarray(value)
    else:
      for i in range(stacked):
        out[name.format(i=i)] = np.ascontiguousarray(value[i])
  return out


def _flax_name(name: str) -> tuple[str, bool]:
  """A PyTorch twin name → the Flax twin's, and whether its value is transposed there."""
  if name.endswith(("wte.weight", "wpe.weight")):
    return name[:-len("weight")] + "embedding", False
  if (name.startswith("ln_") or ".ln_" in name) and name.endswith(".weight"):
    return name[:-len("weight")] + "scale", False
  if name.endswith(".weight"):
    return name[:-len("weight")] + "kernel", True
  return name, False


def from_twin(g: Gpt2, tensors: dict[str, np.ndarray], where: str) -> tuple[dict, list[str]]:
  """The `.sx` parameters from a twin's tensors (PyTorch or Flax names, with or without
  the `transformer.` prefix).

  Returns:
    (path → array, problems): problems lists every missing, extra or mismatched tensor;
    the caller raises it with its own code.
  """
  names = {k[len("transformer."):] if k.startswith("transformer.") else k: k for k in tensors}
  used, problems, out = set(), [], {}

  def get(name: str, shape: tuple) -> np.ndarray | None:
    short = name[len("transformer."):]
    flax, transposed = _flax_name(short)
    for key, t in ((short, False), (flax, transposed)):
      if key in names:
        used.add(key)
        v = np.asarray(tensors[names[key]])
        v = v.T if t else v
        if tuple(v.shape) != tuple(shape):
          problems.append(f"{names[key]}: {v.dtype}{list(v.shape)} there, "
                          f"[{', '.join(map(str, shape))}] here")
          return None
        return v
    problems.append(f"{name}: missing there")
    return None

  for path, (name, stacked) in g.sx_to_twin().items():
    shape = _twin_shape(path, g)
    if stacked is None:
      v = get(name, shape)
      if v is not None:
        out[path] = v
    else:
      layers = [get(name.format(i=i), shape[1:]) for i in range(stacked)]
      if all(x is not None for x in layers):
        out[path] = np.stack(layers)
  for key, full in names.items():
    if key in used or key.endswith((".attn.bias", ".attn.masked_bias")):
      continue  # GPT-2's causal-mask buffers of old transformers versions
    if key in ("lm_head.weight", "lm_head.kernel"):
      v = np.asarray(tensors[full])
      v = v.T if key.endswith("kernel") else v
      wte = out.get(g.root + "wte")
      if wte is not None and v.shape == wte.shape and np.array_equal(v, wte):
        continue  # the tied head, saved anyway
      problems.append(f"{full}: an untied head there; gpt2 ties it to wte")
      continue
    problems.append(f"{full}: {np.asarray(tensors[full]).dtype}"
                    f"{list(np.shape(tensors[full]))} there, no place here")
  return out, problems

"""The Hugging Face twins of `std/gpt2`, `std/llama`, `std/mixtral` and `std/mamba`: `.sx`
parameter paths ↔ the twin's tensor names, its config.json, and what of a twin's folder does
not fit (Mixtral's and Mamba's tables are in `twin_families`).

A model built from `std/gpt2` keeps its parameters under one root (`lm/gpt2/`): `wte`,
`wpe`, `ln_f/…` and the layers stacked under `h/gpt2-block/…`; its twin `GPT2LMHeadModel`
names them `transformer.wte.weight`, `transformer.h.<i>.attn.c_attn.weight`, … A model built
from `std/llama` (`lm/llama/`: `embed_tokens`, `layers/llama-block/…`, `norm/scale`,
`lm_head/w`) is `LlamaForCausalLM`'s `model.embed_tokens.weight`,
`model.layers.<i>.self_attn.q_proj.weight`, …, `lm_head.weight`; its projections are stored
[in out] here and [out in] there. The names are PyTorch's, the ones `from_pretrained` reads;
a folder saved by a Flax twin (`kernel` transposed, `embedding`, `scale`) imports too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sexpgpu import bounded
from sexpgpu.errors import SxError
from sexpgpu.models import twin_families as families
from sexpgpu.models.twin_base import (Tensor, Twin, config_differences, layer_count,
                                      scope_literal, scope_nodes, llama_shaped_problems, rotary,
                                      LLAMA_ATTENTION)

FIX = ("build the model with (gpt2 tokens ...) from (require std/gpt2), (llama tokens ...) "
       "from (require std/llama), (mixtral tokens ...) from (require std/mixtral) or (mamba "
       "tokens ...) from (require std/mamba), or export with --format safetensors, which keeps "
       "every parameter under its .sx path")


# --- GPT-2 ----------------------------------------------------------------------------------

GPT2_TOP = {"wte": "wte.weight", "wpe": "wpe.weight", "ln_f/scale": "ln_f.weight",
            "ln_f/bias": "ln_f.bias"}
GPT2_BLOCK = {
    "ln_1/scale": "ln_1.weight", "ln_1/bias": "ln_1.bias",
    "attn/c_attn/w": "attn.c_attn.weight", "attn/c_attn/b": "attn.c_attn.bias",
    "attn/c_proj/w": "attn.c_proj.weight", "attn/c_proj/b": "attn.c_proj.bias",
    "ln_2/scale": "ln_2.weight", "ln_2/bias": "ln_2.bias",
    "mlp/c_fc/w": "mlp.c_fc.weight", "mlp/c_fc/b": "mlp.c_fc.bias",
    "mlp/c_proj/w": "mlp.c_proj.weight", "mlp/c_proj/b": "mlp.c_proj.bias",
}
GPT2_SCOPE = "h/gpt2-block/"
GPT2_ENDOFTEXT = 50256  # <|endoftext|> in GPT-2's own 50257-token vocabulary


def _gpt2(root: str, params: dict, graph) -> Twin:
  vocab, width = params[root + "wte"].full_shape
  positions = params[root + "wpe"].full_shape[0]
  layers = layer_count(params, root + GPT2_SCOPE)
  d, v, n = width, vocab, positions
  top = {"wte": (v, d), "wpe": (n, d), "ln_f/scale": (d,), "ln_f/bias": (d,)}
  block = {"attn/c_attn/w": (d, 3 * d), "attn/c_attn/b": (3 * d,), "attn/c_proj/w": (d, d),
           "mlp/c_fc/w": (d, 4 * d), "mlp/c_fc/b": (4 * d,), "mlp/c_proj/w": (4 * d, d)}
  tensors = {root + rel: Tensor("transformer." + name, top[rel], None)
             for rel, name in GPT2_TOP.items()}
  tensors.update({root + GPT2_SCOPE + rel: Tensor("transformer.h.{i}." + name,
                                                  block.get(rel, (d,)), layers)
                  for rel, name in GPT2_BLOCK.items()})
  heads, eps, drop = None, 1e-5, 0.0
  for node in scope_nodes(graph, root):
    if (node.op == "reshape" and node.scope.endswith("/attn") and len(node.shape) == 4
        and node.shape[2] * node.shape[3] == width):
      heads = node.shape[2]
    eps = scope_literal(node, "/ln_f", "+", eps)
    if node.op == "dropout":
      drop = max(drop, float(node.attr("rate")))
  if heads is None and layers:
    raise SxError("E-EXPORT-001", "the gpt2 model's attention heads cannot be read from its "
                  "graph", where=root, fix=FIX)
  # GPT-2's own vocabulary ends with its <|endoftext|>; any other vocabulary's special
  # tokens are the tokenizer's to say (token_ids), never a guess at an ordinary word
  eos = GPT2_ENDOFTEXT if vocab == GPT2_ENDOFTEXT + 1 else None
  config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": vocab, "n_positions": positions, "n_embd": width,
            "n_layer": layers, "n_head": heads, "n_inner": None,
            "activation_function": "gelu_new", "resid_pdrop": drop,
            "embd_pdrop": drop, "attn_pdrop": drop,
            "layer_norm_epsilon": eps, "initializer_range": 0.02,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
            "bos_token_id": eos, "eos_token_id": eos, "use_cache": True,
            "torch_dtype": "float32"}
  return Twin("gpt2", root, config, positions, tensors, "transformer.", tied_head=True)


def _gpt2_config_problems(t: Twin, theirs: dict) -> list[str]:
  ours = t.config
  out = config_differences(theirs, ours, ("model_type", "vocab_size", "n_embd", "n_layer", "n_head",
                               "n_positions"))
  act = theirs.get("activation_function", "gelu_new")
  if act not in ("gelu_new", "gelu_pytorch_tanh"):
    out.append(f"config.json activation_function {act!r} there, the tanh GELU here")
  eps = float(theirs.get("layer_norm_epsilon", 1e-5))
  if abs(eps - ours["layer_norm_epsilon"]) > 1e-12:
    out.append(f"config.json layer_norm_epsilon {eps} there, {ours['layer_norm_epsilon']} here")
  if theirs.get("n_inner") not in (None, 4 * ours["n_embd"]):
    out.append(f"config.json n_inner {theirs.get('n_inner')} there, {4 * ours['n_embd']} here")
  if theirs.get("scale_attn_by_inverse_layer_idx") or theirs.get("tie_word_embeddings") is False:
    out.append("config.json scales attention by layer or unties the head; gpt2 does neither")
  return out


# --- special tokens -------------------------------------------------------------------------

# The names tokenizers give their document markers, most usual first.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


TOKENIZER_LIMIT = 256 * bounded.MiB  # a tokenizer.json (a few MB for a 128k vocabulary)
TOKENIZER_FIX = "give --tokenizer a tokenizer.json (sexpgpu tokenize writes one)"


def added_tokens(tokenizer: str) -> list[dict]:
  """The `added_tokens` records of a tokenizer.json (those that are objects), read within
  TOKENIZER_LIMIT.

  Raises:
    SxError: E-TOK-002 when the file is missing, no regular file, too large, not JSON or
      not an object.
  """
  data = bounded.read_json(tokenizer, limit=TOKENIZER_LIMIT, what="tokenizer",
                           code="E-TOK-002", where="--tokenizer", fix=TOKENIZER_FIX)
  added = data.get("added_tokens")
  return [t for t in added if isinstance(t, dict)] if isinstance(added, list) else []


def token_ids(tokenizer: str, vocab: int) -> dict[str, int | None]:
  """The twin's `bos_token_id` and `eos_token_id`, read from a tokenizer.json.

  The end-of-text id is the special token the tokenizer names as a document's end
  (`<|endoftext|>`, `</s>`, ...), or its only special token; the beginning-of-text id is
  its `<s>`-like token, else the same as the end (as GPT-2 has it). An id that the model's
  vocabulary does not reach, or none found, is None: `generate()` then stops at its length,
  never at an ordinary word.

  Args:
    tokenizer: a tokenizer.json path.
    vocab: the model's vocabulary size.

  Raises:
    SxError: E-TOK-002 when the file is not a tokenizer.json.
  """
  try:
    special = {str(t["content"]): int(t["id"]) for t in added_tokens(tokenizer)
               if t.get("special", True)}
  except (TypeError, KeyError, ValueError) as e:
    raise SxError("E-TOK-002", f"{tokenizer} is not a tokenizer.json: its added_tokens hold "
                  f"{type(e).__name__}: {e}", where="--tokenizer", fix=TOKENIZER_FIX) from None
  special = {k: v for k, v in special.items() if 0 <= v < vocab}
  eos = next((special[n] for n in EOS_NAMES if n in special), None)
  if eos is None and len(special) == 1:
    eos = next(iter(special.values()))
  bos = next((special[n] for n in BOS_NAMES if n in special), eos)
  return {"bos_token_id": bos, "eos_token_id": eos}


# --- Llama ----------------------------------------------------------------------------------

LLAMA_TOP = {"embed_tokens": ("model.embed_tokens.weight", False),
             "norm/scale": ("model.norm.weight", False), "lm_head/w": ("lm_head.weight", True)}
LLAMA_BLOCK = {
    **LLAMA_ATTENTION,
    "mlp/gate_proj/w": ("mlp.gate_proj.weight", True),
    "mlp/up_proj/w": ("mlp.up_proj.weight", True),
    "mlp/down_proj/w": ("mlp.down_proj.weight", True),
}
LLAMA_SCOPE = "layers/llama-block/"


def _llama(root: str, params: dict, graph) -> Twin:
  vocab, width = params[root + "embed_tokens"].full_shape
  layers = layer_count(params, root + LLAMA_SCOPE)

  def one(rel: str, axis: int, default: int) -> int:
    p = params.get(root + LLAMA_SCOPE + rel)
    return p.full_shape[1 + axis] if p is not None and len(p.full_shape) == 3 else default

  hidden = one("mlp/gate_proj/w", 1, 4 * width)
  kv_width = one("self_attn/k_proj/w", 1, width)
  context, half, base, eps = rotary(graph, root, layers, width, "llama", FIX)
  dh = 2 * half
  heads, kv = width // dh, kv_width // dh
  d, v, i, k = width, vocab, hidden, kv * dh
  top = {"embed_tokens": (v, d), "norm/scale": (d,), "lm_head/w": (d, v)}
  block = {"input_layernorm/scale": (d,), "self_attn/q_proj/w": (d, heads * dh),
           "self_attn/k_proj/w": (d, k), "self_attn/v_proj/w": (d, k),
           "self_attn/o_proj/w": (heads * dh, d), "post_attention_layernorm/scale": (d,),
           "mlp/gate_proj/w": (d, i), "mlp/up_proj/w": (d, i), "mlp/down_proj/w": (i, d)}
  tensors = {root + rel: Tensor(name, top[rel], None, tr)
             for rel, (name, tr) in LLAMA_TOP.items()}
  tensors.update({root + LLAMA_SCOPE + rel: Tensor("model.layers.{i}." + name, block[rel],
                                                   layers, tr)
                  for rel, (name, tr) in LLAMA_BLOCK.items()})
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab, "hidden_size": width, "intermediate_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": dh, "max_position_embeddings": context,
            "rms_norm_eps": eps, "rope_theta": base, "rope_scaling": None,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "pretraining_tp": 1, "tie_word_embeddings": False,
            "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None,
            "use_cache": True, "torch_dtype": "float32"}
  return Twin("llama", root, config, context, tensors, "model.", tied_head=False)


def _llama_config_problems(t: Twin, theirs: dict) -> list[str]:
  return llama_shaped_problems(theirs, t.config, {
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False,
      "mlp_bias": False, "rope_scaling": None})


# kind → (two paths under the model's root that say it is that kind, its twin, its config's
# problems); a mixtral has a llama's anchors too, and is a mixtral
KINDS = {"gpt2": (("wte", "wpe"), _gpt2, _gpt2_config_problems),
         "llama": (("embed_tokens", "lm_head/w"), _llama, _llama_config_problems),
         "mixtral": (("embed_tokens", families.MIXTRAL_SCOPE + "block_sparse_moe/gate/w"),
                     families.mixtral, families.mixtral_config_problems),
         "mamba": (("embeddings", families.MAMBA_SCOPE + "mixer/A_log"), families.mamba,
                   families.mamba_config_problems)}
NAMES = "GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM or MambaForCausalLM"


# --- finding a twin ---------------------------------------------------------------------------

def find(params: dict, graph: Any, what: str) -> Twin:
  """The standard model with a twin among an experiment's parameters.

  Args:
    params: path → Param (the experiment's parameter table).
    graph: a graph that reads them (the loss's), to read heads, epsilons and the like from.
    what: the command that needs the twin, for the error ("--format hf").

  Raises:
    SxError: E-EXPORT-001 naming every parameter that has no place in the twin.
  """
  from sexpgpu.ir.lora import base_params
  params = base_params(params)  # LoRA's adapters are beside the base model's twin, not in it
  found = []
  for kind, (anchors, _, _) in KINDS.items():
    first, second = anchors
    for path in params:
      if path == first or path.endswith("/" + first):
        root = path[:-len(first)]
        if root + second in params:
          found.append((kind, root))
  mixtrals = {r for k, r in found if k == "mixtral"}
  found = [(k, r) for k, r in found if not (k == "llama" and r in mixtrals)]
  if len(found) != 1:
    names = sorted(params)
    kinds = ", ".join(f"{k} at {r or '/'}" for k, r in found) or (
        "no wte/wpe, embed_tokens/lm_head or embeddings found")
    raise SxError("E-EXPORT-001", f"{what}: the model is not one gpt2, llama, mixtral or "
                  f"mamba ({kinds}); "
                  f"parameters with no place in {NAMES}: "
                  f"{', '.join(names[:12])}"
                  + (f" and {len(names) - 12} more" if len(names) > 12 else ""),
                  where=what, fix=FIX)
  kind, root = found[0]
  twin = KINDS[kind][1](root, params, graph)
  want = {p: ((t.layers,) if t.layers else ()) + ((t.experts,) if t.experts else ()) + t.shape
          for p, t in twin.tensors.items()}
  extra = sorted(p for p in params if p not in want)
  wrong = sorted(f"{p} {list(params[p].full_shape)} (the twin's is {list(want[p])})"
                 for p in params if p in want and tuple(params[p].full_shape) != want[p])
  missing = sorted(p for p in want if p not in params)
  if extra or wrong or missing:
    parts = ([f"no place in {twin.architecture}: {', '.join(extra)}"] if extra else []) + (
        [f"another shape: {'; '.join(wrong)}"] if wrong else []) + (
        [f"missing: {', '.join(missing)}"] if missing else [])
    raise SxError("E-EXPORT-001", f"{what}: parameters that do not map onto the {kind} twin: "
                  + " | ".join(parts), where=what, fix=FIX)
  return twin


def config_problems(twin: Twin, config: dict) -> list[str]:
  """What of a twin's config.json differs from the experiment's model (both sides)."""
  return KINDS[twin.kind][2](twin, config)


def from_folder(twin: Twin, tensors: dict[str, np.ndarray], config: dict,
                where: str) -> tuple[dict, list[str]]:
  """The `.sx` parameters from a twin's folder (its tensors and config.json), and every
  problem: the config's differences, then the tensors'; a folder of another model type is
  that one problem."""
  theirs = config.get("model_type")
  if theirs != twin.config["model_type"]:
    return {}, [f"a {theirs} folder (config.json model_type {theirs!r}), and this "
                f"experiment's model is a {twin.kind}"]
  params, problems = from_twin(twin, tensors, where, config)
  return params, config_problems(twin, config) + problems


# --- tensors both ways ------------------------------------------------------------------------

def to_twin(twin: Twin, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The twin's tensors by PyTorch's names (a tied head is left out, as transformers does)."""
  out = {}
  for path, t in twin.tensors.items():
    value = np.asarray(params[path])
    layers = [value[i] for i in range(t.layers)] if t.layers is not None else [value]
    for i, v in enumerate(layers):
      for e, w in enumerate([v[e] for e in range(t.experts)] if t.experts else [v]):
        out[t.name.format(i=i, e=e)] = np.ascontiguousarray(w.T if t.transposed else w)
  return out


def _other_names(name: str) -> list[tuple[str, bool]]:
  """The names a Flax twin gives a PyTorch name, each with whether it is transposed there."""
  if not name.endswith(".weight"):
    return []
  stem = name[:-len("weight")]
  return [(stem + "kernel", True), (stem + "embedding", False), (stem + "scale", False)]


def from_twin(twin: Twin, tensors: dict[str, np.ndarray], where: str,
              config: dict | None = None) -> tuple[dict, list[str]]:
  """The `.sx` parameters from a twin's tensors (PyTorch or Flax names, with or without the
  base model's prefix).

  Args:
    config: the folder's config.json, if known: a llama whose head is tied to its embedding
      (`tie_word_embeddings`) gets the embedding as its head.

  Returns:
    (path → array, problems): problems lists every missing, extra or mismatched tensor;
    the caller raises it with its own code.
  """
  names = {k[len(twin.prefix):] if k.startswith(twin.prefix) else k: k for k in tensors}
  used, problems, out = set(), [], {}

  def get(name: str, shape: tuple, transposed: bool) -> np.ndarray | None:
    short = name[len(twin.prefix):] if name.startswith(twin.prefix) else name
    for key, flip in [(short, False)] + _other_names(short):
      if key in names:
        used.add(key)
        v = np.asarray(tensors[names[key]])
        v = v.T if flip != transposed else v
        if tuple(v.shape) != tuple(shape):
          there = v.T.shape if transposed else v.shape
          here = tuple(reversed(shape)) if transposed else shape
          problems.append(f"{names[key]}: {v.dtype}{list(there)} there, "
                          f"[{', '.join(map(str, here))}] here")
          return None
        return v
    problems.append(f"{name}: missing there")
    return None

  tied = (twin.kind == "llama" and (config or {}).get("tie_word_embeddings")
          and not any(k in names for k in ("lm_head.weight", "lm_head.kernel")))
  for path, t in twin.tensors.items():
    if tied and t.name == "lm_head.weight":
      continue
    if t.layers is None:
      v = get(t.name, t.shape, t.transposed)
      if v is not None:
        out[path] = v
    else:
      layers = [[get(t.name.format(i=i, e=e), t.shape, t.transposed)
                 for e in range(t.experts or 1)] for i in range(t.layers)]
      if all(x is not None for one in layers for x in one):
        out[path] = np.stack([np.stack(one) if t.experts else one[0] for one in layers])
  if tied and twin.root + "embed_tokens" in out:
    out[twin.root + "lm_head/w"] = np.ascontiguousarray(out[twin.root + "embed_tokens"].T)
  for key, full in names.items():
    if key in used or key.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")):
      continue  # buffers of older transformers versions: GPT-2's causal mask, Llama's rope
    if twin.tied_head and key in ("lm_head.weight", "lm_head.kernel"):
      v = np.asarray(tensors[full])
      v = v.T if key.endswith("kernel") else v
      wte = out.get(twin.root + twin.embed)
      if wte is not None and v.shape == wte.shape and np.array_equal(v, wte):
        continue  # the tied head, saved anyway
      problems.append(f"{full}: an untied head there; {twin.kind} ties it to {twin.embed}")
      continue
    problems.append(f"{full}: {np.asarray(tensors[full]).dtype}"
                    f"{list(np.shape(tensors[full]))} there, no place here")
  return out, problems

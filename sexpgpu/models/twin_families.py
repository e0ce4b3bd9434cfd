"""The Hugging Face twins of `std/mixtral` and `std/mamba`: their tensors and config.json.

A model built from `std/mixtral` (`lm/mixtral/`) is `MixtralForCausalLM`: Llama's
attention and norms under the same names, and `block_sparse_moe/gate/w` and
`block_sparse_moe/experts/w1|w2|w3` (stacked [layers experts in out] here) for the twin's
`model.layers.<i>.block_sparse_moe.gate.weight` and `...experts.<e>.w1.weight` ([out in]).
A model built from `std/mamba` (`lm/mamba/`) is `MambaForCausalLM`: `embeddings`,
`layers/mamba-block/norm/scale`, `layers/mamba-block/mixer/…` and `norm_f/scale` for
`backbone.embeddings.weight`, `backbone.layers.<i>.norm.weight`, `…mixer.in_proj.weight`,
…, `backbone.norm_f.weight`, its head tied to the embedding.
"""

from __future__ import annotations

import math

from sexpgpu.models.twin_base import (Tensor, Twin, config_differences, layer_count,
                                      scope_literal, scope_nodes, llama_shaped_problems, rotary,
                                      LLAMA_ATTENTION)

FIX = ("build the model with (mixtral tokens ...) from (require std/mixtral) or (mamba tokens "
       "...) from (require std/mamba), or export with --format safetensors, which keeps every "
       "parameter under its .sx path")

# --- Mixtral --------------------------------------------------------------------------------

MIXTRAL_SCOPE = "layers/mixtral-block/"
MIXTRAL_BLOCK = {
    **LLAMA_ATTENTION,
    "block_sparse_moe/gate/w": ("block_sparse_moe.gate.weight", True),
}
MIXTRAL_EXPERTS = {"block_sparse_moe/experts/w1": "w1", "block_sparse_moe/experts/w3": "w3",
                   "block_sparse_moe/experts/w2": "w2"}


def mixtral(root: str, params: dict, graph) -> Twin:
  """The `MixtralForCausalLM` twin of a std/mixtral model rooted at `root`."""
  vocab, width = params[root + "embed_tokens"].full_shape
  layers = layer_count(params, root + MIXTRAL_SCOPE)

  def full(rel: str) -> tuple[int, ...]:
    p = params.get(root + MIXTRAL_SCOPE + rel)
    return tuple(p.full_shape) if p is not None else ()

  experts, _, hidden = (full("block_sparse_moe/experts/w1") + (1, width, 4 * width))[1:4]
  kv_width = (full("self_attn/k_proj/w") + (0, 0, width))[2]
  context, half, base, eps = rotary(graph, root, layers, width, "mixtral", FIX)
  top_k, aux = 2, 0.001  # the twin's defaults, when the graph does not say
  for node in scope_nodes(graph, root):
    if node.op in ("top-k", "top-k-indices") and "/block_sparse_moe" in node.scope:
      top_k = int(node.attr("k"))
    aux = scope_literal(node, "/mixtral-balance", "*", aux)
  dh = 2 * half
  heads, kv = width // dh, kv_width // dh
  d, v, i, k = width, vocab, hidden, kv * dh
  block = {"input_layernorm/scale": (d,), "self_attn/q_proj/w": (d, heads * dh),
           "self_attn/k_proj/w": (d, k), "self_attn/v_proj/w": (d, k),
           "self_attn/o_proj/w": (heads * dh, d), "post_attention_layernorm/scale": (d,),
           "block_sparse_moe/gate/w": (d, experts)}
  expert = {"w1": (d, i), "w3": (d, i), "w2": (i, d)}
  tensors = {root + "embed_tokens": Tensor("model.embed_tokens.weight", (v, d), None),
             root + "norm/scale": Tensor("model.norm.weight", (d,), None),
             root + "lm_head/w": Tensor("lm_head.weight", (d, v), None, True)}
  tensors.update({root + MIXTRAL_SCOPE + rel: Tensor("model.layers.{i}." + name, block[rel],
                                                     layers, tr)
                  for rel, (name, tr) in MIXTRAL_BLOCK.items()})
  tensors.update({root + MIXTRAL_SCOPE + rel: Tensor(
      "model.layers.{i}.block_sparse_moe.experts.{e}." + w + ".weight", expert[w], layers,
      True, experts) for rel, w in MIXTRAL_EXPERTS.items()})
  config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "vocab_size": vocab, "hidden_size": width, "intermediate_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": dh, "max_position_embeddings": context,
            "rms_norm_eps": eps, "rope_theta": base, "sliding_window": None,
            "hidden_act": "silu", "attention_dropout": 0.0, "num_local_experts": experts,
            "num_experts_per_tok": top_k, "router_aux_loss_coef": aux,
            "router_jitter_noise": 0.0, "output_router_logits": False,
            "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": None,
            "eos_token_id": None, "use_cache": True, "torch_dtype": "float32"}
  return Twin("mixtral", root, config, context, tensors, "model.", tied_head=False)


def mixtral_config_problems(t: Twin, theirs: dict) -> list[str]:
  """What of a Mixtral config.json differs from the model here."""
  return llama_shaped_problems(theirs, t.config, {
      "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_act": "silu", "num_local_experts": 8,
      "num_experts_per_tok": 2, "sliding_window": None, "tie_word_embeddings": False})


# --- Mamba ----------------------------------------------------------------------------------

MAMBA_SCOPE = "layers/mamba-block/"
# The longest window `sample` decodes a Mamba in. It has no position table, and its decoding
# state (the conv's window, the scan's state) does not grow with the position, so this only
# bounds a prompt and its continuation.
MAMBA_WINDOW = 8192
MAMBA_BLOCK = {  # .sx path → (the twin's name, transposed)
    "norm/scale": ("norm.weight", False),
    "mixer/in_proj/w": ("mixer.in_proj.weight", True),
    "mixer/conv1d/w": ("mixer.conv1d.weight", True),
    "mixer/conv1d/b": ("mixer.conv1d.bias", False),
    "mixer/x_proj/w": ("mixer.x_proj.weight", True),
    "mixer/dt_proj/w": ("mixer.dt_proj.weight", True),
    "mixer/dt_proj/b": ("mixer.dt_proj.bias", False),
    "mixer/A_log": ("mixer.A_log", False),
    "mixer/D": ("mixer.D", False),
    "mixer/out_proj/w": ("mixer.out_proj.weight", True),
}


def mamba(root: str, params: dict, graph) -> Twin:
  """The `MambaForCausalLM` twin of a std/mamba model rooted at `root`."""
  vocab, width = params[root + "embeddings"].full_shape
  layers = layer_count(params, root + MAMBA_SCOPE)

  def one(rel: str, fallback: tuple[int, ...]) -> tuple[int, ...]:
    p = params.get(root + MAMBA_SCOPE + rel)
    return tuple(p.full_shape[1:]) if p is not None and p.stack else fallback

  e, n = one("mixer/A_log", (2 * width, 16))
  kernel = one("mixer/conv1d/w", (4, 1, e))[0]
  r = one("mixer/dt_proj/w", (max(1, -(-width // 16)), e))[0]
  eps = 1e-5
  for node in scope_nodes(graph, root):
    eps = scope_literal(node, "/norm_f", "+", eps)
  d = width
  block = {"norm/scale": (d,), "mixer/in_proj/w": (d, 2 * e), "mixer/conv1d/w": (kernel, 1, e),
           "mixer/conv1d/b": (e,), "mixer/x_proj/w": (e, r + 2 * n), "mixer/dt_proj/w": (r, e),
           "mixer/dt_proj/b": (e,), "mixer/A_log": (e, n), "mixer/D": (e,),
           "mixer/out_proj/w": (e, d)}
  tensors = {root + "embeddings": Tensor("backbone.embeddings.weight", (vocab, d), None),
             root + "norm_f/scale": Tensor("backbone.norm_f.weight", (d,), None)}
  tensors.update({root + MAMBA_SCOPE + rel: Tensor("backbone.layers.{i}." + name, block[rel],
                                                   layers, tr)
                  for rel, (name, tr) in MAMBA_BLOCK.items()})
  config = {"architectures": ["MambaForCausalLM"], "model_type": "mamba",
            "vocab_size": vocab, "hidden_size": d, "state_size": n,
            "num_hidden_layers": layers, "layer_norm_epsilon": eps, "conv_kernel": kernel,
            "expand": e // d if e % d == 0 else e / d, "intermediate_size": e,
            "time_step_rank": r, "use_bias": False, "use_conv_bias": True,
            "hidden_act": "silu", "residual_in_fp32": True, "tie_word_embeddings": True,
            "initializer_range": 0.1, "bos_token_id": None, "eos_token_id": None,
            "pad_token_id": None, "use_cache": True, "torch_dtype": "float32"}
  return Twin("mamba", root, config, MAMBA_WINDOW, tensors, "backbone.", tied_head=True,
              embed="embeddings")


def mamba_config_problems(t: Twin, theirs: dict) -> list[str]:
  """What of a Mamba config.json differs from the model here."""
  ours = t.config
  out = config_differences(theirs, ours, ("model_type", "vocab_size", "hidden_size", "state_size",
                               "num_hidden_layers", "conv_kernel", "intermediate_size",
                               "time_step_rank"))
  eps = float(theirs.get("layer_norm_epsilon", 1e-5))
  if not math.isclose(eps, ours["layer_norm_epsilon"], rel_tol=1e-9):
    out.append(f"config.json layer_norm_epsilon {eps} there, {ours['layer_norm_epsilon']} here")
  for key, want in (("use_bias", False), ("use_conv_bias", True), ("hidden_act", "silu"),
                    ("tie_word_embeddings", True)):
    if theirs.get(key, want) != want:
      out.append(f"config.json {key} {theirs.get(key)!r} there, {want!r} here")
  return out

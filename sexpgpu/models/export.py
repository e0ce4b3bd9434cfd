"""`sexpgpu export` (a .safetensors of .sx paths, or a Hugging Face folder) and `sexpgpu
import` (a Hugging Face folder → a step-0 checkpoint of an experiment)."""

from __future__ import annotations

import json
import os
import shutil
import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.models import source, twin
from sexpgpu.record import jsonable, versions

FORMATS = ("safetensors", "hf", "peft")


def _metadata(c, meta: dict) -> dict[str, str]:
  """safetensors metadata (text only): what the weights are of, and at which step."""
  knobs = meta.get("knobs") or {k: jsonable(v.value)
                                for k, v in c.selection.knobs.items()}
  return {"format": source.SX_FORMAT, "fingerprint": str(meta.get("fingerprint", c.fingerprint)),
          "graph_fingerprint": str(meta.get("graph_fingerprint", c.graph_fingerprint)),
          "slug": str(meta.get("slug", c.slug)), "step": str(int(meta.get("step", 0))),
          "knobs": json.dumps(knobs, sort_keys=True),
          "versions": json.dumps(meta.get("versions") or versions(), sort_keys=True)}


def _save(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str]) -> None:
  import jax.numpy as jnp
  from safetensors.flax import save_file
  # through jax arrays, so bf16 stays bf16
  save_file({k: jnp.asarray(v) for k, v in tensors.items()}, path, metadata=metadata)


def _tokenizer_config(tokenizer: str, config: dict, positions: int | None) -> dict:
  """What `AutoTokenizer` needs to read tokenizer.json as it is: without it a Llama, Mixtral
  or Mamba folder gets a tokenizer class that adds `<s>` and `</s>` as new tokens and puts
  `<s>` before every text, so lm-evaluation-harness would score other ids than the model
  was trained on."""
  names = {t["id"]: str(t["content"]) for t in twin.added_tokens(tokenizer)
           if isinstance(t.get("id"), int) and "content" in t}
  out = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
         "add_eos_token": False, "bos_token": names.get(config.get("bos_token_id")),
         "eos_token": names.get(config.get("eos_token_id"))}
  if positions:
    out["model_max_length"] = int(positions)
  return out


def merged(c, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The parameters with each LoRA adapter folded into its base weight, W + (alpha/rank)·A·B
  (stacked layers each their own), and the adapters gone: the model the adapted one computes.
  """
  from sexpgpu.ir.lora import adapter_paths, base_params
  lora = c.exp.run.get("lora")
  out = {k: params[k] for k in base_params(params)}
  if lora is None:
    return out
  for base in out:
    a, b = adapter_paths(base)
    if a in params and b in params:
      w = np.asarray(out[base])
      delta = np.matmul(np.asarray(params[a], np.float32), np.asarray(params[b], np.float32))
      out[base] = (w.astype(np.float32) + np.float32(lora.scale) * delta).astype(w.dtype)
  return out


def mup_folded(c, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The parameters with a μP run's output multiplier (1/m on the readout's product, which a
  Hugging Face twin has no place for) folded into the readout's weight: the twin then computes
  the logits the run does. The parameters themselves for a standard run.

  Raises:
    SxError: E-EXPORT-001 for a readout tied to the embedding (folding 1/m into it would
      scale the embedding too).
  """
  from sexpgpu.ir import mup
  folds = mup.output_multipliers(c.stages[0].graph, c.exp.optimizer)
  tied = sorted(path for path, (_, is_tied) in folds.items() if is_tied)
  if tied:
    raise SxError("E-EXPORT-001", f"--format hf: the run is μP and its readout {tied[0]} is "
                  "tied to the embedding, so the logits' output multiplier "
                  f"{folds[tied[0]][0]:g} (1/m) has no place in the twin", where="--format hf",
                  fix="export --format safetensors (sexpgpu's sample and eval apply the 1/m), "
                  "or train the μP run with an untied head")
  out = dict(params)
  for path, (factor, _) in folds.items():
    w = np.asarray(params[path])
    out[path] = (w.astype(np.float32) * np.float32(factor)).astype(w.dtype)
  return out


def export(c, params: dict[str, np.ndarray], meta: dict, out: str, fmt: str,
           tokenizer: str | None = None, merge_lora: bool = False) -> list[str]:
  """Writes the parameters of experiment `c` as `fmt`.

  Args:
    c: the Compiled experiment whose checkpoint `params` (path → array) and `meta` are.
    out: a .safetensors file (safetensors) or a folder (hf).
    fmt: "safetensors" or "hf".
    tokenizer: a tokenizer.json to copy into the hf folder, if known.
    merge_lora: write each LoRA adapter folded into its base weight (`merged`).

  Returns:
    The files written.

  Raises:
    SxError: E-EXPORT-001 when `fmt` is hf and the model is not a gpt2, llama, mixtral or
      mamba, or has LoRA adapters and `merge_lora` is off (a twin has no place for them), or
      is a μP run whose readout is tied (`mup_folded`; an untied one's 1/m is folded in).
  """
  if tokenizer and not os.path.isfile(tokenizer):
    raise SxError("E-TOK-002", f"no tokenizer file {tokenizer}", where="--tokenizer")
  if merge_lora and fmt == "peft":
    raise SxError("E-EXPORT-001", "--format peft writes the LoRA adapters themselves, which "
                  "--merge-lora folds away", where="--merge-lora",
                  fix="drop --merge-lora to write the adapters for peft, or export --format hf "
                  "--merge-lora for the merged model")
  if merge_lora:
    params = merged(c, params)
  elif fmt == "hf" and c.exp.run.get("lora") is not None:
    raise SxError("E-EXPORT-001", "--format hf: the run's LoRA adapters have no place in the "
                  "Hugging Face twin of its base model", where="--format hf",
                  fix="add --merge-lora to fold each adapter into its base weight, or export "
                  "--format safetensors, which keeps the adapters under their .sx paths")
  try:
    if fmt == "peft":  # the adapters for peft, onto the base's --format hf (export_peft.py)
      from sexpgpu.models.export_peft import export_peft
      return export_peft(c, params, out)
    if fmt == "safetensors":
      os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
      _save(params, out, _metadata(c, meta))
      return [out]
    g = twin.find(c.params, c.stages[0].graph, "--format hf")
    tensors = twin.to_twin(g, mup_folded(c, params))
    os.makedirs(out, exist_ok=True)
    config = dict(g.config)
    if tokenizer:  # the ids of the tokenizer's own begin/end tokens, never a guess
      config.update(twin.token_ids(tokenizer, config["vocab_size"]))
    config["sexpgpu"] = {k: v for k, v in _metadata(c, meta).items() if k != "format"}
    written = [os.path.join(out, "config.json"), os.path.join(out, "model.safetensors")]
    with open(written[0], "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
    _save(tensors, written[1], {"format": "pt"})
    if tokenizer:
      written.append(os.path.join(out, "tokenizer.json"))
      shutil.copyfile(tokenizer, written[-1])
      written.append(os.path.join(out, "tokenizer_config.json"))
      with open(written[-1], "w") as f:
        json.dump(_tokenizer_config(tokenizer, config, g.positions), f, indent=2)
    return written
  except SxError:
    raise
  except Exception as e:  # pylint: disable=broad-except  # OSError, safetensors' own error
    why = " ".join(str(e).split()) or type(e).__name__
    raise SxError("E-FORM-001", f"cannot write {out}: {why}", where="-o",
                  fix="give -o a path in a folder you can write to") from e


def write_step0(c, params: dict[str, np.ndarray], out: str) -> str:
  """A checkpoint of experiment `c` at step 0 holding `params`, a fresh optimizer and
  fresh loaders: `sexpgpu run FILE.sx --resume <it>` trains from there."""
  import jax
  from sexpgpu.ckpt import CheckpointStore
  from sexpgpu.ckpt import meta as ckpt_meta
  from sexpgpu.ir.ops import DTYPES
  from sexpgpu.ir.lora import trained
  from sexpgpu.lower.optim import make_optimizer
  from sexpgpu.lower.step import init_state, trained_only
  opt, _ = make_optimizer(c.exp.optimizer, int(c.exp.run["steps"]), c.stages[0].graph)
  spec = c.exp.run.get("trainable")  # the state of the trained parameters only, as a run's
  opt = trained_only(opt, trained(c.params, spec and spec.get("patterns"), spec and spec.loc))
  host = {k: jax.numpy.asarray(v, DTYPES[c.params[k].dtype]) for k, v in params.items()}
  state = init_state(host, opt)
  counters = {"records": 0}
  if any("tokens" in f for f in c.fields.values()):
    counters["tokens"] = 0
  ident = ckpt_meta.identity(c.fingerprint, c.graph_fingerprint, c.slug,
                             {k: v.value for k, v in c.selection.knobs.items()},
                             c.program.sources)
  # No stacking: a run from here chooses its own.
  meta = ckpt_meta.build(ident, 0, 0, counters=counters, last_pass={}, train_loss=None,
                         loaders={n: ld.state() for n, ld in c.loaders.items()})
  meta["imported"] = True
  with CheckpointStore(out, c.slug, keep=1, where="-o") as store:
    store.save(0, state, meta, wait=True)
    return store.step_dir(0)

"""`sexpgpu export --format peft`: a run's LoRA adapters as the `peft` library loads them onto
the Hugging Face twin of its base model (`export --format hf` of the base, unmerged).

The folder holds `adapter_config.json` (LORA, r, lora_alpha, lora_dropout and the adapted
modules by their full twin names) and `adapter_model.safetensors`: for each adapted module
`base_model.model.<module>.lora_A.weight` [r in] and `.lora_B.weight` [out r], the
transposes of the run's A [in r] and B [r out], a layer (and an expert) each. peft scales
B·A by lora_alpha / r, as the run scales x·A·B by alpha / rank.
"""

from __future__ import annotations

import json
import os

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.ir.lora import adapter_paths
from sexpgpu.models import twin


def adapters(c, params: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str], bool]:
  """The adapters by peft's names, the adapted modules' twin names, and whether the twin
  keeps their weights as [in out] (GPT-2's Conv1D: peft's fan_in_fan_out).

  Raises:
    SxError: E-EXPORT-001 for a run without LoRA, a model with no twin, or an adapter whose
      base weight has no place in the twin.
  """
  lora = c.exp.run.get("lora")
  if lora is None:
    raise SxError("E-EXPORT-001", "--format peft: the run has no LoRA adapters to export",
                  where="--format peft",
                  fix="export a run with :lora (lora ...), or export --format hf for the "
                  "whole model")
  g = twin.find(c.params, c.stages[0].graph, "--format peft")
  tensors, modules, flipped = {}, [], set()
  for base in sorted(c.params):
    pa, pb = adapter_paths(base)
    if pa not in c.params or pb not in c.params:
      continue
    t = g.tensors.get(base)
    if t is None:
      raise SxError("E-EXPORT-001", f"--format peft: {base}'s adapters have no module in the "
                    f"{g.kind} twin", where="--format peft",
                    fix="target weights the twin holds (\"*/q_proj/w\" \"*/v_proj/w\"), or "
                    "export --format hf --merge-lora")
    a, b = np.asarray(params[pa], np.float32), np.asarray(params[pb], np.float32)
    for i in range(t.layers or 1):
      la, lb = (a[i], b[i]) if t.layers is not None else (a, b)
      for e in range(t.experts or 1):
        ea, eb = (la[e], lb[e]) if t.experts else (la, lb)
        name = t.name.format(i=i, e=e).removesuffix(".weight")
        modules.append(name)
        flipped.add(not t.transposed)
        tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(ea.T)
        tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(eb.T)
  return tensors, modules, flipped == {True}


def export_peft(c, params: dict[str, np.ndarray], out: str, base: str | None = None
                ) -> list[str]:
  """Writes the run's adapters into folder `out` for `peft.PeftModel.from_pretrained`.

  Args:
    c: the Compiled experiment whose checkpoint `params` are.
    out: the folder to write.
    base: the base model's folder or hub name, for adapter_config.json's
      base_model_name_or_path (None: left empty; from_pretrained is given the model).

  Returns:
    The files written.

  Raises:
    SxError: E-EXPORT-001 (adapters()).
  """
  from safetensors.numpy import save_file
  tensors, modules, fan_in_fan_out = adapters(c, params)
  lora = c.exp.run["lora"]
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": fan_in_fan_out,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None}
  os.makedirs(out, exist_ok=True)
  written = [os.path.join(out, "adapter_config.json"),
             os.path.join(out, "adapter_model.safetensors")]
  with open(written[0], "w") as f:
    json.dump(config, f, indent=2)
  save_file(tensors, written[1], metadata={"format": "pt"})
  return written

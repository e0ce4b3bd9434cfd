"""The fine-tuning examples' chain at smoke size: configs/chat-base.sx trained and exported as
a Hugging Face folder, then sft-chat.sx, dpo.sx and lora.sx each warm-started from it; an
example run before the folder exists is told which command makes it."""

import json
import os
import shutil

import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _copy(tmp, *names):
  """The examples beside their data (linked), in a folder of their own."""
  os.makedirs(tmp / "lib")
  for name in names + ("lib/chat-model.sx",):
    shutil.copy(os.path.join(CONFIGS, name), tmp / name)
  os.symlink(os.path.join(CONFIGS, "data"), tmp / "data")


def test_an_example_before_its_base_folder_exists_names_the_command(tmp_path):
  _copy(tmp_path, "sft-chat.sx")
  with pytest.raises(SxError) as e:
    sexpgpu.compile(str(tmp_path / "sft-chat.sx"), variant="smoke").run()
  assert e.value.code == "E-INIT-001" and "chat-base-hf is not a folder" in e.value.message
  assert e.value.where == ":init-from" and "sexpgpu export RUN.sx" in e.value.fix
  assert "--format hf -o chat-base-hf" in e.value.fix


@pytest.mark.slow  # four short runs: about 60 s on a loaded 2-core machine
def test_the_examples_start_from_the_exported_base(tmp_path):
  from sexpgpu.cli.main import main
  _copy(tmp_path, "chat-base.sx", "sft-chat.sx", "dpo.sx", "lora.sx")
  base = sexpgpu.compile(str(tmp_path / "chat-base.sx"), variant="smoke").run(
      checkpoint_dir=str(tmp_path / "runs"))
  hf = str(tmp_path / "chat-base-hf")
  assert main(["export", str(tmp_path / "chat-base.sx"), "--variant", "smoke", "--resume",
               base.checkpoint, "-o", hf, "--format", "hf", "--tokenizer",
               str(tmp_path / "data" / "chat-tok" / "tokenizer.json")]) == 0
  exported = {k: np.asarray(v) for k, v in base.params.items()}

  def tuned(name):
    path = str(tmp_path / name)
    out = sexpgpu.compile(path, variant="smoke", diagnostics="all").run(
        metrics=f"jsonl:{tmp_path / (name + '.jsonl')}")
    steps = [e for e in map(json.loads, open(tmp_path / (name + ".jsonl")))
             if e["kind"] in ("step", "diagnostic")]
    return out, steps
  sft, sft_steps = tuned("sft-chat.sx")
  assert len([e for e in sft_steps if e["kind"] == "step"]) == 4
  assert all(np.isfinite(e["train/loss"]) for e in sft_steps if "train/loss" in e)
  dpo, dpo_steps = tuned("dpo.sx")
  # at step 1 the policy is the reference, both the imported base: the loss is log 2
  first = next(e for e in dpo_steps if e["kind"] == "step" and e["step"] == 1)
  assert first["train/loss"] == pytest.approx(np.log(2.0), abs=1e-6)
  root = "logps/lm/llama/"
  for k, v in exported.items():  # the reference's copies are the base, bitwise
    assert np.array_equal(np.asarray(dpo.params["reference/logps/" + k]), v), k
  assert any(not np.array_equal(np.asarray(dpo.params[root + k[len("lm/llama/"):]]), v)
             for k, v in exported.items())
  lora, _ = tuned("lora.sx")
  for k, v in exported.items():  # LoRA leaves the imported base as it was
    assert np.array_equal(np.asarray(lora.params[k]), v), k
  assert sorted(set(lora.params) - set(exported)) == sorted(
      f"lm/llama/layers/llama-block/self_attn/{m}_proj/w.lora_{x}" for m in "qv" for x in "ab")

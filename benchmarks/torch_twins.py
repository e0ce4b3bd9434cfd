"""Export and import against transformers' PyTorch twins, where torch is installed.

The test suite checks the twins against transformers' Flax classes (its extras install no
torch: the PyPI wheel pulls ~4 GB of CUDA libraries). This script checks the PyTorch side,
both ways, for `gpt2` and `llama`:

- a model trained 3 steps here, exported with `--format hf`, loads in `GPT2LMHeadModel` /
  `LlamaForCausalLM` with logits within 1e-4 of ours and the same 32 greedy tokens;
- a randomly initialized PyTorch twin saved with `save_pretrained` imports with logits within
  1e-5 of its own.

    python benchmarks/torch_twins.py        # exit 1 on any mismatch
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

GPT2 = """(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
(defn lm [tokens] (gpt2 tokens :vocab 40 :width 32 :layers 2 :heads 4 :context 48))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 3 :optimizer (adamw :lr 0.01) :precision f32 :seed 1)
"""
LLAMA = """(require std/lm)
(require std/llama)
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab 40 :width 32 :layers 2 :heads 4 :kv-heads 2 :hidden 64 :context 48))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 3 :optimizer (adamw :lr 0.01) :precision f32 :seed 1)
"""


def _ours(path: str, step_dir: str, tokens: np.ndarray) -> tuple[np.ndarray, list[int]]:
  from sexpgpu.models import forward, sample
  from sexpgpu.models.source import checkpoint_params
  from sexpgpu.run.compile import compile_file
  c = compile_file(path)
  params, _ = checkpoint_params(step_dir)
  f = forward.forward(c, "lm", tokens.shape[1], tokens.shape[0])
  logits = np.asarray(f(forward.device_params(c, params), tokens.astype(np.int32)))
  ids = sample.generate(c, "lm", params, [3, 1, 4, 1],
                        sample.Settings(tokens=32, temperature=0.0)).ids
  return logits, ids


def check(kind: str, text: str, tmp: str) -> list[str]:
  import torch
  import transformers
  import sexpgpu
  from sexpgpu.cli.main import main
  cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[kind]
  path = os.path.join(tmp, f"{kind}.sx")
  with open(path, "w") as f:
    f.write(text)
  tokens = np.random.RandomState(0).randint(0, 40, (2, 16))
  problems = []
  # out: trained here, exported, loaded by the PyTorch twin
  sexpgpu.compile(path).run(steps=3, checkpoint_dir=os.path.join(tmp, "ck"))
  step_dir = os.path.join(tmp, "ck", kind, "3")
  out = os.path.join(tmp, f"{kind}-hf")
  assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
  twin = cls.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = twin(torch.tensor(tokens)).logits.numpy()
    gen = twin.generate(torch.tensor([[3, 1, 4, 1]]), do_sample=False, max_new_tokens=32,
                        eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
  ours, ids = _ours(path, step_dir, tokens)
  d = float(np.abs(ours - theirs).max())
  print(f"{kind} export -> {cls.__name__}: max |logits difference| {d:.2e}; greedy 32 tokens "
        f"{'equal' if ids == gen else 'DIFFER'}")
  if d > 1e-4 or ids != gen:
    problems.append(f"{kind} export")
  # in: a PyTorch twin's own folder imported
  torch.manual_seed(0)
  twin = cls.from_pretrained(out)  # the config; weights drawn afresh below
  twin = cls(twin.config).eval()
  saved = os.path.join(tmp, f"{kind}-pt")
  twin.save_pretrained(saved)
  ck = os.path.join(tmp, f"{kind}-imported")
  assert main(["import", saved, "-o", ck, path]) == 0
  with torch.no_grad():
    theirs = twin(torch.tensor(tokens)).logits.numpy()
  ours, _ = _ours(path, os.path.join(ck, kind, "0"), tokens)
  d = float(np.abs(ours - theirs).max())
  print(f"{kind} {cls.__name__} saved by PyTorch -> import: max |logits difference| {d:.2e}")
  if d > 1e-5:
    problems.append(f"{kind} import")
  return problems


def main() -> int:
  try:
    import torch  # noqa: F401
  except ImportError:
    print("torch is not importable here: nothing to check", file=sys.stderr)
    return 1
  problems = []
  with tempfile.TemporaryDirectory() as tmp:
    for kind, text in (("gpt2", GPT2), ("llama", LLAMA)):
      problems += check(kind, text, tmp)
  print("all equal" if not problems else f"MISMATCH: {', '.join(problems)}")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())

"""`sexpgpu sample`: the window recomputed per token, against a plain loop of full forwards;
the same continuation for a seed; which function maps tokens to logits."""

import json
import os

import numpy as np
import pytest

from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

SX = """
(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (gpt2 tokens :vocab 24 :width 16 :layers 1 :heads 2 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  tmp = tmp_path_factory.mktemp("sample")
  path = str(tmp / "s.sx")
  with open(path, "w") as f:
    f.write(SX)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(5, c.params).items()}
  return path, c, params, write_step0(c, params, str(tmp / "ck"))


def test_greedy_equals_a_loop_of_full_forwards_past_the_window(model):
  from sexpgpu.models import forward, sample
  path, c, params, _ = model
  prompt, n = [3, 1, 4], 9  # 3 + 9 tokens > the 8 positions: the window slides
  got = sample.generate(c, "lm", params, prompt, sample.Settings(tokens=n, temperature=0.0))
  assert got.path == "recompute"
  seq = list(prompt)
  p = forward.device_params(c, params)
  for _ in range(n):
    window = seq[-8:]
    f = forward.forward(c, "lm", len(window))  # no padding: exactly the tokens so far
    logits = np.asarray(f(p, np.asarray([window], np.int32)))[0, -1]
    seq.append(int(np.argmax(logits)))
  assert got.ids == seq[len(prompt):]


def test_top_k_1_is_greedy_and_choose_keeps_the_top_p_mass():
  import jax
  import jax.numpy as jnp
  from sexpgpu.models.sample import Settings, choose
  logits = jnp.asarray([0.0, 3.0, 1.0, 2.9], jnp.float32)
  key = jax.random.key(0)
  assert int(choose(logits, key, Settings(temperature=1.0, top_k=1))) == 1
  # top-p 0.5: only token 1 and 3 hold the first half of the mass
  seen = {int(choose(logits, jax.random.key(i), Settings(temperature=1.0, top_p=0.5)))
          for i in range(40)}
  assert seen <= {1, 3} and len(seen) == 2


def test_sample_with_a_seed_prints_the_same_continuation_twice(model, capsys):
  path, _, _, step_dir = model
  args = ["sample", path, "--resume", step_dir, "--prompt", "1 2 3", "--tokens", "12",
          "--temperature", "1.0", "--top-k", "10", "--top-p", "0.9", "--json"]
  outs = []
  for seed in ("4", "4", "5"):
    assert main(args + ["--seed", seed]) == 0
    captured = capsys.readouterr()
    outs.append(json.loads(captured.out))
    assert "recompute decoding" in captured.err
  assert outs[0]["ids"] == outs[1]["ids"] and len(outs[0]["ids"]) == 12
  assert outs[0]["text"] == " ".join(map(str, outs[0]["ids"]))
  assert outs[2]["ids"] != outs[0]["ids"]  # another seed, another draw (12 tokens of 10)
  assert outs[0]["tokens_per_s"] > 0


def test_which_function_maps_tokens_to_logits(model, tmp_path, capsys):
  from sexpgpu.models import source
  from sexpgpu.run.compile import compile_source
  path, c, _, step_dir = model
  assert source.candidates(c) == ["lm"]
  # two models trained side by side: either could be meant
  two = SX.replace("(next-token-loss (lm (lm-inputs t)) t)",
                   "(+ (next-token-loss (lm (lm-inputs t)) t) "
                   "(next-token-loss (lm2 (lm-inputs t)) t))")
  two += "(defn lm2 [tokens] (gpt2 tokens :vocab 24 :width 8 :layers 1 :heads 2))\n"
  c2 = compile_source(two)
  with pytest.raises(SxError) as e:
    source.default_fn(c2)
  assert e.value.code == "E-SAMPLE-001" and "candidates lm, lm2" in str(e.value)
  assert "--fn NAME, one of lm, lm2" in str(e.value)
  assert main(["sample", path, "--resume", step_dir, "--prompt", "1", "--fn", "loss"]) == 1
  err = capsys.readouterr().err
  assert "E-SAMPLE-001" in err and "Traceback" not in err
  assert main(["sample", path, "--resume", step_dir, "--prompt", "one two"]) == 1
  assert "E-FORM-001" in capsys.readouterr().err
  assert main(["sample", path, "--resume", step_dir, "--prompt", "99"]) == 1
  assert "outside the model's vocabulary of 24" in capsys.readouterr().err

"""A Hugging Face export of a μP run: the readout's output multiplier (1/m on the logits'
product, which no twin has) is folded into the exported head, so transformers' own Llama
computes the run's logits; a tied head (gpt2) cannot take it and is refused, E-EXPORT-001,
before anything is written. Attention's `:attn-scale` in std (μP's 1/d) and its check."""

import os
import warnings

import numpy as np
import pytest

import sexpgpu
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.ir import mup
from sexpgpu.run.compile import compile_source

LLAMA_SX = """
(require std/lm)
(require std/llama)
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab 40 :width 64 :layers 1 :heads 4 :kv-heads 2 :hidden 64 :context 48))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 2 :optimizer (adamw :lr 0.01 :weight-decay 0.0)
        :precision f32 :seed 1 :parametrization mup :base-width 16)
"""

GPT2_SX = """
(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 40 :seq 9 :batch 2 :seed 7))
(defn lm [tokens] (gpt2 tokens :vocab 40 :width 32 :layers 1 :heads 2 :context 8))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01)
        :precision f32 :seed 1 :parametrization mup :base-width 16)
"""


def _write(tmp, text, name):
  path = os.path.join(str(tmp), name)
  with open(path, "w") as f:
    f.write(text)
  return path


def _trained(tmp, text, name, steps):
  path = _write(tmp, text, name)
  ck = os.path.join(str(tmp), "ck")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mup.MupWarning)
    sexpgpu.compile(path).run(steps=steps, checkpoint_dir=ck)
  return path, os.path.join(ck, name[:-3], str(steps))


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_hf_export_of_a_mup_llama_computes_the_runs_logits(tmp_path):
  from safetensors.numpy import load_file
  from transformers import FlaxLlamaForCausalLM
  from sexpgpu.models import forward
  from sexpgpu.models.source import checkpoint_params
  from sexpgpu.run.compile import compile_file
  path, step_dir = _trained(tmp_path, LLAMA_SX, "mup-llama.sx", 2)
  out = str(tmp_path / "hf")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mup.MupWarning)
    assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
    c = compile_file(path)
  params, _ = checkpoint_params(step_dir)
  head = np.asarray(params["lm/llama/lm_head/w"])
  written = load_file(os.path.join(out, "model.safetensors"))["lm_head.weight"]
  # width 64 / base 16: m = 4, the head's 1/m folded in (the twin's [out in] layout)
  np.testing.assert_array_equal(written, (head * np.float32(0.25)).T)
  tokens = np.random.RandomState(0).randint(0, 40, (2, 16)).astype(np.int32)
  f = forward.forward(c, "lm", tokens.shape[1], tokens.shape[0])
  ours = np.asarray(f(forward.device_params(c, params), tokens))
  theirs = np.asarray(FlaxLlamaForCausalLM.from_pretrained(out)(tokens).logits)
  assert np.abs(ours - theirs).max() < 1e-4
  assert np.abs(ours).max() > 1e-2  # logits that the 1/m visibly changes


def test_hf_export_of_a_mup_run_with_a_tied_head_is_refused(tmp_path, capsys):
  path, step_dir = _trained(tmp_path, GPT2_SX, "mup-gpt2.sx", 1)
  out = tmp_path / "hf"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mup.MupWarning)
    assert main(["export", path, "--resume", step_dir, "-o", str(out), "--format", "hf"]) == 1
    err = capsys.readouterr().err
    assert "error[E-EXPORT-001]" in err and "lm/gpt2/wte" in err and "tied" in err, err
    assert "untied head" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything is written
    assert main(["export", path, "--resume", step_dir, "-o",
                 str(tmp_path / "m.safetensors")]) == 0  # the safetensors export is the fix


ATTN = """
(require std/lm)
(defloader train (markov :vocab 40 :seq 9 :batch 2 :seed 7))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (transformer-lm (lm-inputs t) :vocab 40 :width 64 :layers 1 :heads 4
                                     SCALE) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01)
        :parametrization mup :base-width 32)
"""


def _scores_scales(c):
  return sorted({float(v) for n in mup.roles_mod.all_nodes(c.stages[0].graph)
                 for v in ([n.attr("scale")] if n.op == "sdpa" else
                           [x for x in n.inputs if isinstance(x, float)] if n.op == "*" else [])
                 if v is not None and v in (0.25, 1 / 16)})


def test_attn_scale_one_over_d_follows_the_warnings_fix():
  with pytest.warns(mup.MupWarning, match=r":attn-scale \(/ heads width\)"):
    plain = compile_source(ATTN.replace("SCALE", ""), "a.sx")
  assert _scores_scales(plain) == [0.25]  # 1/√16
  with warnings.catch_warnings():
    warnings.simplefilter("error", mup.MupWarning)  # no warning once it is followed
    fixed = compile_source(ATTN.replace("SCALE", ":attn-scale (/ 4 64)"), "a.sx")
  assert _scores_scales(fixed) == [1 / 16]


@pytest.mark.parametrize("value", ["-1", "0", "\"1/d\""])
def test_a_bad_attn_scale_is_e_arg_001_at_the_call(value):
  with pytest.raises(SxError) as e:
    compile_source(ATTN.replace("SCALE", f":attn-scale {value}"), "a.sx")
  assert e.value.code == "E-ARG-001" and ":attn-scale" in str(e.value)
  assert e.value.location.line == 7 and "(/ heads width)" in e.value.fix


@pytest.mark.parametrize("module,model", [
    ("std/gpt2", "gpt2 (lm-inputs t) :vocab 40 :width 64 :layers 1 :heads 4 :context 8"),
    ("std/llama", "llama (lm-inputs t) :vocab 40 :width 64 :layers 1 :heads 4 :hidden 64 "
                  ":context 8")])
def test_gpt2_and_llama_take_attn_scale_too(module, model):
  text = (ATTN.replace("(require std/lm)", f"(require std/lm)\n(require {module})")
          .replace("(transformer-lm (lm-inputs t) :vocab 40 :width 64 :layers 1 :heads 4\n"
                   "                                     SCALE)", f"({model} :attn-scale (/ 4 64))"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", mup.MupWarning)
    c = compile_source(text, "a.sx")
  assert _scores_scales(c) == [1 / 16]

"""std/llama and its twin: export to a Hugging Face folder and import from one, checked
against transformers' own Llama (its Flax LlamaForCausalLM: no torch, nothing downloaded),
grouped-query attention and rotary positions included; warm start from a Llama folder."""

import json
import os

import numpy as np
import pytest

import sexpgpu
from sexpgpu.cli.main import main

LLAMA_SX = """
(require std/lm)
(require std/llama)
(defknob vocab 40)
(defknob width 32)
(defknob layers 2)
(defknob heads 4)
(defknob kv-heads 2)
(defknob hidden 64)
(defknob seq 16)
(defknob context 48)
(defloader train (markov :vocab vocab :seq (+ seq 1) :batch 4 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab vocab :width width :layers layers :heads heads :kv-heads kv-heads
         :hidden hidden :context context))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 3 :optimizer (adamw :lr 0.01 :weight-decay 0.0)
        :precision f32 :seed 1)
"""


def _write(tmp, text=LLAMA_SX, name="tiny-llama.sx"):
  path = os.path.join(tmp, name)
  with open(path, "w") as f:
    f.write(text)
  return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("llama"))
  path = _write(tmp)
  ck = os.path.join(tmp, "ck")
  sexpgpu.compile(path).run(steps=3, checkpoint_dir=ck)
  return path, os.path.join(ck, "tiny-llama", "3")


def _logits(path, params, tokens, sets=()):
  from sexpgpu.models import forward
  from sexpgpu.run.compile import compile_file
  c = compile_file(path, sets=list(sets)) if sets else compile_file(path)
  f = forward.forward(c, "lm", tokens.shape[1], tokens.shape[0])
  return np.asarray(f(forward.device_params(c, params), tokens))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tinyllama_has_tinyllamas_parameters_and_config():
  from sexpgpu.models.twin import find
  from sexpgpu.run.compile import compile_file
  c = compile_file(os.path.join(ROOT, "configs", "tinyllama.sx"))
  assert sum(p.count for p in c.params.values()) == 1_100_048_384  # TinyLlama 1.1B's
  cfg = find(c.params, c.stages[0].graph, "test").config
  # TinyLlama-1.1B's config.json, key for key
  assert {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                              "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                              "rope_theta", "tie_word_embeddings", "hidden_act")} == {
      "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
      "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
      "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
      "tie_word_embeddings": False, "hidden_act": "silu"}


def test_llama_config_is_read_from_the_model():
  from sexpgpu.models.twin import find
  from sexpgpu.run.compile import compile_source
  c = compile_source(LLAMA_SX.replace("(defrun", "(defknob theta 500000.0)\n(defrun").replace(
      ":context context))", ":context context :rope-theta theta :eps 1e-5))"))
  cfg = find(c.params, c.stages[0].graph, "test").config
  assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"],
          cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
          cfg["head_dim"], cfg["max_position_embeddings"], cfg["rms_norm_eps"],
          cfg["rope_theta"], cfg["tie_word_embeddings"]) == (
              40, 32, 64, 2, 4, 2, 8, 48, 1e-5, 500000.0, False)


@pytest.mark.slow  # loads the export in transformers' Flax model
def test_export_hf_loads_in_transformers_flax_with_equal_logits(trained, tmp_path):
  # greedy text against transformers' generate: tests/test_twins_torch.py (Flax's generate
  # compiles for a minute and says the same)
  from transformers import FlaxLlamaForCausalLM
  from sexpgpu.models import sample
  from sexpgpu.models.source import checkpoint_params
  from sexpgpu.run.compile import compile_file
  path, step_dir = trained
  out = str(tmp_path / "hf")
  assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
  twin = FlaxLlamaForCausalLM.from_pretrained(out)
  params, _ = checkpoint_params(step_dir)
  tokens = np.random.RandomState(0).randint(0, 40, (2, 16)).astype(np.int32)
  theirs = np.asarray(twin(tokens).logits)
  ours = _logits(path, params, tokens)
  assert np.abs(ours - theirs).max() < 1e-4
  prompt = [3, 1, 4, 1]
  got = sample.generate(compile_file(path), "lm", params, prompt,
                        sample.Settings(tokens=32, temperature=0.0))
  assert got.path == "incremental" and len(got.ids) == 32


def _flax_llama(tmp_path, seed=3, **kw):
  from transformers import FlaxLlamaForCausalLM, LlamaConfig
  cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                    **kw)
  twin = FlaxLlamaForCausalLM(cfg, seed=seed)
  hf = str(tmp_path / "hf")
  twin.save_pretrained(hf, safe_serialization=True)  # the Flax twin's names and layout
  return twin, hf


def test_a_llama_saved_by_transformers_imports_with_equal_logits(tmp_path):
  from sexpgpu.models.source import checkpoint_params
  twin, hf = _flax_llama(tmp_path)
  path = _write(str(tmp_path))
  ck = str(tmp_path / "ck")
  assert main(["import", hf, "-o", ck, path]) == 0
  step0 = os.path.join(ck, "tiny-llama", "0")
  params, meta = checkpoint_params(step0)
  assert meta["step"] == 0
  tokens = np.random.RandomState(1).randint(0, 40, (2, 16)).astype(np.int32)
  theirs = np.asarray(twin(tokens).logits)
  assert np.abs(_logits(path, params, tokens) - theirs).max() < 1e-5
  # export writes PyTorch's names and layout; importing that gives the same parameters
  out = str(tmp_path / "hf2")
  assert main(["export", path, "--resume", step0, "-o", out, "--format", "hf"]) == 0
  assert main(["import", out, "-o", str(tmp_path / "ck2"), path]) == 0
  again, _ = checkpoint_params(os.path.join(str(tmp_path / "ck2"), "tiny-llama", "0"))
  assert sorted(again) == sorted(params)
  for k in params:
    np.testing.assert_array_equal(again[k], params[k])


def test_a_tied_llama_imports_its_embedding_as_the_head(tmp_path):
  from safetensors.numpy import load_file, save_file
  from sexpgpu.models.source import checkpoint_params
  twin, hf = _flax_llama(tmp_path, tie_word_embeddings=True)
  # a tied model's folder, as PyTorch saves it: no head of its own
  weights = os.path.join(hf, "model.safetensors")
  tensors = load_file(weights)
  del tensors["lm_head.kernel"]
  save_file(tensors, weights, metadata={"format": "flax"})
  path = _write(str(tmp_path))
  assert main(["import", hf, "-o", str(tmp_path / "ck"), path]) == 0
  params, _ = checkpoint_params(os.path.join(str(tmp_path / "ck"), "tiny-llama", "0"))
  head, emb = params["lm/llama/lm_head/w"], params["lm/llama/embed_tokens"]
  np.testing.assert_array_equal(head, emb.T)
  theirs = dict(twin.params)
  theirs["lm_head"] = {"kernel": np.asarray(twin.params["model"]["embed_tokens"]["embedding"]).T}
  tokens = np.random.RandomState(2).randint(0, 40, (1, 12)).astype(np.int32)
  want = np.asarray(twin(tokens, params=theirs).logits)
  assert np.abs(_logits(path, params, tokens) - want).max() < 1e-5


def test_import_names_every_difference_of_a_llama_folder(tmp_path, capsys):
  _, hf = _flax_llama(tmp_path, rope_theta=500000.0)
  path = _write(str(tmp_path))
  assert main(["import", hf, "-o", str(tmp_path / "ck"), path, "--set", "kv-heads=4"]) == 1
  err = capsys.readouterr().err
  assert "E-INIT-001" in err and "Traceback" not in err
  assert "num_key_value_heads 2 there, 4 here" in err
  assert "rope_theta 500000.0 there, 10000.0 here" in err
  assert "self_attn.k_proj" in err  # the tensors of another shape, both sides


@pytest.mark.slow  # runs warm-started from an imported Llama
def test_warm_start_from_a_llama_folder_and_its_e_init_001(tmp_path, capsys):
  from sexpgpu.models.source import checkpoint_params
  _, hf = _flax_llama(tmp_path)
  path = _write(str(tmp_path))
  assert main(["import", hf, "-o", str(tmp_path / "imported"), path]) == 0
  want, _ = checkpoint_params(str(tmp_path / "imported" / "tiny-llama" / "0"))
  ck = str(tmp_path / "ck")
  sexpgpu.compile(path, set={"init-from": f"hf:{hf}"}).run(steps=0, checkpoint_dir=ck)
  (slug,) = os.listdir(ck)
  got, _ = checkpoint_params(os.path.join(ck, slug, "0"))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  assert main(["run", path, "--steps", "1", "--init-from", f"hf:{hf}", "--set",
               "hidden=48"]) == 1
  err = capsys.readouterr().err
  assert "E-INIT-001" in err and "intermediate_size 64 there, 48 here" in err
  assert "mlp.gate_proj" in err and "Traceback" not in err


PACKED = """(require std/lm)
(require std/llama)
(defloader train (arrays "rows.npz" :fields [tokens segments positions] :batch 2))
(defn lm-loss [t s p ls]
  (next-token-loss (llama (lm-inputs t) :vocab 64 :width 16 :layers 2 :heads 4 :kv-heads 2
                          :hidden 24 :context 32 :segments (lm-inputs s)
                          :positions (lm-inputs p))
                   t :segments ls))
(defn loss [batch]
  (let [s (get batch :segments)]
    (lm-loss (get batch :tokens) s (get batch :positions) s)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01))
"""


def test_packed_documents_each_see_only_themselves(tmp_path):
  """The text loader's packed rows: with :segments (and :positions, the twin's position_ids),
  each document's loss is what it is alone in a row."""
  import jax
  from test_text_masks import ROWS, SEQ, _only, _pack
  t, s, p, docs = _pack(ROWS, SEQ)
  np.savez(tmp_path / "rows.npz", tokens=t, segments=s, positions=p)
  e = sexpgpu.compile_text(PACKED, "packed.sx", base_dir=str(tmp_path))
  params = dict(e.init(seed=3).params)
  loss = jax.jit(lambda prm, t, s, p, ls: e.call("lm-loss", prm, t, s, p, ls))

  def alone(row, start, n):
    ta, sa, pa = (np.zeros((1, SEQ), np.int32) for _ in range(3))
    ta[0, :n], sa[0, :n], pa[0, :n] = t[row, start:start + n], 1, np.arange(n)
    return float(loss(params, ta, sa, pa, sa))

  for row, seg, start, n, _ in docs:
    assert abs(float(loss(params, t, s, p, _only(s, row, seg))) - alone(row, start, n)) < 1e-5
  # a row seen as one document: the second document sees the first, and its loss moves
  row, seg, start, n, _ = docs[1]
  one = np.where(s > 0, 1, 0).astype(np.int32)
  assert abs(float(loss(params, t, one, p, _only(s, row, seg))) - alone(row, start, n)) > 1e-4


def test_a_gpt2_folder_imported_into_a_llama_says_so_in_one_line(tmp_path, capsys):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  hf = str(tmp_path / "gpt2")
  FlaxGPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=48, n_embd=32, n_layer=2,
                                 n_head=4)).save_pretrained(hf, safe_serialization=True)
  path = _write(str(tmp_path))
  assert main(["import", hf, "-o", str(tmp_path / "ck"), path]) == 1
  err = capsys.readouterr().err
  assert ("E-INIT-001" in err and "a gpt2 folder (config.json model_type 'gpt2'), and this "
          "experiment's model is a llama" in err), err
  assert "hidden_size" not in err and "Traceback" not in err

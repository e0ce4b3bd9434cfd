"""std/gpt2 and its twin: export (.safetensors, a Hugging Face folder) and import, checked
against transformers' own GPT-2 (its Flax GPT2LMHeadModel: no torch, nothing downloaded)."""

import json
import os

import numpy as np
import pytest

import sexpgpu
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GPT2_SX = """
(require std/lm)
(require std/gpt2)
(defknob vocab 40)
(defknob width 32)
(defknob layers 2)
(defknob heads 4)
(defknob seq 16)
(defknob context 48)
(defloader train (markov :vocab vocab :seq (+ seq 1) :batch 4 :seed 7))
(defn lm [tokens]
  (gpt2 tokens :vocab vocab :width width :layers layers :heads heads :context context))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 3 :optimizer (adamw :lr 0.01 :weight-decay 0.0)
        :precision f32 :seed 1)
"""


def _trained(tmp, text=GPT2_SX, name="tiny-gpt2.sx", steps=3):
  path = os.path.join(tmp, name)
  with open(path, "w") as f:
    f.write(text)
  ck = os.path.join(tmp, "ck")
  sexpgpu.compile(path).run(steps=steps, checkpoint_dir=ck)
  slug = name[:-3]
  return path, os.path.join(ck, slug, str(steps))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  return _trained(str(tmp_path_factory.mktemp("gpt2")))


def _logits(path, params, tokens, fn="lm"):
  from sexpgpu.models import forward
  from sexpgpu.run.compile import compile_file
  c = compile_file(path)
  f = forward.forward(c, fn, tokens.shape[1], tokens.shape[0])
  return np.asarray(f(forward.device_params(c, params), tokens))


def test_gpt2_small_has_gpt2_smalls_parameters():
  from sexpgpu.models.twin import find
  from sexpgpu.run.compile import compile_file
  c = compile_file(os.path.join(ROOT, "configs", "gpt2-small.sx"))
  assert sum(p.count for p in c.params.values()) == 124_439_808  # GPT-2 small's, exactly
  g = find(c.params, c.stages[0].graph, "test")
  cfg = g.config
  assert (cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"],
          cfg["n_head"], cfg["layer_norm_epsilon"]) == (50257, 1024, 768, 12, 12, 1e-5)


def test_export_safetensors_keeps_every_path_and_the_metadata(trained, tmp_path):
  from safetensors import safe_open
  from sexpgpu.models.source import checkpoint_params
  path, step_dir = trained
  out = str(tmp_path / "m.safetensors")
  assert main(["export", path, "--resume", step_dir, "-o", out]) == 0
  params, meta = checkpoint_params(step_dir)
  with safe_open(out, "np") as f:
    md = f.metadata()
    assert sorted(f.keys()) == sorted(params)
    for k in params:
      np.testing.assert_array_equal(f.get_tensor(k), params[k])
  assert md["fingerprint"] == meta["fingerprint"] and md["slug"] == "tiny-gpt2"
  assert md["step"] == "3" and json.loads(md["knobs"])["width"] == 32
  assert "jax" in json.loads(md["versions"])


@pytest.mark.slow  # loads the export in transformers' Flax model
def test_export_hf_loads_in_transformers_flax_with_equal_logits(trained, tmp_path):
  # greedy text against transformers' generate: tests/test_twins_torch.py (Flax's generate
  # compiles for a minute and says the same)
  from transformers import FlaxGPT2LMHeadModel
  from sexpgpu.models.source import checkpoint_params
  path, step_dir = trained
  out = str(tmp_path / "hf")
  assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  twin = FlaxGPT2LMHeadModel.from_pretrained(out)
  params, _ = checkpoint_params(step_dir)
  tokens = np.random.RandomState(0).randint(0, 40, (2, 16)).astype(np.int32)
  theirs = np.asarray(twin(tokens).logits)
  ours = _logits(path, params, tokens)
  assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.slow  # transformers parity: a twin built and saved by transformers
def test_a_gpt2_saved_by_transformers_imports_with_equal_logits(tmp_path):
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  from sexpgpu.models.source import checkpoint_params
  cfg = GPT2Config(vocab_size=40, n_positions=48, n_embd=32, n_layer=2, n_head=4)
  twin = FlaxGPT2LMHeadModel(cfg, seed=3)
  hf = str(tmp_path / "hf")
  twin.save_pretrained(hf, safe_serialization=True)  # the Flax twin's names and layout
  path = str(tmp_path / "tiny-gpt2.sx")
  with open(path, "w") as f:
    f.write(GPT2_SX)
  ck = str(tmp_path / "ck")
  assert main(["import", hf, "-o", ck, path]) == 0
  step0 = os.path.join(ck, "tiny-gpt2", "0")
  params, meta = checkpoint_params(step0)
  assert meta["step"] == 0
  tokens = np.random.RandomState(1).randint(0, 40, (2, 16)).astype(np.int32)
  theirs = np.asarray(twin(tokens).logits)
  assert np.abs(_logits(path, params, tokens) - theirs).max() < 1e-5
  # the step-0 checkpoint is one that `run --resume` trains on from step 0
  summary = sexpgpu.compile(path).run(steps=1, resume=step0)
  assert np.isfinite(summary.train_loss)


def test_an_exported_hf_folder_imports_back_bit_for_bit(trained, tmp_path):
  from sexpgpu.models.source import checkpoint_params
  path, step_dir = trained
  out, ck = str(tmp_path / "hf"), str(tmp_path / "ck")
  assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
  assert main(["import", out, "-o", ck, path]) == 0
  before, _ = checkpoint_params(step_dir)
  after, _ = checkpoint_params(os.path.join(ck, "tiny-gpt2", "0"))
  assert sorted(before) == sorted(after)
  for k in before:
    np.testing.assert_array_equal(before[k], after[k])


def test_import_names_what_differs_and_refuses_hub_names(trained, tmp_path, capsys):
  path, step_dir = trained
  out = str(tmp_path / "hf")
  assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
  assert main(["import", out, "-o", str(tmp_path / "ck"), path, "--set", "heads=2"]) == 1
  err = capsys.readouterr().err
  assert "E-INIT-001" in err and "n_head 4 there, 2 here" in err
  assert main(["import", "openai-community/gpt2", "-o", str(tmp_path / "ck"), path]) == 1
  err = capsys.readouterr().err
  assert "E-INIT-001" in err and "nothing is downloaded" in err


def test_hf_export_of_a_model_that_is_no_gpt2_names_the_parameters(tmp_path, capsys):
  from sexpgpu.models.twin import find
  from sexpgpu.run.compile import compile_source
  extra = GPT2_SX.replace(
      "(gpt2 tokens :vocab vocab :width width :layers layers :heads heads :context context))",
      "(+ (gpt2 tokens :vocab vocab :width width :layers layers :heads heads :context context)"
      " (param head-bias [vocab] :init zeros)))")
  c = compile_source(extra)
  with pytest.raises(SxError) as e:
    find(c.params, c.stages[0].graph, "--format hf")
  assert e.value.code == "E-EXPORT-001" and "lm/head-bias" in str(e.value)
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  path = os.path.join(ROOT, "configs", "tiny-lm.sx")
  c = sexpgpu.compile(path)._c
  step_dir = write_step0(c, {k: np.asarray(v) for k, v in init_params(1, c.params).items()},
                         str(tmp_path / "ck"))
  assert main(["export", path, "--resume", step_dir, "-o", str(tmp_path / "o"),
               "--format", "hf"]) == 1
  err = capsys.readouterr().err
  assert "E-EXPORT-001" in err and "lm/transformer-lm/embed" in err
  assert "Traceback" not in err


def test_export_of_another_experiments_checkpoint_is_refused(trained, tmp_path, capsys):
  path, step_dir = trained
  assert main(["export", path, "--set", "width=64", "--resume", step_dir, "-o",
               str(tmp_path / "x.safetensors")]) == 1
  assert "E-CKPT-002" in capsys.readouterr().err


def test_export_to_a_place_that_cannot_be_written_is_e_form_001(trained, tmp_path, capsys):
  path, step_dir = trained
  (tmp_path / "file").write_text("not a folder")
  for out, fmt in ((tmp_path / "file" / "m.safetensors", "safetensors"),
                   (tmp_path / "file" / "hf", "hf")):
    assert main(["export", path, "--resume", step_dir, "-o", str(out), "--format", fmt]) == 1
    err = capsys.readouterr().err
    assert "error[E-FORM-001]: cannot write" in err and "--> -o" in err, err
    assert "Traceback" not in err
  assert main(["export", path, "--resume", step_dir, "-o", str(tmp_path / "hf"), "--format",
               "hf", "--tokenizer", str(tmp_path / "none.json")]) == 1
  err = capsys.readouterr().err
  assert "error[E-TOK-002]: no tokenizer file" in err and "nothing is downloaded" in err, err
  assert not (tmp_path / "hf").exists()  # refused before anything is written


def _bpe(tmp_path, vocab=1024):
  from sexpgpu.tools.tokenize import train_bpe
  text = open(os.path.join(ROOT, "tests", "data", "corpus.txt"), encoding="utf-8").read()
  tok = train_bpe(iter([text] * 4), vocab, "<|endoftext|>")
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  return path, tok


def test_the_twins_end_of_text_is_the_tokenizers_never_an_ordinary_word(tmp_path):
  from sexpgpu.models.twin import find, token_ids
  from sexpgpu.run.compile import compile_source
  path, tok = _bpe(tmp_path)
  eos = tok.token_to_id("<|endoftext|>")
  assert token_ids(path, 1024) == {"bos_token_id": eos, "eos_token_id": eos}
  assert token_ids(path, eos) == {"bos_token_id": None, "eos_token_id": None}  # out of reach
  c = compile_source(GPT2_SX.replace("(defknob vocab 40)", "(defknob vocab 1024)"))
  cfg = find(c.params, c.stages[0].graph, "test").config
  assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None  # not 1023, a word


def test_token_ids_of_a_file_that_is_no_tokenizer_is_e_tok_002(tmp_path):
  from sexpgpu.models.twin import token_ids
  bad = tmp_path / "tokenizer.json"
  bad.write_text("[1, 2")
  with pytest.raises(SxError) as e:
    token_ids(str(bad), 10)
  assert e.value.code == "E-TOK-002" and str(bad) in e.value.message


def test_export_with_a_tokenizer_writes_its_end_of_text_id(trained, tmp_path):
  path, step_dir = trained
  tok_path, tok = _bpe(tmp_path)
  out = str(tmp_path / "hf")
  assert main(["export", path, "--resume", step_dir, "-o", out, "--format", "hf",
               "--tokenizer", tok_path]) == 0
  cfg = json.load(open(os.path.join(out, "config.json")))
  eos = tok.token_to_id("<|endoftext|>")
  assert eos < 40 and cfg["eos_token_id"] == cfg["bos_token_id"] == eos

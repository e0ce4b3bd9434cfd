"""`sexpgpu import` and `:init-from` of hostile Hugging Face folders (issue 37, findings 7 and
9): a config.json or weight index that is no JSON object within its bound, a known key of the
wrong type or size, NaN or infinity in config.json or the tensors, weights that are garbage,
a FIFO or /dev/zero: each E-INIT-001 naming the file and the key or tensor, nothing written."""

import importlib.util
import json
import os
import shutil
import threading

import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

SX = """(require std/lm)
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
def base(tmp_path_factory):
  """The experiment, its compiled form, random parameters and their exported hf folder."""
  from sexpgpu.lower.init import init_params
  from sexpgpu.models import export
  from sexpgpu.run.compile import compile_file
  tmp = tmp_path_factory.mktemp("import-hostile")
  path = str(tmp / "w.sx")
  with open(path, "w", encoding="utf-8") as f:
    f.write(SX)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(11, c.params).items()}
  hf = str(tmp / "hf")
  export.export(c, params, {"step": 0}, hf, "hf")
  return path, c, params, hf


@pytest.fixture
def folder(base, tmp_path):
  """A fresh copy of the exported folder to spoil."""
  hf = str(tmp_path / "hf")
  shutil.copytree(base[3], hf)
  return hf


def _import(base, hf, tmp_path, capsys, *extra, code=1):
  out = str(tmp_path / "ck")
  assert main(["import", hf, "-o", out, base[0], *extra]) == code
  err = capsys.readouterr().err
  assert "Traceback" not in err
  if code == 1:
    assert err.startswith("error[E-INIT-001]"), err
    assert not os.path.exists(out)  # nothing written before the refusal
  return err


def _config(hf, **changes):
  path = os.path.join(hf, "config.json")
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  config.update(changes)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(config, f)


# --- finding 9: config.json ----------------------------------------------------------------------

@pytest.mark.parametrize("data, problem", [
    (b"{,}", "is not JSON (line 1, column 2)"),
    (b"\x00\xff\xfe binary", "is not UTF-8 text"),
    (b"[1, 2]", "holds an array, where an object was expected"),
    (b"", "is not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64 levels"),
])
def test_a_config_json_that_is_no_object_is_e_init_001(base, folder, tmp_path, capsys, data,
                                                        problem):
  with open(os.path.join(folder, "config.json"), "wb") as f:
    f.write(data)
  err = _import(base, folder, tmp_path, capsys)
  assert os.path.join(folder, "config.json") in err and problem in err


@pytest.mark.parametrize("key, value, expected", [
    ("vocab_size", "24", "a whole number from 1 to 2147483647"),
    ("vocab_size", -24, "a size from 1 to 2147483647"),
    ("vocab_size", 10 ** 12, "a size from 1 to 2147483647"),
    ("n_layer", True, "a whole number"),
    ("n_head", 2.5, "a whole number"),
    ("layer_norm_epsilon", "x", "a number is expected"),
    ("layer_norm_epsilon", {}, "a number is expected"),
    ("model_type", ["gpt2"], "a string is expected"),
    ("tie_word_embeddings", "yes", "true or false"),
])
def test_a_config_key_of_the_wrong_type_or_size_is_named(base, folder, tmp_path, capsys, key,
                                                         value, expected):
  _config(folder, **{key: value})
  err = _import(base, folder, tmp_path, capsys)
  assert f"config.json: {key} is " in err and expected in err
  assert f"--> {os.path.join(folder, 'config.json')} {key}" in err


def test_a_fifo_or_dev_zero_as_config_json_is_refused_without_reading(base, folder, tmp_path,
                                                                      capsys):
  cfg = os.path.join(folder, "config.json")
  os.remove(cfg)
  os.mkfifo(cfg)
  done = []
  t = threading.Thread(target=lambda: done.append(
      main(["import", folder, "-o", str(tmp_path / "ck"), base[0]])), daemon=True)
  t.start()
  t.join(60)
  assert done == [1] and "FIFO" in capsys.readouterr().err
  os.remove(cfg)
  os.symlink("/dev/zero", cfg)
  assert "character device" in _import(base, folder, tmp_path, capsys)


# --- finding 9: the weights ----------------------------------------------------------------------

@pytest.mark.parametrize("how, problem", [
    ("missing", "has no model.safetensors"),
    ("garbage", "cannot read"),
    ("empty", "cannot read"),
    ("fifo", "is not a regular file"),
    ("zero", "is not a regular file"),
])
def test_weights_missing_garbage_or_no_file(base, folder, tmp_path, capsys, how, problem):
  weights = os.path.join(folder, "model.safetensors")
  os.remove(weights)
  if how in ("garbage", "empty"):
    with open(weights, "wb") as f:
      f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" if how == "garbage" else b"")
  elif how == "fifo":
    os.mkfifo(weights)
  elif how == "zero":
    os.symlink("/dev/zero", weights)
  assert problem in _import(base, folder, tmp_path, capsys)


def _shard(folder):
  """Splits the folder's weights into two shards and an index; returns the index's path."""
  from safetensors.numpy import load_file, save_file
  weights = os.path.join(folder, "model.safetensors")
  tensors = load_file(weights)
  os.remove(weights)
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[:3],
            "model-00002-of-00002.safetensors": names[3:]}
  for shard, held in shards.items():
    save_file({k: tensors[k] for k in held}, os.path.join(folder, shard),
              metadata={"format": "pt"})
  index = os.path.join(folder, "model.safetensors.index.json")
  with open(index, "w", encoding="utf-8") as f:
    json.dump({"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
  return index


def test_a_sharded_folder_imports_as_the_single_file_does(base, folder, tmp_path, capsys):
  from sexpgpu.models.source import checkpoint_params
  _shard(folder)
  _import(base, folder, tmp_path, capsys, code=0)
  got, _ = checkpoint_params(str(tmp_path / "ck" / "w" / "0"))
  for k, v in base[2].items():
    np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("index, problem", [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64 levels"),
    (b'{"weight_map": ["a"]}', "weight_map is not an object"),
    (b'{"weight_map": {"x": "../model-00001-of-00002.safetensors"}}', "no .safetensors file"),
    (b'{"weight_map": {"x": "/etc/passwd"}}', "no .safetensors file of the folder"),
    (b'{"weight_map": {"x": "model-00001-of-00002.safetensors"}}', "lists tensors no shard"),
])
def test_a_hostile_weight_index_is_e_init_001(base, folder, tmp_path, capsys, index, problem):
  path = _shard(folder)
  with open(path, "wb") as f:
    f.write(index)
  err = _import(base, folder, tmp_path, capsys)
  assert problem in err and "model.safetensors.index.json" in err


# --- finding 7: NaN and infinity ------------------------------------------------------------------

def _spoil_tensor(folder, value):
  from safetensors.numpy import load_file, save_file
  weights = os.path.join(folder, "model.safetensors")
  tensors = load_file(weights)
  name = "transformer.wte.weight" if "transformer.wte.weight" in tensors else "wte.weight"
  t = tensors[name].copy()
  t[3, 5] = value
  tensors[name] = t
  save_file(tensors, weights, metadata={"format": "pt"})


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_unless_allowed(base, folder, tmp_path, capsys, value):
  from sexpgpu.models.source import checkpoint_params
  _spoil_tensor(folder, value)
  err = _import(base, folder, tmp_path, capsys)
  assert "1 tensor holds NaN or infinity" in err and "cannot train" in err
  assert "lm/gpt2/wte: 1 of 384 values NaN or infinite" in err and "at [3, 5]" in err
  assert "--allow-nonfinite" in err
  _import(base, folder, tmp_path, capsys, "--allow-nonfinite", code=0)
  got, _ = checkpoint_params(str(tmp_path / "ck" / "w" / "0"))
  assert not np.isfinite(got["lm/gpt2/wte"][3, 5]) and np.isfinite(got["lm/gpt2/wpe"]).all()


def test_a_non_finite_config_value_is_refused_unless_allowed(base, folder, tmp_path, capsys):
  _config(folder, layer_norm_epsilon=float("nan"), initializer_range=float("inf"))
  err = _import(base, folder, tmp_path, capsys)
  assert "holds non-finite numbers: initializer_range inf, layer_norm_epsilon nan" in err
  assert f"--> {os.path.join(folder, 'config.json')}" in err
  _import(base, folder, tmp_path, capsys, "--allow-nonfinite", code=0)


def test_warm_starts_refuse_non_finite_tensors_of_every_kind(base, folder, tmp_path):
  """`:init-from` of a checkpoint, a .safetensors file or hf:DIR holding NaN: E-INIT-001 at
  :init-from naming the parameter, before any initializer runs."""
  from sexpgpu.models import export, warm
  path, c, params, _ = base
  spoiled = dict(params)
  spoiled["lm/gpt2/wpe"] = params["lm/gpt2/wpe"].copy()
  spoiled["lm/gpt2/wpe"][1, 2] = np.nan
  step_dir = export.write_step0(c, spoiled, str(tmp_path / "ck"))
  st = str(tmp_path / "w.safetensors")
  export.export(c, spoiled, {"step": 0}, st, "safetensors")
  _spoil_tensor(folder, np.inf)
  for source, name in ((step_dir, "lm/gpt2/wpe"), (st, "lm/gpt2/wpe"),
                       ("hf:" + folder, "lm/gpt2/wte")):
    loaded, what = warm.load(c, source)
    with pytest.raises(SxError) as e:
      warm.check(c, loaded, what, partial=False)
    assert e.value.code == "E-INIT-001" and e.value.where == ":init-from"
    assert f"{name}: 1 of" in e.value.message and "sexpgpu import --allow-nonfinite" in e.value.fix
  _config(folder, layer_norm_epsilon=float("nan"))
  with pytest.raises(SxError, match="non-finite numbers: layer_norm_epsilon nan"):
    warm.load(c, "hf:" + folder)


# --- the fuzzer's slice ----------------------------------------------------------------------------

def _fuzzer():
  spec = importlib.util.spec_from_file_location(
      "fuzz_text_models", os.path.join(ROOT, "benchmarks", "fuzz_text_models.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_slice_of_the_import_fuzzer_finds_nothing(tmp_path):
  fz = _fuzzer()
  paths = fz.prepare(str(tmp_path))
  findings, refused = [], 0
  for i in range(25):
    case = str(tmp_path / f"case-{i}")
    os.makedirs(case)
    argv = fz._import_case(fz.fuzz_base.case_rng(37, i), case, paths)
    refused += bool(argv.bad)
    found = fz.fuzz_base.feed(case, list(argv), {}, [argv.bad] if argv.bad else [])
    if found:
      findings.append(f"{i} {argv}: {found}")
    shutil.rmtree(case, ignore_errors=True)
  assert findings == [] and refused >= 15

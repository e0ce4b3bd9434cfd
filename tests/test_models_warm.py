"""Warm start (`:init-from`): from a checkpoint folder, a .safetensors file and hf:DIR;
E-INIT-001 for missing, extra and mismatched parameters; `:init-partial`; --resume wins."""

import os

import numpy as np
import pytest

import sexpgpu
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

SX = """
(require std/lm)
(require std/gpt2)
(defknob width 16)
(defknob extra false)
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (let [y (gpt2 tokens :vocab 24 :width width :layers 1 :heads 2 :context 8)]
    (if extra (+ y (param head-bias [24] :init (constant 0.5))) y)))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """An experiment, a step-0 checkpoint of random parameters, and its exports."""
  from sexpgpu.lower.init import init_params
  from sexpgpu.models import export
  from sexpgpu.run.compile import compile_file
  tmp = str(tmp_path_factory.mktemp("warm"))
  path = os.path.join(tmp, "w.sx")
  with open(path, "w") as f:
    f.write(SX)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(11, c.params).items()}
  step_dir = export.write_step0(c, params, os.path.join(tmp, "ck"))
  meta = {"step": 0}
  st = os.path.join(tmp, "w.safetensors")
  export.export(c, params, meta, st, "safetensors")
  hf = os.path.join(tmp, "hf")
  export.export(c, params, meta, hf, "hf")
  return path, params, step_dir, st, hf, tmp


def _final_params(path, tmp, name, **sets):
  """Runs 0 steps (only the end's checkpoint) and returns the parameters it saved."""
  from sexpgpu.models.source import checkpoint_params
  ck = os.path.join(tmp, name)
  exp = sexpgpu.compile(path, set=sets)
  exp.run(steps=0, checkpoint_dir=ck)
  (slug,) = os.listdir(ck)
  return checkpoint_params(os.path.join(ck, slug, "0"))[0]


@pytest.mark.parametrize("kind", ["checkpoint", "safetensors", "hf"])
def test_warm_start_from_each_kind_of_source(source, kind):
  path, params, step_dir, st, hf, tmp = source
  given = {"checkpoint": step_dir, "safetensors": st, "hf": "hf:" + hf}[kind]
  got = _final_params(path, tmp, f"out-{kind}", **{"init-from": given})
  assert sorted(got) == sorted(params)
  for k in params:
    np.testing.assert_array_equal(got[k], params[k])


def _fit(path, **sets):
  from sexpgpu.models import warm
  from sexpgpu.run.compile import compile_file
  c = compile_file(path, sets=[(k, str(v)) for k, v in sets.items()])
  loaded, what = warm.load(c, warm.source_of(c))
  return warm.check(c, loaded, what, bool(c.exp.run["init-partial"]))


def test_e_init_001_lists_missing_extra_and_mismatched_with_both_sides(source, tmp_path):
  from safetensors.numpy import save_file
  path, params, step_dir, st, hf, tmp = source
  with pytest.raises(SxError) as e:  # the model has head-bias, the source has not
    _fit(path, **{"init-from": st, "extra": "true"})
  assert e.value.code == "E-INIT-001"
  assert "lm/head-bias: f32[24] here, missing there" in str(e.value)
  more = dict(params, **{"lm/other": np.zeros((3,), np.float32)})
  save_file(more, str(tmp_path / "more.safetensors"))
  with pytest.raises(SxError) as e:
    _fit(path, **{"init-from": str(tmp_path / "more.safetensors")})
  assert "lm/other: f32[3] there, no such parameter here" in str(e.value)
  with pytest.raises(SxError) as e:  # another width: every parameter, both shapes
    _fit(path, **{"init-from": step_dir, "width": "32"})
  assert "lm/gpt2/wte: f32[24,16] there, f32[24,32] here" in str(e.value)
  assert "does not fit 16 parameters" in str(e.value)
  ints = dict(params, **{"lm/gpt2/ln_f/bias": np.zeros((16,), np.int32)})
  save_file(ints, str(tmp_path / "ints.safetensors"))
  with pytest.raises(SxError) as e:
    _fit(path, **{"init-from": str(tmp_path / "ints.safetensors")})
  assert "lm/gpt2/ln_f/bias: i32[16] there, f32[16] here" in str(e.value)


@pytest.mark.slow  # runs warm-started
def test_the_run_refuses_before_any_initializer_and_init_partial_fills_in(source, capfd):
  path, params, step_dir, st, hf, tmp = source
  with pytest.raises(SxError) as e:
    sexpgpu.compile(path, set={"init-from": st, "extra": "true"}).run(steps=1)
  assert e.value.code == "E-INIT-001"
  got = _final_params(path, tmp, "partial", **{"init-from": st, "extra": "true",
                                               "init-partial": "true"})
  np.testing.assert_array_equal(got["lm/head-bias"], np.full((24,), 0.5, np.float32))
  np.testing.assert_array_equal(got["lm/gpt2/wte"], params["lm/gpt2/wte"])


def test_resume_wins_over_init_from_and_the_flag_and_variable_set_the_knob(source, capsys,
                                                                            monkeypatch):
  from sexpgpu.run.flags import init_from_sets
  path, params, step_dir, st, hf, tmp = source
  # a source that would not fit: a resume never reads it
  assert main(["run", path, "--resume", step_dir, "--init-from", "nowhere.safetensors",
               "--steps", "1"]) == 0
  assert "init-from:" not in capsys.readouterr().err
  assert init_from_sets("a/b", [("lr", "1")]) == [("init-from", "a/b"), ("lr", "1")]
  monkeypatch.setenv("SEXPGPU_INIT_FROM", "hf:x")
  assert init_from_sets(None, []) == [("init-from", "hf:x")]
  assert init_from_sets("c", []) == [("init-from", "c")]
  assert main(["run", path, "--steps", "1"]) == 1
  err = capsys.readouterr().err
  assert "E-INIT-001" in err and "x is not a folder" in err

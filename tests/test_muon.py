"""Muon (issue 38): optax.contrib.muon on the hidden and expert matrices, each matrix of a
`repeat` stack and of an experts axis orthogonalised on its own, AdamW on the rest, the split
read from the parameters' roles; `check --print params` says which each parameter gets."""

import json
import os
import subprocess

import jax
import numpy as np
import optax
import pytest
from optax.contrib import muon

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.errors import SxError
from sexpgpu.lower.optim import make_optimizer, matrices, optimizer_of
from sexpgpu.run.check import params_text
from sexpgpu.run.compile import compile_source

LR, ADAM_LR, WD, BETA = 0.02, 3e-3, 0.1, 0.9

HEAD = """
(require std/lm)
(require MODULE)
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
(defn lm [tokens] (MODEL))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps STEPS :precision f32 :seed 1
        :optimizer OPTIMIZER)
"""
GPT2 = ("std/gpt2", "gpt2 tokens :vocab 40 :width 32 :layers 2 :heads 4 :context 48")
MIXTRAL = ("std/mixtral", "mixtral tokens :vocab 40 :width 16 :layers 2 :heads 2 :kv-heads 1 "
           ":hidden 24 :experts 3 :top-k 2 :context 16")
MUON = f"(muon :lr {LR} :momentum {BETA} :adam-lr {ADAM_LR} :weight-decay {WD})"


def source(model=GPT2, optimizer=MUON, steps=3):
  text = HEAD.replace("MODULE", model[0]).replace("MODEL", model[1])
  return text.replace("OPTIMIZER", optimizer).replace("STEPS", str(steps))


def _compile(model=GPT2, optimizer=MUON):
  return compile_source(source(model, optimizer), "muon.sx")


@pytest.fixture(scope="module")
def gpt2():
  return _compile()


@pytest.fixture(scope="module")
def mixtral():
  return _compile(MIXTRAL)


def _one_step(c):
  """The parameters (random, at their full stacked shapes), random gradients, and sexpgpu's
  Muon update of them, jitted as the train step runs it."""
  opt, _ = make_optimizer(c.exp.optimizer, 3, c.stages[0].graph)
  rng = np.random.default_rng(0)
  params = {k: jax.numpy.asarray(rng.normal(0, 0.5, p.full_shape).astype(np.float32))
            for k, p in sorted(c.params.items())}
  grads = {k: jax.numpy.asarray(rng.normal(0, 1, v.shape).astype(np.float32))
           for k, v in params.items()}
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  return params, grads, {k: np.asarray(v) for k, v in updates.items()}


def _by_hand_muon(w, g):
  """optax.contrib.muon's update of one 2-D matrix (its own default split: muon for 2-D)."""
  tx = muon(LR, beta=BETA, weight_decay=WD)
  u, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
  return np.asarray(u["w"])


def _by_hand_adamw(w, g, decayed):
  tx = optax.adamw(ADAM_LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WD if decayed else 0.0)
  u, _ = tx.update(g, tx.init(w), w)
  return np.asarray(u)


def _check_against_optax(c, stacked_axes):
  params, grads, updates = _one_step(c)
  split = optimizer_of(c.exp.optimizer, c.stages[0].graph)
  mats = matrices(c.stages[0].graph)
  checked = 0
  for path, opt in split.items():
    w, g = np.asarray(params[path]), np.asarray(grads[path])
    if opt == "muon":
      red, out = mats[path]
      assert len(red) == len(out) == 1 and out[0] == red[0] + 1 == w.ndim - 1
      assert red[0] == stacked_axes(path)
      # each layer's (and each expert's) matrix on its own, as a plain 2-D Muon would
      for index in np.ndindex(*w.shape[:red[0]]):
        np.testing.assert_allclose(updates[path][index], _by_hand_muon(w[index], g[index]),
                                   rtol=0, atol=1e-6, err_msg=f"{path}{index}")
        checked += 1
    else:
      decayed = path.endswith(("/w", "/head")) and "wte" not in path
      np.testing.assert_allclose(updates[path], _by_hand_adamw(w, g, decayed), rtol=0,
                                 atol=1e-6, err_msg=path)
  return split, checked


def test_one_step_is_optax_muon_layer_by_layer_and_adamw_on_the_rest(gpt2):
  split, checked = _check_against_optax(gpt2, lambda path: 1)
  assert sorted(p for p, o in split.items() if o == "muon") == [
      "lm/gpt2/h/gpt2-block/attn/c_attn/w", "lm/gpt2/h/gpt2-block/attn/c_proj/w",
      "lm/gpt2/h/gpt2-block/mlp/c_fc/w", "lm/gpt2/h/gpt2-block/mlp/c_proj/w"]
  assert checked == 4 * 2  # four matrices, two layers each
  assert split["lm/gpt2/wte"] == "adamw" and split["lm/gpt2/ln_f/scale"] == "adamw"


def test_the_stack_is_not_orthogonalised_as_one_matrix(gpt2):
  """A [layers, in, out] update of Muon's over the stack flattened differs from each
  layer's: the test above would see that difference."""
  params, grads, updates = _one_step(gpt2)
  path = "lm/gpt2/h/gpt2-block/mlp/c_fc/w"
  w, g = np.asarray(params[path]), np.asarray(grads[path])
  whole = _by_hand_muon(w.reshape(-1, w.shape[-1]), g.reshape(-1, g.shape[-1]))
  assert np.abs(whole.reshape(w.shape) - updates[path]).max() > 1e-3


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_experts_are_a_batch_of_matrices_each_orthogonalised(mixtral):
  graph = mixtral.stages[0].graph
  experts = [p for p, r in matrices(graph).items() if len(mixtral.params[p].full_shape) == 4]
  assert experts  # [layers, experts, in, out]
  split, checked = _check_against_optax(
      mixtral, lambda path: 2 if path in experts else 1)
  assert checked == sum(int(np.prod(mixtral.params[p].full_shape[:r[0][0]]))
                        for p, r in matrices(graph).items())


def test_check_prints_which_optimizer_each_parameter_gets(gpt2):
  lines = params_text(gpt2).splitlines()
  assert lines[0].split()[-2:] == ["decay", "opt"]
  by = {ln.split()[0]: ln.split()[-1] for ln in lines[1:-3]}
  assert by["lm/gpt2/h/gpt2-block/attn/c_attn/w"] == "muon"
  assert by["lm/gpt2/wte"] == by["lm/gpt2/h/gpt2-block/ln_1/scale"] == "adamw"
  assert sum(v == "muon" for v in by.values()) == 4 and len(by) == 16
  assert lines[-1] == ("opt: muon orthogonalises 4 of 16 parameters (each stacked matrix on "
                       "its own), adamw updates the other 12")


def test_another_optimizers_table_has_no_opt_column():
  lines = params_text(_compile(optimizer="(adamw :lr 0.01)")).splitlines()
  assert lines[0].split()[-1] == "decay" and not lines[-1].startswith("opt:")


@pytest.mark.parametrize("optimizer, code, message, fix", [
    ("(muon :lr 0.02 :ns-steps 0)", "E-RUN-002",
     "muon :ns-steps is the number 0; it must be an integer from 1 to 100", ":ns-steps 5"),
    ("(muon :lr 0.02 :momentum 1.5)", "E-RUN-002",
     "muon :momentum is the number 1.5; it must be a number from 0 to 1", ":momentum 0.9"),
    ('(muon :lr 0.02 :adam-lr "fast")', "E-RUN-002",
     'muon :adam-lr is the string "fast"; it must be a number from 0 to 3.4e38 '
     "(float32's largest)", ":adam-lr 3e-4"),
    ("(muon :lr 0.02 :adam-rl 3e-4)", "E-FORM-002", "muon has no keyword :adam-rl", None),
    ("(muom :lr 0.02)", "E-NAME-001", "`muom` is not defined",
     "did you mean `muon` or `sum` or `mod`?"),
])
def test_a_bad_muon_keyword_is_an_error_with_its_fix(optimizer, code, message, fix):
  with pytest.raises(SxError) as e:
    _compile(optimizer=optimizer)
  assert e.value.code == code and e.value.message == message
  assert e.value.location.file == "muon.sx" and e.value.location.line == 8
  if fix:
    assert e.value.fix == fix
  else:
    assert e.value.fix.startswith("did you mean `:adam-lr`? muon takes :lr :momentum ")


def _losses(path):
  return [e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"]


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_a_gpt2_trains_under_muon(tmp_path, capsys):
  from sexpgpu.cli.main import main
  sx = tmp_path / "muon.sx"
  sx.write_text(source(steps=12))
  m = tmp_path / "m.jsonl"
  code = main(["run", str(sx), "--metrics", f"jsonl:{m}"])  # in this process: one device
  err = capsys.readouterr().err
  assert code == 0, err
  losses = _losses(m)
  assert len(losses) == 12 and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_a_gpt2_trains_under_muon_and_fsdp_over_2_host_devices(tmp_path):
  sx = tmp_path / "muon.sx"
  sx.write_text(source(steps=12))
  m = tmp_path / "m.jsonl"
  env = dict(os.environ, SEXPGPU_DEVICES="0,1",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  env.pop("SEXPGPU_STACKING", None)
  p = subprocess.run(sexpgpu_cmd("run", str(sx), "--set", "sharding=fsdp", "--set",
                                 "microbatches=2", "--metrics", f"jsonl:{m}"), cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr
  losses = _losses(m)
  assert len(losses) == 12 and losses[-1] < losses[0] - 0.3, losses

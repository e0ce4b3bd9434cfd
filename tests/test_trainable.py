"""`:trainable`: only matching parameters get gradients and optimizer state, the others are
constants of the step, bitwise unchanged by training; a resume continues bitwise."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError

MODEL = """
(require std/lm)
(require std/llama)
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab 40 :width 32 :layers 2 :heads 4 :kv-heads 2 :hidden 64 :context 32))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
"""
RUN = ('(defrun :loss loss :data train :steps 4 :optimizer (adamw :lr 0.01 :weight-decay 0.1)'
       ' :precision f32 :seed 1{extra})')
HEAD = ' :trainable ["*/lm_head/w" "*/norm/scale"]'


def write(tmp, name, extra=HEAD):
  path = os.path.join(str(tmp), name)
  with open(path, "w") as f:
    f.write(MODEL + RUN.format(extra=extra))
  return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("trainable")
  return write(tmp, "head.sx"), write(tmp, "full.sx", ""), tmp


TRAINED = {"lm/llama/lm_head/w", "lm/llama/norm/scale"}


def _restore(path, step_dir):
  from sexpgpu.ckpt import restore_checkpoint
  st = sexpgpu.compile(path).init()
  abstract = jax.eval_shape(lambda: {"params": st.params, "opt": st.opt_state,
                                     "step": jnp.int32(0), "skipped": jnp.int32(0)})
  return restore_checkpoint(step_dir, abstract)[0]


@pytest.fixture(scope="module")
def runs(files):
  """Four steps straight; two steps, then a resume to four."""
  head, _, tmp = files
  exp = sexpgpu.compile(head)
  straight = exp.run(steps=4, checkpoint_dir=str(tmp / "a"))
  exp.run(steps=2, checkpoint_dir=str(tmp / "b"))
  resumed = exp.run(steps=4, checkpoint_dir=str(tmp / "b"), resume="latest")
  return (_restore(head, straight.checkpoint), _restore(head, resumed.checkpoint), straight,
          resumed.checkpoint)


def test_optimizer_state_holds_only_the_trained_parameters(files):
  head, full, _ = files
  st = sexpgpu.compile(head).init()
  adam = st.opt_state[-1][0]  # clip-free adamw: (scale_by_adam, decay, lr)'s adam state
  sizes = {k: v.size for k, v in adam.mu.items()}
  assert set(sizes) == TRAINED and set(adam.nu) == TRAINED
  assert sum(sizes.values()) == 32 * 40 + 32
  leaves = [x.size for x in jax.tree_util.tree_leaves(st.opt_state) if x.ndim]
  assert sum(leaves) == 2 * (32 * 40 + 32)
  whole = sexpgpu.compile(full).init()
  assert sum(x.size for x in jax.tree_util.tree_leaves(whole.opt_state) if x.ndim) == \
      2 * sum(v.size for v in whole.params.values())


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_frozen_parameters_are_bitwise_unchanged_and_trained_ones_move(files, runs):
  head = files[0]
  start = sexpgpu.compile(head).init().params
  end = runs[0]["params"]
  assert set(end) == set(start)
  for path, v in start.items():
    same = np.asarray(v).tobytes() == np.asarray(end[path]).tobytes()
    assert same == (path not in TRAINED), path
  assert int(runs[0]["step"]) == 4 and np.isfinite(runs[2].train_loss)


def test_resume_in_the_middle_is_bitwise(runs):
  a, b = runs[0], runs[1]
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def _flops(path):
  from sexpgpu.run.check import check
  text = check(path, what="plan")
  return float(re.search(r"cost\s+(\S+) flops", text).group(1))


def test_the_steps_compiled_flops_fall_against_full_training(files):
  head, full, _ = files
  frozen, whole = _flops(head), _flops(full)
  # no backward pass through the layers: the frozen step is the forward and the head's
  assert frozen < 0.6 * whole, (frozen, whole)


def test_check_print_params_marks_each_parameter(files):
  from sexpgpu.run.check import check
  text = check(files[0], what="params")
  lines = text.splitlines()
  assert lines[0].split()[-1] == "train"
  marks = {ln.split()[0]: ln.split()[-1] for ln in lines[1:] if ln.startswith("lm/")}
  assert {p for p, m in marks.items() if m == "trained"} == TRAINED
  assert sum(m == "frozen" for m in marks.values()) == len(marks) - 2
  assert "train: 2 of 12 parameters trained (1,312 of" in text
  assert "train" not in check(files[1], what="params").splitlines()[0].split()
  decay = {ln.split()[0]: ln.split()[-2] for ln in lines[1:] if ln.startswith("lm/")}
  assert decay["lm/llama/lm_head/w"] == "yes" and decay["lm/llama/norm/scale"] == "no"
  assert {decay[p] for p in decay if p not in TRAINED} == {"-"}  # no decay of a frozen one
  assert "reaches 1 of 12 parameters" in text


def test_the_plan_counts_gradients_of_the_trained_parameters_only(files):
  from sexpgpu.devices.memory import human
  from sexpgpu.run.check import check

  def parts(path):
    text = check(path, what="plan")
    return {k: re.search(rf"{k}\s+(\S+ \S+)", text).group(1)
            for k in ("parameters", "gradients and accumulators")}
  head, full = parts(files[0]), parts(files[1])
  assert head["gradients and accumulators"] == human(1312 * 4)  # the head's and the norm's
  assert full["gradients and accumulators"] == full["parameters"] == head["parameters"]


@pytest.mark.parametrize("extra,message,fix", [
    (' :trainable ["*/lm_hed/w"]', 'pattern "*/lm_hed/w" matches no parameter',
     "lm/llama/lm_head/w"),
    (' :trainable 3', ":trainable is", ":trainable ["),
    (' :trainable []', ":trainable is", ":trainable ["),
    (' :trainable ["*/lm_head/w" 2]', ":trainable is", ":trainable ["),
])
def test_a_bad_trainable_is_e_run_002_at_the_keyword(tmp_path, extra, message, fix):
  from sexpgpu.run.check import check
  path = write(tmp_path, "bad.sx", extra)
  with pytest.raises(SxError) as e:
    check(path, what="params")
  assert e.value.code == "E-RUN-002" and message in e.value.message
  assert fix in e.value.fix
  loc = e.value.location
  line = (MODEL + RUN.format(extra=extra)).splitlines()[loc.line - 1]
  assert line[loc.col - 1:].startswith(extra.split(" ", 2)[2][:1])


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_a_stacked_step_trains_the_same_parameters(files, monkeypatch, tmp_path):
  """Two microbatches one at a time (a gradient call each, then the update) against both in
  one call: the same losses, the frozen parameters still bitwise the initial ones."""
  head = files[0]
  exp = sexpgpu.compile(head, set={"microbatches": 2})
  losses = {}
  for stacking in ("2", "1"):
    monkeypatch.setenv("SEXPGPU_STACKING", stacking)
    m = tmp_path / f"{stacking}.jsonl"
    run = exp.run(steps=2, metrics=f"jsonl:{m}")
    losses[stacking] = [e["train/loss"] for e in map(json.loads, open(m)) if e["kind"] == "step"]
  np.testing.assert_allclose(losses["1"], losses["2"], rtol=0, atol=1e-6)
  start = exp.init().params
  for path, v in run.params.items():
    same = np.asarray(v).tobytes() == np.asarray(start[path]).tobytes()
    assert same == (path not in TRAINED), path


def test_a_resume_with_another_trainable_is_e_ckpt_002(runs, tmp_path):
  """The trained set is the trajectory and the optimizer state's tree: another one is another
  experiment, refused before anything is read into the state."""
  other = write(tmp_path, "head.sx", ' :trainable ["*/lm_head/w"]')
  with pytest.raises(SxError) as e:
    sexpgpu.compile(other).run(steps=5, resume=runs[3])
  assert e.value.code == "E-CKPT-002"

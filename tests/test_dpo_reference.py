"""DPO against `(reference X)`: the run's starting parameters held constant, not saved, read
again at a resume (E-REF-001 when they changed), learning a sorted preference in a run."""

import json
import os

import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError

VOCAB, N, SEQ = 12, 4, 9  # a prompt of N tokens from 2..11, the separator 1, a continuation

RUN = """(require std/nn)
(require std/lm)
(defloader train (pairs "pairs.jsonl" :seq %d :batch 16 :vocab %d))
(defn lm [tokens] (transformer-lm tokens :vocab %d :width 32 :layers 1 :heads 2))
(defn logps [tokens mask] (sequence-logps (lm (lm-inputs tokens)) tokens mask))
(defn loss [batch]
  ; one call of the model on the chosen rows then the rejected ones, as TRL's concatenated
  ; forward, and the same values as the run's starting parameters compute them
  (let [lp (logps (concat [(get batch :chosen) (get batch :rejected)] 0)
                  (concat [(get batch :chosen-mask) (get batch :rejected-mask)] 0))
        [c r] (split lp 2 0)
        [rc rr] (split (reference lp) 2 0)]
    (dpo-loss c r rc rr :beta 0.5)))
(defdiagnostic rewards/accuracy :every 1 :of (tap rewards/accuracy) :reduce mean)
(defdiagnostic rewards/margin :every 1 :of (tap rewards/margin) :reduce mean)
(defrun :loss loss :data train :steps 60 :optimizer (adamw :lr 3e-3 :weight-decay 0.0)
        :precision f32 :seed 3%s)
""" % (SEQ, VOCAB, VOCAB, "%s")


def _pairs(count, seed):
  """Prompts of N distinct tokens; chosen: sorted, rejected: another order of them."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    x = rng.choice(np.arange(2, VOCAB), N, replace=False)
    wrong = rng.permutation(x)
    while (wrong == np.sort(x)).all():
      wrong = rng.permutation(x)
    out.append({"prompt": x.tolist() + [1], "chosen": sorted(x.tolist()),
                "rejected": wrong.tolist()})
  return out


def _folder(tmp, extra=""):
  (tmp / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in _pairs(256, 0)))
  (tmp / "dpo.sx").write_text(RUN % extra)
  return str(tmp / "dpo.sx")


def _diags(path):
  out = {}
  for e in map(json.loads, open(path)):
    if e["kind"] == "diagnostic":
      out[(e["step"], e["name"])] = e["value"]
    elif e["kind"] == "step" and "train/loss" in e:
      out[(e["step"], "loss")] = e["train/loss"]
  return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """60 steps warm-started from a .safetensors of the model's declared draws, a checkpoint
  at step 30 and at the end."""
  from safetensors.numpy import save_file
  tmp = tmp_path_factory.mktemp("dpo-ref")
  path = _folder(tmp, ' :init-from "start.safetensors" :checkpoint-every 30')
  start = sexpgpu.compile_text(RUN % "", "cold.sx", base_dir=str(tmp)).init()
  start = {k: np.asarray(v) for k, v in start.params.items() if not k.startswith("reference/")}
  save_file(start, str(tmp / "start.safetensors"))
  exp = sexpgpu.compile(path, diagnostics="all")
  result = exp.run(metrics=f"jsonl:{tmp / 'm.jsonl'}", checkpoint_dir=str(tmp / "ck"))
  return tmp, exp, start, result, _diags(tmp / "m.jsonl")


def test_the_reference_is_a_frozen_copy_of_the_starting_parameters(trained):
  import jax
  _, exp, start, result, _ = trained
  assert {k for k in result.params if k.startswith("reference/")} == {
      "reference/" + k for k in start} and len(start) == 12
  for k, v in start.items():  # the starting values, never moved by training
    assert np.array_equal(np.asarray(result.params["reference/" + k]), v), k
    assert not np.array_equal(np.asarray(result.params[k]), v), k
  held = [jax.tree_util.keystr(k)
          for k, _ in jax.tree_util.tree_flatten_with_path(exp.init().opt_state)[0]]
  assert len(held) > 24 and not any("reference/" in k for k in held)  # no optimizer state


def test_a_dpo_run_learns_the_sorted_preference(trained):
  *_, diags = trained
  # step 1: the policy is the reference, every reward 0, no pair ranked right
  assert diags[(1, "rewards/accuracy")] == 0.0 and diags[(1, "rewards/margin")] == 0.0
  assert diags[(1, "loss")] == pytest.approx(np.log(2.0), abs=1e-6)
  last = [diags[(s, "rewards/accuracy")] for s in range(51, 61)]
  assert np.mean(last) > 0.9 and diags[(60, "rewards/margin")] > 0


@pytest.mark.slow  # two more runs on the module's: about 30 s on a loaded 2-core machine
def test_a_resume_reads_the_reference_again_and_continues_bitwise(trained):
  """The checkpoint holds the trained model and the reference's digest; a resume from its
  middle reads the .safetensors again and continues bitwise; a changed file is E-REF-001."""
  from safetensors.numpy import save_file
  from sexpgpu.ckpt import read_meta
  from sexpgpu.models.source import checkpoint_params
  tmp, exp, start, result, diags = trained
  (slug,) = os.listdir(tmp / "ck")
  step30 = os.path.join(str(tmp / "ck"), slug, "30")
  params, _ = checkpoint_params(step30)
  assert sorted(params) == sorted(start)  # no reference copy saved
  assert len(read_meta(step30)["reference_digest"]) == 64
  resumed = sexpgpu.compile(str(tmp / "dpo.sx"), diagnostics="all").run(
      metrics=f"jsonl:{tmp / 'r.jsonl'}", checkpoint_dir=str(tmp / "again"), resume=step30)
  again = _diags(tmp / "r.jsonl")
  assert min(s for s, _ in again) == 31 and again == {k: v for k, v in diags.items()
                                                      if k[0] > 30}
  for k, v in result.params.items():
    assert np.array_equal(np.asarray(v), np.asarray(resumed.params[k])), k
  save_file({k: v + np.float32(1e-3) if k.endswith("unembed") else v for k, v in start.items()},
            str(tmp / "start.safetensors"))
  with pytest.raises(SxError) as e:
    sexpgpu.compile(str(tmp / "dpo.sx"), diagnostics="all").run(
        checkpoint_dir=str(tmp / "again2"), resume=step30)
  assert e.value.code == "E-REF-001" and "start.safetensors" in e.value.message
  assert e.value.where.endswith("/30")
  assert sorted(checkpoint_params(step30)[0]) == sorted(start)  # nothing saved was touched
  assert not os.path.exists(tmp / "again2" / slug / "60")


@pytest.mark.parametrize("loss,code,found", [
    ("(reference 1.0)", "E-TYPE-001", "reference takes a tensor"),
    ("(reference (sum (get batch :chosen-mask)))", "E-ARG-001", "reads no parameter"),
    ("(reference (sum (get batch :chosen-mask)) 2)", "E-FORM-001", "one value, given 2"),
    ("(repeat 1 (fn [x] (reference x)) (sum (logps (get batch :chosen) "
     "(get batch :chosen-mask))))", "E-RUN-002", "inside a repeat body"),
])
def test_reference_misused_is_told_at_its_call(tmp_path, loss, code, found):
  text = RUN.replace("(defn loss [batch]", f"(defn loss [batch] {loss})\n(defn unused [batch]")
  (tmp_path / "pairs.jsonl").write_text(json.dumps(_pairs(1, 0)[0]) + "\n")
  with pytest.raises(SxError) as e:
    sexpgpu.compile_text((text % "").replace(":batch 16", ":batch 1"), "dpo.sx",
                         base_dir=str(tmp_path))
  assert e.value.code == code and found in e.value.message
  assert str(e.value.location).startswith("dpo.sx:6:")


def test_a_pass_metric_reads_only_the_references_the_loss_keeps(tmp_path):
  extra = "\n(defn other [batch] (reference (sum (lm (lm-inputs (get batch :chosen))))))"
  text = (RUN % "").replace("(defdiagnostic", extra + "\n(defpass p :data train :every 1 "
                            ":batches 1 :metrics [other])\n(defdiagnostic", 1)
  text = text.replace("(split (reference lp) 2 0)", "(split (* lp 0.0) 2 0)")
  (tmp_path / "pairs.jsonl").write_text(json.dumps(_pairs(1, 0)[0]) + "\n")
  with pytest.raises(SxError) as e:
    sexpgpu.compile_text(text.replace(":batch 16", ":batch 1"), "dpo.sx",
                         base_dir=str(tmp_path))
  assert e.value.code == "E-RUN-002" and "which the loss's references never read" in str(e.value)

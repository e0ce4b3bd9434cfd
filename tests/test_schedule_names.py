"""One name, one meaning: `rsqrt` is the op 1/√x and `warmup-rsqrt` the learning-rate
schedule; the schedule's old spelling `(rsqrt :peak P)` is still read as warmup-rsqrt, with
a FutureWarning that names the new spelling."""

import warnings

import jax
import numpy as np
import pytest

from sexpgpu.errors import SxError
from sexpgpu.front.experiment import evaluate
from sexpgpu.front.optimizers import SCHEDULES
from sexpgpu.front.values import Spec
from sexpgpu.lang.program import load_text
from sexpgpu.lang.select import select
from sexpgpu.lower.optim import schedule
from sexpgpu.tools import langdoc


def _lr(lr: str, extra: str = ""):
  """The :lr of an experiment whose optimizer is (adamw :lr LR), and the warnings it gave."""
  text = f"""
(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 1))
(defn loss [batch] (mean (get batch :tokens)))
{extra}
(defrun :loss loss :data train :steps 2 :optimizer (adamw :lr {lr}))
"""
  program = load_text(text, "names.sx")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exp = evaluate(program, select(program))
  return exp.optimizer.get("lr"), exp, [w for w in caught if w.category is FutureWarning]


def test_the_schedule_has_its_own_name():
  lr, _, said = _lr("(warmup-rsqrt :peak 0.01 :warmup 4)")
  assert (lr.kind, lr.name, lr.args) == ("schedule", "warmup-rsqrt",
                                         (("peak", 0.01), ("warmup", 4)))
  assert said == []


def test_the_old_spelling_reads_as_the_new_one_and_says_so():
  new, _, _ = _lr("(warmup-rsqrt :peak 0.01 :warmup 4)")
  old, _, said = _lr("(rsqrt :peak 0.01 :warmup 4)")
  assert (old.kind, old.name, old.args) == (new.kind, new.name, new.args)
  assert len(said) == 1
  text = str(said[0].message)
  assert text.startswith("names.sx:5:") and "(warmup-rsqrt :peak ...)" in text


def test_the_op_is_still_the_op():
  _, exp, said = _lr("1e-3", "(def r (rsqrt 4.0))")
  assert exp.env.vars["r"] == 0.5 and said == []


def test_the_old_spellings_errors_name_what_was_written():
  with pytest.raises(SxError) as e:
    _lr("(rsqrt :peak 0.01 :warmup 2.5)")
  assert e.value.code == "E-RUN-002"
  assert "rsqrt :warmup is the number 2.5" in e.value.message


def test_both_names_lower_to_one_schedule():
  steps = jax.numpy.arange(12)
  args = (("peak", 0.01), ("warmup", 4))
  new = schedule(Spec("schedule", "warmup-rsqrt", args), 12, None)
  old = schedule(Spec("schedule", "rsqrt", args), 12, None)
  assert np.asarray(new(steps)).tobytes() == np.asarray(old(steps)).tobytes()
  assert SCHEDULES["warmup-rsqrt"].written and not SCHEDULES["rsqrt"].written


def test_the_reference_lists_the_schedule_by_its_name():
  text = open(langdoc.DOC_PATH, encoding="utf-8").read()
  assert "| `warmup-rsqrt` | `(warmup-rsqrt :peak P ...)` |" in text
  assert "| `rsqrt` | `(rsqrt X)` | 1 / sqrt(x) |" in text

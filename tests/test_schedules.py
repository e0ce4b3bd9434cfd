"""Learning-rate schedules (issue 38): warmup-stable-decay's values at chosen steps, `:floor`
a fraction of the peak in every schedule and `:min-lr` its absolute alternative, and each
keyword's error."""

import jax
import numpy as np
import pytest

from sexpgpu.errors import SxError
from sexpgpu.front.values import Spec
from sexpgpu.lower.optim import make_optimizer, schedule
from sexpgpu.run.compile import compile_source

TEXT = """
(defloader train (markov :vocab 8 :seq 9 :batch 2 :seed 7))
(defn loss [batch] (let [t (get batch :tokens)
                         w (param w [8 8] :init (normal 0.1))]
  (mean (matmul (one-hot t 8) w))))
(defrun :loss loss :data train :steps 100 :precision f32 :seed 1
        :optimizer (adamw :lr SCHEDULE))
"""


def _lr(text_schedule, steps=100):
  """The schedule as the language builds it and the lowering makes it, at every step."""
  c = compile_source(TEXT.replace("SCHEDULE", text_schedule), "sched.sx")
  _, sched = make_optimizer(c.exp.optimizer, steps, c.stages[0].graph)
  return np.asarray(jax.jit(sched)(jax.numpy.arange(steps + 1)))


def _spec(name, **kw):
  return Spec("schedule", name, tuple(sorted((k.replace("_", "-"), v) for k, v in kw.items())))


def test_wsd_warms_up_holds_then_decays_linearly_over_the_last_fraction():
  lr = _lr("(warmup-stable-decay :peak 0.01 :warmup 10 :decay-fraction 0.2 :floor 0.1)")
  np.testing.assert_allclose(lr[[0, 5, 10]], [0.0, 0.005, 0.01], rtol=1e-6)
  assert np.all(lr[10:81] == np.float32(0.01))  # the stable plateau, steps 10..80
  # linear from 0.01 at step 80 to 0.001 at step 100: 0.01 - 0.009 × (s - 80) / 20
  np.testing.assert_allclose(lr[[85, 90, 100]], [0.01 - 0.009 / 4, 0.0055, 0.001], rtol=1e-5)
  assert np.all(np.diff(lr[80:]) < 0)


def test_wsd_defaults_decay_over_the_last_fifth_to_zero():
  lr = _lr("(warmup-stable-decay :peak 0.02)")
  assert lr[0] == lr[79] == lr[80] == np.float32(0.02) and lr[100] == 0.0
  np.testing.assert_allclose(lr[90], 0.01, rtol=1e-6)


def test_wsd_cosine_shape():
  """`:shape "cosine"`: a half cosine from :peak to the end over the decay, as written in the
  language and as the lowering makes it from the spec."""
  lr = np.asarray(schedule(_spec("warmup-stable-decay", peak=0.01, warmup=0,
                                 decay_fraction=0.5, min_lr=0.002, shape="cosine"), 40, None)(
                                     jax.numpy.arange(41)))
  written = _lr('(warmup-stable-decay :peak 0.01 :decay-fraction 0.5 :min-lr 0.002 '
                ':shape "cosine")', steps=40)
  np.testing.assert_allclose(written, lr, rtol=1e-6)  # (jitted against op by op)
  assert np.all(lr[:21] == np.float32(0.01))
  s = np.arange(20, 41)
  np.testing.assert_allclose(lr[20:], 0.002 + 0.008 * 0.5 * (1 + np.cos(np.pi * (s - 20) / 20)),
                             rtol=1e-5)


@pytest.mark.parametrize("name", ["warmup-cosine", "warmup-linear", "warmup-stable-decay"])
def test_floor_is_a_fraction_of_the_peak_and_min_lr_is_absolute(name):
  by_floor = _lr(f"({name} :peak 0.004 :warmup 5 :floor 0.25)")
  by_min = _lr(f"({name} :peak 0.004 :warmup 5 :min-lr 0.001)")
  np.testing.assert_allclose(by_floor[100], 0.001, rtol=1e-6)
  np.testing.assert_allclose(by_min, by_floor, rtol=1e-6)


def test_floor_and_min_lr_together_is_e_run_002_at_the_schedule():
  with pytest.raises(SxError) as e:
    _lr("(warmup-cosine :peak 0.004 :floor 0.1 :min-lr 6e-5)")
  assert e.value.code == "E-RUN-002"
  assert e.value.message == ("warmup-cosine has both :floor (0.1, a fraction of :peak) and "
                             ":min-lr (6e-05, absolute); they say the same thing two ways")
  assert e.value.fix == "keep one: :min-lr 6e-05, or :floor 0.015 (a fraction of :peak 0.004)"
  assert (e.value.location.file, e.value.location.line) == ("sched.sx", 7)


@pytest.mark.parametrize("schedule_text, message, fix", [
    ("(warmup-stable-decay :peak 0.01 :decay-fraction 0)",
     "warmup-stable-decay :decay-fraction is the number 0; it must be a number above 0 and at "
     "most 1", ":decay-fraction 0.2"),
    ("(warmup-stable-decay :peak 0.01 :decay-fraction 1.5)",
     "warmup-stable-decay :decay-fraction is the number 1.5; it must be a number above 0 and "
     "at most 1", ":decay-fraction 0.2"),
    ('(warmup-stable-decay :peak 0.01 :decay-fraction "last")',
     'warmup-stable-decay :decay-fraction is the string "last"; it must be a number above 0 '
     "and at most 1", ":decay-fraction 0.2"),
    ("(warmup-cosine :peak 0.01 :min-lr -1)",
     "warmup-cosine :min-lr is the number -1; it must be a number from 0 to 3.4e38 "
     "(float32's largest)", ":min-lr 6e-5"),
    ("(warmup-linear :peak 0.01 :floor 6)",
     "warmup-linear :floor is the number 6; it must be a number from 0 to 1", ":floor 0.1"),
    ('(warmup-stable-decay :peak 0.01 :shape "cosin")',
     'warmup-stable-decay :shape is the string "cosin"; it is one of "linear" "cosine"',
     'did you mean `"cosine"` or `"linear"`? :shape "cosine"'),
    ("(warmup-stable-decay :peak 0.01 :shape 1)",
     'warmup-stable-decay :shape is the number 1; it is one of "linear" "cosine"',
     ':shape "cosine"'),
])
def test_a_bad_value_is_e_run_002_with_an_example(schedule_text, message, fix):
  with pytest.raises(SxError) as e:
    _lr(schedule_text)
  assert (e.value.code, e.value.message, e.value.fix) == ("E-RUN-002", message, fix)
  assert e.value.location.line == 7


@pytest.mark.parametrize("schedule_text, code, message, fix", [
    ("(warmup-stable-decay :peak 0.01 :decay-fractoin 0.2)", "E-FORM-002",
     "warmup-stable-decay has no keyword :decay-fractoin",
     "did you mean `:decay-fraction`? warmup-stable-decay takes :peak :warmup :floor :min-lr "
     ":decay-fraction :shape :steps"),
    ("(warmup-stable-decy :peak 0.01)", "E-NAME-001", "`warmup-stable-decy` is not defined",
     "did you mean `warmup-stable-decay`"),
])
def test_an_unknown_name_gives_the_nearest(schedule_text, code, message, fix):
  with pytest.raises(SxError) as e:
    _lr(schedule_text)
  assert (e.value.code, e.value.message) == (code, message)
  assert e.value.fix.startswith(fix)

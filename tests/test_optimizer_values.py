"""Optimizer and schedule values out of range are E-RUN-002 placed at the value; values in
range reach optax as written (an integral float warmup an int)."""

from __future__ import annotations

import pytest

from sexpgpu.run.compile import compile_source
from test_std_namespace import CONFIGS, _compile_error, _config


@pytest.mark.parametrize("optimizer,message", [
    ("(adamw :lr (warmup-cosine :peak 0.01 :warmup -5))",
     "warmup-cosine :warmup is the number -5; it must be an integer from 0 to 2147483647"),
    ("(adamw :lr (warmup-linear :peak 0.01 :warmup -9223372036854775808))",
     "warmup-linear :warmup is the number -9223372036854775808; it must be an integer from 0 "
     "to 2147483647"),
    ("(adamw :lr (rsqrt :peak 0.01 :warmup 2.5))",
     "rsqrt :warmup is the number 2.5; it must be an integer from 0 to 2147483647"),
    ('(adamw :lr (warmup-cosine :peak "x"))',
     'warmup-cosine :peak is the string "x"; it must be a number from 0 to 3.4e38 '
     "(float32's largest)"),
    ("(adamw :lr (warmup-cosine :peak 0.01 :steps 0))",
     "warmup-cosine :steps is the number 0; it must be an integer from 1 to 2147483647"),
    ("(adamw :lr -1)", "adamw :lr is the number -1; it must be a number from 0 to 3.4e38 "
     "(float32's largest)"),
    ("(adamw :lr (constant -0.5))", "adamw :lr is the number -0.5; it must be a number from 0 "
     "to 3.4e38 (float32's largest)"),
    ("(adam :lr 0.01 :b1 1)", "adam :b1 is the number 1; it must be a number at least 0 and "
     "below 1"),
    ('(adamw :lr 0.01 :b2 "x")', 'adamw :b2 is the string "x"; it must be a number at least 0 '
     "and below 1"),
    ("(sgd :lr 0.01 :clip 0)", "sgd :clip is the number 0; it must be a number above 0 and at "
     "most 3.4e38 (float32's largest)"),
    ("(sgd :lr 0.01 :nesterov 1)", "sgd :nesterov is the number 1; it is true or false"),
    ("(adafactor :lr 0.01 :min-dim-size-to-factor 0)", "adafactor :min-dim-size-to-factor is "
     "the number 0; it must be an integer from 1 to 2147483647"),
])
def test_an_optimizer_value_out_of_range_is_e_run_002_at_the_value(optimizer, message):
  text = _config("tiny-lm.sx", "(adamw :lr lr :weight-decay 0.0)", optimizer)
  err = _compile_error(text)
  assert err.code == "E-RUN-002" and err.message == message
  assert err.location.line == 27 and err.location.file == "exp.sx"
  key = message.split(" :")[1].split(" ")[0]
  value_col = err.location.col - 1
  line = text.split("\n")[26]
  assert line[:value_col].rstrip().endswith(":" + key)


def test_optimizer_values_in_range_reach_optax_as_written():
  from sexpgpu.lower.optim import make_optimizer
  text = _config("tiny-lm.sx", "(adamw :lr lr :weight-decay 0.0)",
                 "(adamw :lr (warmup-cosine :peak 0.01 :warmup 4.0 :floor 0.1) :b1 0 :b2 0.5)")
  c = compile_source(text, "exp.sx", base_dir=CONFIGS)
  assert dict(c.exp.optimizer.get("lr").args)["warmup"] == 4
  assert type(dict(c.exp.optimizer.get("lr").args)["warmup"]) is int
  _, sched = make_optimizer(c.exp.optimizer, 20)
  assert [round(float(sched(i)), 6) for i in (0, 2, 4)] == [0.0, 0.005, 0.01]

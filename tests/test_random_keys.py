"""The keys random ops draw from: in a pass, a key fixed per batch (each run of the pass
draws the same values, its batches differ); in a train step, one per microbatch."""

import json

import jax
import numpy as np
import pytest

import sexpgpu
from sexpgpu.lower.init import init_params
from sexpgpu.lower.step import PassStep
from sexpgpu.run.compile import compile_source

SRC = """(defloader train (markov :vocab 8 :seq 4 :batch 2 :seed 1))
(defn loss [batch]
  (+ (sum (* (param w [3] :init ones) (random-normal [3])))
     (* 0.0 (tap draw (sum (random-normal [5]))))))
(defn drawn [batch] (sum (* (random-uniform [4]) (random-uniform [4]))))
(defpass eval :data train :every 1 :batches 2 :metrics [drawn])
(defdiagnostic hi :of (tap draw) :every 1 :reduce max)
(defdiagnostic lo :of (tap draw) :every 1 :reduce min)
(defrun :loss loss :data train :steps 2 :microbatches 2 :optimizer (sgd :lr 0.1) :seed 4)
"""


@pytest.fixture(scope="module")
def pass_values():
  c = compile_source(SRC, "keys.sx")
  step = PassStep(c.passes["eval"], "f32")
  params = init_params(0, c.params)
  batch = c.loaders["train"].batch(0)
  return [[float(step(params, batch, i)["drawn"]) for i in (0, 1)] for _ in range(2)]


def test_a_pass_draws_the_same_values_each_time_it_runs(pass_values):
  first, again = pass_values
  assert first == again


def test_two_batches_of_a_pass_draw_different_values(pass_values):
  # the same batch at index 0 and 1: only the key tells them apart
  first, _ = pass_values
  assert first[0] != first[1]


def test_two_microbatches_of_a_train_step_draw_different_values(tmp_path):
  path = tmp_path / "keys.sx"
  path.write_text(SRC)
  m = tmp_path / "m.jsonl"
  sexpgpu.compile(str(path), diagnostics="all").run(metrics=f"jsonl:{m}")
  events = [json.loads(line) for line in m.read_text().splitlines()]
  by = {}
  for e in events:
    if e["kind"] == "diagnostic":
      by.setdefault(e["step"], {})[e["name"]] = e["value"]
  assert sorted(by) == [1, 2]
  for d in by.values():
    # the tapped draw of microbatch 0 and of 1, reduced by max and by min over the step:
    # equal only if both microbatches drew the same values
    assert d["hi"] > d["lo"], d
  # and the step folds in too: step 2's draws are not step 1's
  assert by[1] != by[2]

"""A failed allocation: released caches and one retry while the state is whole, else E-MEM-001."""

import json

import jax
import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.lower.step import TrainStep

TINY = f"{ROOT}/configs/tiny-lm.sx"


def _fail(monkeypatch, times):
  real = TrainStep.__call__
  left = {"n": times}

  def flaky(self, *args, **kw):
    if left["n"] > 0:
      left["n"] -= 1
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 1.00GiB")
    return real(self, *args, **kw)

  monkeypatch.setattr(TrainStep, "__call__", flaky)


@pytest.mark.slow  # a run whose allocation fails once, retried
def test_one_failed_allocation_is_retried(monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_STACKING", "2")  # no measurement at the first step
  _fail(monkeypatch, 1)
  m = tmp_path / "m.jsonl"
  s = sexpgpu.compile(TINY, variant="smoke").run(steps=3, metrics=f"jsonl:{m}")
  assert s.steps == 3
  notes = [e for e in map(json.loads, open(m)) if e["kind"] == "annotation"
           and e["name"] == "allocation failed"]
  assert len(notes) == 1 and notes[0]["retried"] and notes[0]["step"] == 1
  assert notes[0]["text"].startswith("memory: allocation failed at step 1 (RESOURCE_EXHAUSTED")


def test_a_second_failure_stops_with_e_mem_001_and_the_checkpoint_intact(monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_STACKING", "2")
  ck = tmp_path / "ck"
  exp = sexpgpu.compile(TINY, variant="smoke")
  first = exp.run(steps=2, checkpoint_dir=str(ck))
  _fail(monkeypatch, 2)
  with pytest.raises(sexpgpu.SxError) as e:
    sexpgpu.compile(TINY, variant="smoke").run(steps=4, checkpoint_dir=str(ck), resume="latest")
  assert e.value.code == "E-MEM-001" and "the last checkpoint is intact" in e.value.fix
  from sexpgpu.ckpt import CheckpointStore, read_meta
  latest = CheckpointStore(str(ck), "tiny-lm-smoke", 3).latest()
  assert latest == first.checkpoint and read_meta(latest)["step"] == 2


def test_a_degree_that_runs_out_of_memory_while_measured_is_not_chosen(monkeypatch, tmp_path):
  import sexpgpu.run.planning.plan as plan
  monkeypatch.setattr(plan, "predict", lambda *a, **k: 0.001)  # a tie: measure at step 1
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  real = TrainStep.__call__

  def degree_1_fails(self, *args, **kw):
    if self.stacking == 1:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    return real(self, *args, **kw)

  monkeypatch.setattr(TrainStep, "__call__", degree_1_fails)
  m = tmp_path / "m.jsonl"
  s = sexpgpu.compile(TINY, variant="smoke").run(steps=2, metrics=f"jsonl:{m}")
  assert s.steps == 2
  last = [e for e in map(json.loads, open(m)) if e["kind"] == "annotation"
          and e["name"] == "stacking"][-1]
  assert last["how"] == "measured" and last["degree"] == 2

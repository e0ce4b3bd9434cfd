"""Training numerics: stacking degrees agree, bf16 learns, :on-nan, the API."""

import json
import math
import os

import numpy as np
import pytest

import sexpgpu
from conftest import ROOT

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _losses(tmp_path, monkeypatch, capsys, name, *args, env=None):
  """Six steps of `sexpgpu run` in this process (the stacking is read from the environment
  at the run, as in a process of its own): each step's loss."""
  from sexpgpu.cli.main import main
  m = tmp_path / f"{name}.jsonl"
  with monkeypatch.context() as mp:
    for k, v in (env or {}).items():
      mp.setenv(k, v)
    code = main(["run", TINY, "--variant", "smoke", "--set", "microbatches=4", "--steps", "6",
                 "--metrics", f"jsonl:{m}", *args])
  err = capsys.readouterr().err
  assert code == 0, err
  return [json.loads(line)["train/loss"] for line in m.read_text().splitlines()
          if json.loads(line)["kind"] == "step"]


@pytest.mark.slow  # several runs compared
def test_stacking_1_2_and_k_agree(tmp_path, monkeypatch, capsys):
  runs = {s: _losses(tmp_path, monkeypatch, capsys, f"s{s}", env={"SEXPGPU_STACKING": str(s)})
          for s in (1, 2, 4)}
  for s in (1, 2):
    np.testing.assert_allclose(runs[s], runs[4], rtol=0, atol=1e-6)


def test_bad_stacking_variable_is_e_env_001(monkeypatch, capsys):
  from sexpgpu.cli.main import main
  monkeypatch.setenv("SEXPGPU_STACKING", "two")
  code = main(["run", TINY, "--steps", "1"])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-ENV-001]" in err and "SEXPGPU_STACKING" in err
  assert "Traceback" not in err


@pytest.mark.slow  # several runs compared
def test_bf16_runs_and_learns():
  exp = sexpgpu.compile(TINY, set={"precision": "bf16"})
  s = exp.run()
  assert s.eval["eval/loss"] < 0.8 * math.log(32)


@pytest.mark.slow  # a run to a NaN
def test_on_nan_stop_is_e_num_001(tmp_path, capsys):
  from sexpgpu.cli.main import main
  code = main(["run", TINY, "--variant", "smoke", "--set", "lr=1e30", "--steps", "5",
               "--checkpoint-dir", str(tmp_path)])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-NUM-001]" in err, err
  assert "Traceback" not in err


@pytest.mark.slow  # a run to a NaN
def test_on_nan_skip_counts_skipped_steps():
  exp = sexpgpu.compile(TINY, variant="smoke", set={"lr": 1e30, "on-nan": "skip"})
  s = exp.run(steps=4)
  assert s.counters.get("skipped-steps", 0) >= 1


def test_api_call_and_params():
  exp = sexpgpu.compile(TINY, variant="smoke")
  assert exp.knobs["layers"].value == 1 and exp.knobs["layers"].source == "variant"
  st = exp.init(seed=1)
  logits = exp.call("lm", st.params, np.zeros((2, 16), np.int32))
  assert logits.shape == (2, 16, 32)
  np.testing.assert_array_equal(np.asarray(logits), 0.0)  # zero-initialised unembedding
  assert "lm/transformer-lm/unembed" in exp.params
  with pytest.raises(sexpgpu.SxError) as e:
    sexpgpu.compile_text("(defrun :loss x", name="bad.sx")
  assert e.value.code == "E-READ-001" and e.value.location.line == 1

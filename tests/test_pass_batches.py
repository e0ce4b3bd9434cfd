"""A pass's :batches against its loader's split: past the split is E-LOAD-005 at :batches
(run and check), the whole split runs, past an int32 is refused where written; a long pass
prints its progress and a stop during it ends the pass without writing its numbers."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import sexpgpu
from sexpgpu.run import output, passes
from test_flag_values import _cli

_PASS_EXP = """(require std/nn)
(require std/lm)
(defloader train (markov :vocab 32 :seq 17 :batch 4 :seed 7))
(defloader valid VALID)
(defn lm [tokens] (transformer-lm tokens :vocab 32 :width 32 :layers 1 :heads 4))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defpass eval :data valid :every 2 :batches BATCHES :metrics [loss])
(defrun :loss loss :data train :steps 2 :microbatches 2 :optimizer (adamw :lr 0.01) :seed 1)
"""
_FILE_LOADER = '(tokens "t.bin" :dtype u16 :seq 17 :batch 4 :split [0.5 1.0])'
_MARKOV_LOADER = "(markov :vocab 32 :seq 17 :batch 4 :seed 7 :stream 1)"


def _pass_exp(tmp_path, batches, loader=_FILE_LOADER) -> str:
  """An experiment whose pass reads `batches` from `loader`; t.bin holds 1000 tokens, so the
  split [0.5 1.0] holds 29 windows of 17: 7 whole microbatches of 4."""
  (np.arange(1000) % 32).astype(np.uint16).tofile(tmp_path / "t.bin")
  p = tmp_path / "exp.sx"
  p.write_text(_PASS_EXP.replace("VALID", loader).replace("BATCHES", str(batches)))
  return str(p)


# --- a pass's :batches against its loader's split -------------------------------------------

def test_a_pass_past_its_loaders_split_is_e_load_005_at_its_batches(tmp_path, capsys):
  exp = _pass_exp(tmp_path, 100000000)
  ckpt = tmp_path / "ckpt"
  code, _, err = _cli(capsys, "run", exp, "--checkpoint-dir", str(ckpt))
  assert code == 1 and "error[E-LOAD-005]" in err
  assert "reads :batches 100000000 microbatches of 4 from loader `valid`" in err
  assert "whose split holds 29 records: 7 whole microbatches" in err
  assert f"--> {exp}:7:45" in err and f"= loader: {exp}:4:18" in err
  assert "= fix: :batches 7 reads the split of `valid` once" in err
  assert "step 0" not in err  # refused before anything was computed
  assert [p.name for p in ckpt.rglob("*") if p.is_file() or p.name.isdigit()] == []
  code, _, checked = _cli(capsys, "check", exp)  # check refuses what run would
  assert code == 1 and checked.splitlines()[:2] == err.splitlines()[:2]


def test_a_pass_of_its_whole_split_runs_and_one_more_is_refused(tmp_path):
  c = sexpgpu.compile(_pass_exp(tmp_path, 7))
  s = c.run(steps=2)
  assert s.steps == 2 and np.isfinite(s.eval["eval/loss"])
  with pytest.raises(sexpgpu.SxError) as e:
    sexpgpu.compile(_pass_exp(tmp_path, 8))
  assert e.value.code == "E-LOAD-005" and "7 whole microbatches" in e.value.message


def test_batches_past_an_int32_are_refused_where_they_are_written(tmp_path, capsys):
  exp = _pass_exp(tmp_path, 2**31, _MARKOV_LOADER)
  code, _, err = _cli(capsys, "check", exp)
  assert code == 1 and "error[E-TYPE-001]" in err and f"--> {exp}:7:45" in err
  assert ":batches 2147483648 is past the most a pass reads, 2147483647" in err
  assert "= fix: :batches from 1 to 2147483647, such as :batches 100" in err


def test_a_long_pass_on_an_endless_loader_says_how_far_it_is(tmp_path, capfd, monkeypatch):
  # every batch past the first is "long" here: a line after each but the last
  monkeypatch.setattr(passes, "PASS_PROGRESS_SECONDS", 0.0)
  s = sexpgpu.compile(_pass_exp(tmp_path, 5, _MARKOV_LOADER)).run(steps=2, quiet=False)
  err = capfd.readouterr().err
  lines = [ln for ln in err.splitlines() if ln.startswith("eval: batch ")]
  # two passes (step 0 and step 2), four lines each
  assert [ln.split(",")[0] for ln in lines] == [
      f"eval: batch {i}/5 at step {st}" for st in (0, 2) for i in range(1, 5)]
  assert all("batches/s, about " in ln and ln.endswith(" left") for ln in lines)
  assert s.steps == 2 and np.isfinite(s.eval["eval/loss"])


def test_a_stop_during_a_long_pass_ends_it_without_numbers(tmp_path, capfd, monkeypatch):
  monkeypatch.setattr(passes, "PASS_PROGRESS_SECONDS", 0.0)
  real = output.err
  sent = []

  def err_then_stop(line):
    real(line)
    if line.startswith("eval: batch 3/") and not sent:
      sent.append(line)
      os.kill(os.getpid(), signal.SIGINT)  # recorded by the run's handler

  monkeypatch.setattr(output, "err", err_then_stop)
  exp = _pass_exp(tmp_path, 100000000, _MARKOV_LOADER)
  s = sexpgpu.compile(exp).run(steps=2, quiet=False, checkpoint_dir=str(tmp_path / "ckpt"))
  err = capfd.readouterr().err
  assert sent and s.stopped_by == "SIGINT" and s.steps == 0
  assert ("eval: stopped by SIGINT after 3 of 100000000 batches at step 0; the pass's numbers "
          "are not written") in err
  assert "eval/loss" not in s.eval
  # the checkpoint says its step's passes were cut short: a resume runs them again (and
  # then the curriculum's decision), where a resume of a whole step skips them
  sent.clear()
  again = sexpgpu.compile(exp).run(steps=2, quiet=False, checkpoint_dir=str(tmp_path / "ckpt"),
                                   resume="latest")
  err = capfd.readouterr().err
  assert sent and again.stopped_by == "SIGINT" and again.steps == 0
  assert "eval: batch 1/100000000 at step 0" in err
  assert "eval: stopped by SIGINT after 3 of 100000000 batches at step 0" in err

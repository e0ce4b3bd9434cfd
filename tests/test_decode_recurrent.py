"""Recurrent decoding without a window: an LSTM and a gated linear recurrence written in
`.sx` (tests/sx/ok_lstm_lm.sx, ok_glr_lm.sx) decode 4× their training length one position a
step, keeping their state, with greedy tokens equal to a full forward over the same
positions; a GPT-2 with a learned position table refuses to pass it (E-SAMPLE-002) unless
`--window recompute` asks for the window to slide."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.lower.init import init_params
from sexpgpu.models import decode, forward, sample, source
from sexpgpu.run.compile import compile_file
from test_sample import SX as GPT2

TRAINED = 12  # the loaders' 13 tokens less the one the loss predicts
MODELS = {"lstm": ("ok_lstm_lm.sx", "lstm-lm"), "glr": ("ok_glr_lm.sx", "glr-lm")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def recurrent(request):
  name, fn = MODELS[request.param]
  c = compile_file(os.path.join(ROOT, "tests", "sx", name))
  params = {k: np.asarray(v + 0.3 * jax.random.normal(jax.random.key(i), v.shape))
            for i, (k, v) in enumerate(sorted(init_params(4, c.params).items()))}
  return request.param, c, fn, params


def test_a_recurrent_plan_has_nothing_that_bounds_its_length(recurrent):
  name, c, fn, _ = recurrent
  pl = decode.plan(source.logits_graph(c, fn, TRAINED), TRAINED)
  assert decode.limits(pl) == [] and pl.carries and not pl.attention and not pl.tables, name


def test_decodes_four_times_its_training_length_as_a_full_forward_does(recurrent):
  name, c, fn, params = recurrent
  prompt, n = [1, 2, 3], 4 * TRAINED
  got = sample.generate(c, fn, params, prompt, sample.Settings(tokens=n, temperature=0.0))
  assert (got.path, got.reason, len(got.ids)) == ("incremental", "", n), name
  seq = prompt + got.ids
  # the same positions recomputed at once, nothing cut: the greedy token at each
  full = forward.forward(c, fn, len(seq) - 1)
  logits = np.asarray(full(forward.device_params(c, params),
                           np.asarray([seq[:-1]], np.int32)))[0]
  assert [int(t) for t in logits.argmax(-1)[len(prompt) - 1:]] == got.ids, name
  assert len(set(got.ids)) > 2, (name, got.ids)  # not one token repeated
  # recomputing a window of the trained length cuts the context: the continuation differs
  cut = sample.generate(c, fn, params, prompt, sample.Settings(tokens=n, temperature=0.0),
                        path="recompute")
  assert cut.path == "recompute" and cut.ids[:TRAINED - 3] == got.ids[:TRAINED - 3], name


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
  from sexpgpu.models.export import write_step0
  tmp = tmp_path_factory.mktemp("gpt2")
  path = str(tmp / "g.sx")
  with open(path, "w") as f:
    f.write(GPT2)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(5, c.params).items()}
  return path, c, params, write_step0(c, params, str(tmp / "ck"))


def test_a_learned_position_table_refuses_to_pass_its_rows(gpt2):
  _, c, params, _ = gpt2
  with pytest.raises(SxError) as e:
    sample.generate(c, "lm", params, [3, 1, 4], sample.Settings(tokens=9, temperature=0.0))
  err = e.value
  assert err.code == "E-SAMPLE-002" and "`lm` decodes at most 8 positions" in err.message
  assert "the position table `lm/gpt2/wpe` (std/gpt2.sx:" in err.message
  assert "attention window of 8 positions" in err.message and "would need 11" in err.message
  assert "--tokens 6" in err.fix and "--window recompute" in err.fix
  # up to the table's end it decodes incrementally
  fits = sample.generate(c, "lm", params, [3, 1, 4], sample.Settings(tokens=6, temperature=0))
  assert fits.path == "incremental" and len(fits.ids) == 6


def test_window_recompute_keeps_the_sliding_window(gpt2, capsys):
  path, c, params, step_dir = gpt2
  args = ["sample", path, "--resume", step_dir, "--prompt", "3 1 4", "--tokens", "9",
          "--temperature", "0", "--json"]
  assert main(args) == 1
  err = capsys.readouterr().err
  assert "error[E-SAMPLE-002]" in err and "  --> --tokens\n" in err and "Traceback" not in err
  assert main(args + ["--window", "recompute"]) == 0
  out = json.loads(capsys.readouterr().out)
  slid = sample.generate(c, "lm", params, [3, 1, 4], sample.Settings(tokens=9, temperature=0),
                         path="recompute")
  assert out["path"] == "recompute" and out["ids"] == slid.ids and len(slid.ids) == 9
  assert main(args + ["--window", "slide"]) == 1  # recompute is the one choice
  assert "error[E-FORM-001]" in capsys.readouterr().err

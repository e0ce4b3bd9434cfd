"""Diagnostics: each kind sampled on its schedule; an unselected tap is absent from the graph."""

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sexpgpu
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.run.compile import compile_file

EXP = os.path.join(ROOT, "tests", "data", "diag.sx")


def test_unselected_tap_is_not_in_the_graph():
  plain = compile_file(EXP)
  assert "tap[" not in plain.ir_text()
  tapped = compile_file(EXP, diagnostics="act")
  assert "tap[name='hidden/act']" in tapped.ir_text()


def test_every_kind_is_sampled_on_its_schedule(tmp_path):
  m = tmp_path / "m.jsonl"
  p = subprocess.run(sexpgpu_cmd("run", EXP, "--diagnostics", "all", "--metrics", f"jsonl:{m}"),
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  assert "diagnostics gnorm,up-norm,ratio,act" in p.stderr.splitlines()[0]
  events = [json.loads(line) for line in m.read_text().splitlines()]
  diags = [e for e in events if e["kind"] == "diagnostic"]
  by = {}
  for e in diags:
    by.setdefault(e["name"], []).append(e["step"])
  assert by["gnorm"] == [2, 4, 6]
  assert by["up-norm"] == [1, 2, 3, 4, 5, 6]
  assert by["ratio"] == [3, 6]
  assert by["act"] == [1, 2, 3, 4, 5, 6]
  steps = {e["step"]: e for e in events if e["kind"] == "step"}
  for e in diags:
    assert np.isfinite(e["value"]) and e["value"] > 0
    if e["name"] == "gnorm":  # the whole model's gradient norm is the step's grad norm
      assert e["value"] == pytest.approx(steps[e["step"]]["train/grad-norm"], rel=1e-6)


def test_param_norm_matches_the_parameters():
  exp = sexpgpu.compile(EXP, diagnostics="up-norm")
  st = exp.init()
  expected = float(jnp.sqrt(jnp.sum(jnp.square(st.params["model/up/w"]))))
  m = "/tmp/diag-param-norm.jsonl"
  if os.path.exists(m):
    os.remove(m)
  exp.run(steps=1, metrics=f"jsonl:{m}")
  # param-norm is measured on the parameters the step starts from
  events = [json.loads(line) for line in open(m)]
  value = next(e["value"] for e in events if e["kind"] == "diagnostic")
  assert value == pytest.approx(expected, rel=1e-5)


def test_unknown_diagnostic_is_e_name_001(capsys):
  from sexpgpu.cli.main import main
  code = main(["run", EXP, "--diagnostics", "gnrom"])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-NAME-001]" in err and "gnorm" in err and "Traceback" not in err

"""`sexpgpu coord-check` (issue 38): μP's coordinate check on the numbers. One run of the
command (a one-layer transformer, widths 64 to 512, three steps of Adam, the file as written
and under μP) is shared by the tests; each layer's mean |activation| must be flat across the
widths under μP (within 1.5×) and grow under the standard parametrization."""

import contextlib
import io
import json
import os

import pytest

from sexpgpu.cli.main import main

WIDTHS = [64, 128, 256, 512]
STEPS = 3
SOURCE = """
(require std/nn)
(require std/lm)
(defknob width 64 "the model's width")
(defknob lr 0.01 "Adam's rate")
(defloader train (markov :vocab 32 :seq 9 :batch 2 :seed 7))
; heads of 16: the head size stays, so attention's 1/√d is the same at every width
(defn lm [tokens] (transformer-lm tokens :vocab 32 :width width :layers 1 :heads (/ width 16)))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 10 :optimizer (adam :lr lr) :seed 1)
"""


def _main(*args):
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(list(args))
  return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def source_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("coord") / "cc.sx"
  path.write_text(SOURCE)
  return path


@pytest.fixture(scope="module")
def ran(source_file):
  """The check at four widths, both parametrizations: eight compiles, about a minute on
  two busy cores (the tests that read it are marked slow)."""
  path = source_file
  png = path.parent / "coord.png"
  code, out, err = _main("coord-check", str(path), "--widths", ",".join(map(str, WIDTHS)),
                         "--steps", str(STEPS), "-o", str(png), "--json")
  assert code == 0, err
  return json.loads(out), png, path


def _spread(values):
  return max(values) / min(values)


@pytest.mark.slow
def test_json_shape(ran):
  result, _, _ = ran
  assert result["knob"] == "width" and result["widths"] == WIDTHS
  assert result["steps"] == STEPS and result["base_width"] == 64
  assert sorted(result["runs"]) == ["mup", "standard"]
  for layers in result["runs"].values():
    assert list(layers) == ["embedding", "block 1", "logits"]
    for per_width in layers.values():
      assert len(per_width) == len(WIDTHS) and all(len(v) == STEPS for v in per_width)


@pytest.mark.slow
def test_flat_under_mup(ran):
  result, _, _ = ran
  for layer, per_width in result["runs"]["mup"].items():
    for t in range(STEPS):
      values = [v[t] for v in per_width]
      if layer == "logits" and t == 0:  # a zero-initialized readout: 0 at every width
        assert values == [0.0] * len(WIDTHS)
        continue
      assert _spread(values) < 1.5, (layer, t, values)


@pytest.mark.slow
def test_growing_under_standard(ran):
  result, _, _ = ran
  last = STEPS - 1
  for layer in ("block 1", "logits"):
    values = [v[last] for v in result["runs"]["standard"][layer]]
    assert values[-1] > 2 * values[0], (layer, values)
    assert values == sorted(values), (layer, values)
  # at step 0 nothing has been trained: the two parametrizations agree at the base width
  for layer, per_width in result["runs"]["standard"].items():
    assert per_width[0][0] == pytest.approx(result["runs"]["mup"][layer][0][0], rel=1e-6)


@pytest.mark.slow
def test_png_written(ran):
  _, png, _ = ran
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(png) > 10_000


@pytest.mark.slow
def test_table_without_json(ran):
  """Without --json the command prints coordcheck.table: the last step at each width and
  each layer's spread across them."""
  from sexpgpu.tools.coordcheck import table
  result, _, _ = ran
  lines = table(result).splitlines()
  assert lines[0] == "standard: step 2, mean |activation| at width 64 128 256 512"
  assert len(lines) == 2 * (1 + 3) and lines[4].startswith("mup: step 2")
  spread = float(lines[6].rsplit("×", 1)[1].split()[0])
  assert spread < 1.5  # mup's block 1


@pytest.mark.parametrize("args,code,where,fix", [
    (["--knob", "widht"], "E-KNOB-001", "--knob", "`width`"),
    (["--widths", "64"], "E-KNOB-002", "--widths", "--widths 64,128,256,512"),
    (["--widths", "64,x"], "E-KNOB-002", "--widths", "--widths 64,128,256,512"),
    (["--parametrization", "mupp"], "E-FORM-001", "--parametrization", "`mup`"),
    (["--steps", "0"], "E-FORM-001", "--steps", "--steps 5"),
    (["-o", "/nonexistent-folder/c.png"], "E-METRICS-001", "-o", "create the folder first"),
    (["-o", "/"], "E-METRICS-001", "-o", "give -o a .png file path"),
])
def test_bad_flags(source_file, tmp_path, args, code, where, fix):
  path = source_file
  rc, out, err = _main("coord-check", str(path), "-o", str(tmp_path / "c.png"), *args)
  assert rc == 1 and out == "" and "Traceback" not in err
  assert f"error[{code}]" in err and where in err and fix in err
  assert not (tmp_path / "c.png").exists()


def test_no_width_knob(tmp_path):
  path = tmp_path / "nok.sx"
  path.write_text(SOURCE.replace('(defknob width 64 "the model\'s width")',
                                 '(defknob size 64 "the model\'s width")').replace(
                                     "width", "size").replace("the model's size", "w"))
  rc, out, err = _main("coord-check", str(path), "-o", str(tmp_path / "c.png"))
  assert rc == 1 and "error[E-KNOB-001]" in err and "--knob NAME (knobs: lr, size)" in err

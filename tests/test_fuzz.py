"""Fuzz of the front door: generated inputs end in an error code or a run.

The CI share: 1,500 inputs through `check`, 5 of them through `run --steps 1`, in this process
(about a minute); `python benchmarks/fuzz.py --count 10000` runs the larger count.
"""

import importlib.util
import os

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("fuzz", os.path.join(ROOT, "benchmarks",
                                                                     "fuzz.py"))
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


@pytest.mark.slow
def test_fuzz_check_and_run(tmp_path):
  count, findings = fuzz.fuzz(count=1500, runs=5, seed=16, folder=str(tmp_path))
  assert count == 1500
  assert not findings, "\n".join(findings)
  assert fuzz.OUTCOMES.get(("run", 0), 0) >= 1  # some runs really ran
  assert fuzz.OUTCOMES.get(("check", 0), 0) >= 50


def test_the_oracle_catches_an_escape(tmp_path, monkeypatch):
  """feed() reports an exception that is no SxError, and a traceback on standard error."""
  import sexpgpu.cli.main as cli

  def boom(argv):
    raise ZeroDivisionError("boom")
  monkeypatch.setitem(cli.COMMANDS, "check", boom)
  p = tmp_path / "a.sx"
  p.write_text("(defrun)")
  assert "ZeroDivisionError" in fuzz.feed(str(p), ["check", str(p)], {})


def test_generated_inputs_cover_the_kinds():
  import random
  rng = random.Random(0)
  seeds = {p: open(p, encoding="utf-8").read() for p in fuzz.SEEDS}
  inputs = [fuzz.generate(rng, seeds) for _ in range(400)]
  blobs = [d for d, _, _ in inputs]
  assert any(b.count(b"(") > 999 for b in blobs)  # deep nesting
  assert any(b"99999999999999999999" in b or b"1e400" in b for b in blobs)  # huge numbers
  assert any(not _utf8(b) for b in blobs)  # bad encodings
  assert any(f for _, f, _ in inputs) and any(e for _, _, e in inputs)  # flags, variables


def _utf8(b):
  try:
    b.decode("utf-8")
    return True
  except UnicodeDecodeError:
    return False


def test_the_seeds_are_every_sx_of_the_repository():
  import glob
  for pattern in ("configs/*.sx", "tests/sx/*.sx", "tests/data/*.sx"):
    for path in glob.glob(os.path.join(ROOT, pattern)):
      assert path in fuzz.SEEDS, path
  assert set(fuzz.RUN_SEEDS) <= set(fuzz.SEEDS)


def test_generated_inputs_reach_the_sizes_names_and_secrets():
  import random
  rng = random.Random(1)
  seeds = {p: open(p, encoding="utf-8").read() for p in fuzz.SEEDS}
  inputs = [fuzz.generate(rng, seeds) for _ in range(1500)]
  runs = [fuzz.generate(rng, seeds, light=True) for _ in range(300)]
  texts = [d for d, _, _ in inputs]
  flags = [" ".join(f) for _, f, _ in inputs + runs]
  envs = [e for _, _, e in inputs]
  assert any(fuzz.LONG.encode() in b for b in texts)  # past 4,300 digits in a file
  assert any(fuzz.LONG in f for f in flags)  # and in a flag
  assert any("2147483648" in f or "4294967296" in f for f in flags)
  assert any(e.get("SEXPGPU_RUN_SLUG") == ".." for e in envs)
  assert any(fuzz.SECRET in e.get("SEXPGPU_CACHE_DIR", "") for e in envs)
  assert any(fuzz.SECRET in f for f in flags)  # a credential in a location flag
  assert {v for e in envs for v in e} >= {"SEXPGPU_NODES", "SEXPGPU_CACHE_DIR",
                                          "SEXPGPU_STACKING", "SEXPGPU_RUN_SLUG"}


def test_the_oracle_catches_a_secret_in_the_output(tmp_path, monkeypatch):
  import sexpgpu.cli.main as cli

  def leak(argv):
    print(f"error[E-ENV-001]: s3://k:{fuzz.SECRET}@b", file=__import__("sys").stderr)
    return 1
  monkeypatch.setitem(cli.COMMANDS, "check", leak)
  p = tmp_path / "a.sx"
  p.write_text("(defrun)")
  assert "secret" in fuzz.feed(str(p), ["check", str(p)], {})


def test_every_damaged_checkpoint_file_is_skipped_by_name(tmp_path):
  cases, findings = fuzz.fuzz_checkpoints(str(tmp_path), restore=False)
  assert cases >= 40  # every file of a step folder, four ways
  assert not findings, "\n".join(findings)

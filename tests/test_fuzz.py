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
  count, findings = fuzz.fuzz(count=1000, runs=3, seed=16, folder=str(tmp_path))
  assert count == 1000
  assert not findings, "\n".join(findings)
  assert fuzz.OUTCOMES.get(("run", 0), 0) >= 1  # some runs really ran
  assert fuzz.OUTCOMES.get(("check", 0), 0) >= 25  # (33 at seed 16: a tenth are invalid edits)


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
  blobs = [d for d, _, _, _ in inputs]
  assert any(b.count(b"(") > 999 for b in blobs)  # deep nesting
  assert any(b"99999999999999999999" in b or b"1e400" in b for b in blobs)  # huge numbers
  assert any(not _utf8(b) for b in blobs)  # bad encodings
  assert any(f for _, f, _, _ in inputs) and any(e for _, _, e, _ in inputs)  # flags, variables
  assert any(bad for _, _, _, bad in inputs)  # values known to be invalid


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
  inputs = [fuzz.generate(rng, seeds) for _ in range(3000)]
  runs = [fuzz.generate(rng, seeds, light=True) for _ in range(300)]
  texts = [d for d, _, _, _ in inputs]
  flags = [" ".join(f) for _, f, _, _ in inputs + runs]
  envs = [e for _, _, e, _ in inputs]
  assert any(fuzz.LONG.encode() in b for b in texts)  # past 4,300 digits in a file
  assert any(fuzz.LONG in f for f in flags)  # and in a flag
  assert any("2147483648" in f or "4294967296" in f for f in flags)
  assert any(e.get("SEXPGPU_RUN_SLUG") == ".." for e in envs)
  assert any(fuzz.SECRET in e.get("SEXPGPU_CACHE_DIR", "") for e in envs)
  assert any(fuzz.SECRET in f for f in flags)  # a credential in a location flag
  assert {v for e in envs for v in e} == set(fuzz.VARIABLES)  # every variable
  assert any(b":warmup -5" in b for b in texts)  # an invalid value in an experiment
  assert any("--steps -h" in f or "--eval-every -h" in f for f in flags)  # a flag for a value


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


def test_the_oracle_catches_an_exit_0_on_an_invalid_value(tmp_path):
  p = tmp_path / "a.sx"
  p.write_text(open(os.path.join(ROOT, "tests", "sx", "ok_tiny.sx"), encoding="utf-8").read())
  assert fuzz.feed(str(p), ["check", str(p)], {}, []) is None
  found = fuzz.feed(str(p), ["check", str(p)], {}, ["--eval-every 0x10"])
  assert found == "exit 0 although the input holds an invalid value: --eval-every 0x10"
  assert fuzz._invalid_count("0x10") and fuzz._invalid_count("-h")
  assert fuzz._invalid_count("2147483648") and not fuzz._invalid_count("+12")


def test_an_input_replays_from_its_seed_and_index_alone():
  seeds = {p: open(p, encoding="utf-8").read() for p in fuzz.SEEDS}
  a = fuzz.generate(fuzz.case_rng(7, 123), seeds)
  fuzz.generate(fuzz.case_rng(7, 5), seeds)
  assert fuzz.generate(fuzz.case_rng(7, 123), seeds) == a


def test_the_supervisor_restarts_its_worker_past_an_input_that_hangs(tmp_path):
  """The worker stalls at both inputs (its `--stall`, a hang whatever the machine's speed):
  each is reported as a hang past the 1 s allowed, and a fresh worker takes the next input."""
  res = fuzz.supervise(count=2, runs=2, seed=3, folder=str(tmp_path), hang_s=1.0, stall=(0, 1))
  assert res["restarts"] == 2 and res["fed"] == 2
  assert [f.split(" (")[0] for f in res["findings"]] == ["input 0", "input 1"]
  assert all(f.endswith("hang past 1 s") for f in res["findings"])
  assert "--seed 3 --start 1 --count 2" in res["findings"][1]

"""benchmarks/bench_decode.py at the tiny shape: every leg runs and they choose the same tokens."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BENCH_XLA_FLAGS, ROOT

pytestmark = pytest.mark.slow  # a benchmark at its tiny shape, compiled as a user's run

BENCH = os.path.join(ROOT, "benchmarks", "bench_decode.py")


def test_bench_decode_tiny_smoke(tmp_path):
  out = tmp_path / "decode.json"
  r = subprocess.run([sys.executable, BENCH, "--shape", "tiny", "--tokens", "16", "--rounds", "1",
                      "--json", str(out)],
                     capture_output=True, text=True, cwd=ROOT, timeout=120,
                     env=dict(os.environ, XLA_FLAGS=BENCH_XLA_FLAGS))
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert "ratio decode incremental/hand " in r.stdout
  assert "ratio decode incremental/recompute " in r.stdout
  assert "tokens agree: all legs" in r.stdout
  res = json.loads(out.read_text())
  assert len(res["ids"]) == 16
  # generate's own tokens and every timed leg's, on every round, are the incremental leg's
  assert res["agree"] and all(res["agree"].values()), res["agree"]
  assert set(res["legs"]) >= {"incremental", "recompute", "hand"}
  for leg, x in res["legs"].items():
    assert x["tok_s"] > 0 and len(x["round_s"]) == 1, leg

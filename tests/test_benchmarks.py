"""benchmarks/: bench_train.py at a tiny shape (every leg runs and the legs agree), and
bench_fsdp_styles.py at a tiny one."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BENCH_XLA_FLAGS, ROOT

BENCH = os.path.join(ROOT, "benchmarks", "bench_train.py")


def _have_torch() -> bool:
  try:
    import torch  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.mark.slow
def test_bench_train_tiny_smoke(tmp_path):
  # CI has no torch
  legs = "sexpgpu,jax,jax-kept,jax-bare" + (",torch,torch-bare" if _have_torch() else "")
  out = tmp_path / "bench.json"
  r = subprocess.run([sys.executable, BENCH, "--shape", "tiny", "--steps", "3", "--warmup", "1",
                      "--rounds", "1", "--legs", legs, "--json", str(out)],
                     capture_output=True, text=True, cwd=ROOT, timeout=600,
                     env=dict(os.environ, XLA_FLAGS=BENCH_XLA_FLAGS))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "ratio tiny sexpgpu/jax: loop " in r.stdout
  assert "ratio tiny sexpgpu/jax-bare: loop " in r.stdout
  if "torch" in legs:
    assert "ratio tiny sexpgpu/torch: loop " in r.stdout
  res = json.loads(out.read_text())[0]
  assert set(res["legs"]) == set(legs.split(","))
  ref = res["legs"]["sexpgpu"]["loss"]
  assert len(ref) == 4
  # identical init and data: the legs' losses agree (step 1 is log V: the unembed starts at 0)
  for leg, x in res["legs"].items():
    assert x["loss"][:3] == pytest.approx(ref[:3], abs=1e-4), leg
    assert x["tok_s"] > 0 and x["first_s"] > 0 and x["rss_mib"] > 0


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_bench_fsdp_styles_smoke():
  """The two ways to write an FSDP step compute the same parameters (the ratio it prints
  is what lower/fsdp.py's choice cites)."""
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_fsdp_styles.py"),
                      "--devices", "2", "--width", "64", "--layers", "2", "--batch", "16",
                      "--steps", "2", "--rounds", "1"],
                     capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  line = r.stdout.strip().splitlines()[-1]
  assert line.startswith("ratio shard_map/jit over 2 host devices"), r.stdout
  assert float(line.rsplit("|difference| ", 1)[1]) < 1e-5, line

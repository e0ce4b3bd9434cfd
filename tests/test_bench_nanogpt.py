"""What benchmarks/bench_nanogpt.py compares, held without timing: the twin and
configs/shakespeare-char.sx hold the same parameters, how many executables a run of the
config builds, and that its train step sums no gradient columns in XLA's windows."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, RUN_CPU_OPTIONS, sexpgpu_cmd

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

CONFIG = os.path.join(ROOT, "configs", "shakespeare-char.sx")
# What a run of the config builds on empty caches, counted from its `timing kernels` line
# (compiled + cache hits), measured: the train step, the pass's metrics, the initial state
# (parameters, optimizer state and counters in one: 2 before), the CPU peak's matmul probe
# (1: its input put, not made with a convert and a broadcast; a later run reads its rate from
# the cache folder and builds none), and the pass's sum (an `add`, after step 0). 18 before
# the init's buffers and the counters' converts were folded away, then 8.
EXECUTABLES = 5


@pytest.fixture(scope="module")
def text(tmp_path_factory):
  """A small text of 40 distinct characters (fewer than the config's vocab 78 - 1)."""
  path = tmp_path_factory.mktemp("nanogpt") / "input.txt"
  lines = [f"{'abcdefghijklmnopqrstuvwxyz'[i % 26] * (i % 7 + 1)} THE KING {i % 10}.\n"
           for i in range(600)]
  path.write_text("".join(lines))
  return str(path)


def test_the_twin_and_the_experiment_hold_the_same_parameters(text):
  from sexpgpu.run.compile import compile_file
  import nanogpt_twin
  c = compile_file(CONFIG, sets=[("text", text), ("eval-batches", "1")])
  ours = 0
  for p in c.params.values():
    n = 1
    for d in p.full_shape:
      n *= int(d)
    ours += n
  knobs = {k: v.value for k, v in c.selection.knobs.items()}
  twin = nanogpt_twin.parameter_count(int(knobs["vocab"]), block=int(knobs["block-size"]),
                                      layers=int(knobs["layers"]), heads=int(knobs["heads"]),
                                      width=int(knobs["width"]), bias=True)
  assert ours == twin == 811_520


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_a_run_builds_the_executables_measured(text, tmp_path):
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
             SEXPGPU_CACHE_DIR=str(tmp_path / "sx"))
  r = subprocess.run(sexpgpu_cmd("run", CONFIG, "--variant", "smoke", "--set", f"text={text}",
                                 "--steps", "2"),
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert r.returncode == 0, r.stderr
  m = re.search(r"^timing kernels (\d+) compiled in [\d.]+s, (\d+) cache hits$", r.stderr, re.M)
  assert m, r.stderr
  assert int(m.group(1)) + int(m.group(2)) == EXECUTABLES
  assert int(m.group(2)) == 0  # an empty cache: every one compiled once


def test_the_text_reaches_the_config_as_an_absolute_path(tmp_path, monkeypatch):
  # the config reads `text` beside itself: a relative --data must not be passed on as is
  import bench_nanogpt
  (tmp_path / "prepared").mkdir()
  (tmp_path / "prepared" / "input.txt").write_text("abc\n")
  monkeypatch.chdir(tmp_path)
  got = bench_nanogpt.prepare("prepared")
  assert got == str(tmp_path / "prepared" / "input.txt")


def test_without_the_sexpgpu_script_the_legs_run_the_module(monkeypatch):
  # `python -m sexpgpu` has no __main__: the fallback must be a command that runs
  import bench_nanogpt
  monkeypatch.setattr(bench_nanogpt.shutil, "which", lambda *a, **k: None)
  cmd = bench_nanogpt._sexpgpu_bin()
  assert cmd[:1] == [sys.executable]
  r = subprocess.run(cmd + ["--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert r.returncode == 0 and "run" in r.stdout + r.stderr


def test_the_header_names_the_processor_and_its_vector_units(tmp_path):
  # the step's ratio to the twin depends on them (AVX-512: torch's products run faster)
  import bench_nanogpt
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_tile\n"
                  "\nprocessor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_tile\n")
  assert bench_nanogpt.processor(str(info)) == "Some Xeon (AVX2, AVX-512, AMX)"
  info.write_text("model name\t: Old Core\nflags\t\t: fpu sse2\n")
  assert bench_nanogpt.processor(str(info)) == "Old Core (no AVX2)"
  assert bench_nanogpt.processor(str(tmp_path / "absent")) == ""
  info.write_bytes(b"\xff\xfe\x00model name\n")  # not text, no value: nothing to name
  assert bench_nanogpt.processor(str(info)) == ""


def test_the_warm_caches_are_filled_with_the_legs_own_step_count(monkeypatch):
  # the legs' own run fills them: when `--steps N` was a constant of the compiled step a
  # one-step run filled them with another step, which round 1's warm leg then compiled
  import bench_nanogpt
  calls = []

  def leg(text, iters, caches, config=bench_nanogpt.CONFIG):
    calls.append((iters, caches))
    return {"periods": [0.04], "startup_s": 1.0, "rss_mib": 1.0, "val_loss": 2.0,
            "wall_s": 1.0, "kernels": "timing kernels 0 compiled", "steps": iters}

  monkeypatch.setattr(bench_nanogpt, "leg_sexpgpu", leg)
  bench_nanogpt.run_rounds("input.txt", 2, 300, ["sexpgpu", "cold"], 78, log=lambda *a: None)
  warm = [c for c in calls if "warm" in os.path.basename(c[1])]
  assert [n for n, _ in warm] == [300, 300, 300]  # the filling run, then each round's leg
  assert len({d for _, d in warm}) == 1
  assert sorted(n for n, d in calls if "cold" in os.path.basename(d)) == [1, 1]


def _column_sums(hlo: str) -> list[str]:
  """The reduce-windows of a compiled program that sum along leading axes and keep the last
  (a column sum such as a bias gradient's: window 12x32x1 over [12, 64, 512])."""
  out = []
  for m in re.finditer(r"reduce-window\([^)]*\), window=\{size=([\dx]+)", hlo):
    size = [int(s) for s in m.group(1).split("x")]
    if len(size) > 1 and size[-1] == 1 and max(size[:-1]) > 1:
      out.append(m.group(0))
  return out


@pytest.mark.slow  # compiles a train step
def test_the_train_step_sums_no_gradient_columns_in_windows(text, monkeypatch):
  # XLA's CPU backend runs a column sum over more than 32 rows as a strided windowed
  # reduction (14% of this recipe's step); lower/broadcast.py takes them as ones · G
  import dataclasses
  import jax
  from sexpgpu.lower import broadcast
  from sexpgpu.lower.init import init_params
  from sexpgpu.lower.step import init_state
  from sexpgpu.run import training
  from sexpgpu.run.compile import compile_file
  c = compile_file(CONFIG, sets=[("text", text)], variant="smoke")

  def step_hlo():
    tr = training.build(c)
    step = dataclasses.replace(tr.step(0, tr.k), platform="cpu")
    opt, _ = tr.optimizer(0)
    state = jax.eval_shape(lambda: init_state(init_params(tr.seed, c.params), opt))
    batches = tr.abstract_batches("train", (tr.k,))
    return step.lowered(state, batches).compile(RUN_CPU_OPTIONS).as_text()
  assert _column_sums(step_hlo()) == []
  monkeypatch.setattr(broadcast, "MIN_ROWS", 2**31)  # the plain rule: the test can fail
  assert _column_sums(step_hlo())  # the layernorms' and the biases' gradients

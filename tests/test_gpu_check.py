"""benchmarks/gpu_check.sh before it meets a GPU: its time limits fit the 10 minutes it
promises, it refuses arguments it does not take, on a machine without the CUDA plugin it
stops at once with a FAIL line and its fix, and its dry mode runs end to end on the CPU and
writes the report in its format."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def _script() -> str:
  with open(SCRIPT, encoding="utf-8") as f:
    return f.read()


def test_the_time_limits_sum_under_ten_minutes_and_the_header_says_so():
  text = _script()
  limits = [int(n) for n in re.findall(r"\$\(lim (\d+)\)", text)]
  runs = [int(n) for n in re.findall(r'^run_one "[^"]+" (\d+) ', text, re.M)]
  assert len(limits) == 6 and len(runs) == 4  # setup, doctor, lowering, the resume's 3; 4 runs
  total = sum(limits) + sum(runs)
  assert total < 600
  assert f"= {total} s, under the 10 minutes" in text
  # the install, when the extra is missing, is bounded apart and stated in the header
  assert re.findall(r"\btimeout (\d+) \"\$PY\" -m pip", text) == ["120"]
  assert "adds at most 120 s" in text
  with open(os.path.join(ROOT, "benchmarks", "README.md"), encoding="utf-8") as f:
    readme = f.read()
  assert "gpu_check.sh" in readme and "about 7 minutes" in readme and f"sum to {total} s" in readme


@pytest.mark.parametrize("args,env,says", [
    (["--bogus"], {}, "unknown flag --bogus"),
    (["--gpu", "A100"], {}, "--gpu A100: this check is sized for one H100 or H200"),
    (["--steps", "0"], {}, "--steps 0: a whole number above 0"),
    (["--steps"], {}, "usage: benchmarks/gpu_check.sh"),
    (["a", "b"], {}, "usage: benchmarks/gpu_check.sh"),
    ([], {"GPU_CHECK_DRY": "yes"}, "GPU_CHECK_DRY=yes: 0 or 1"),
])
def test_arguments_it_does_not_take_exit_2_before_anything_runs(tmp_path, args, env, says):
  p = subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True,
                     env=dict(os.environ, PYTHON=sys.executable, **env), timeout=60)
  assert p.returncode == 2 and says in p.stderr and p.stdout == ""
  assert os.listdir(tmp_path) == []  # no report folder made


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_without_the_cuda_plugin_it_stops_at_once(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_INSTALL="0")
  env.pop("GPU_CHECK_DRY", None)
  p = subprocess.run(["bash", SCRIPT, "--gpu", "h200", str(tmp_path / "out")], cwd=tmp_path,
                     env=env, capture_output=True, text=True, timeout=120)
  assert p.returncode == 1
  lines = p.stdout.splitlines()
  assert lines[0] == "# sexpgpu gpu_check report (format 1)"
  assert re.fullmatch(r"mode: gpu, target H200, device cuda, 30 steps a run, \S+Z", lines[1])
  assert lines[2:] == [
      f"FAIL setup: {sys.executable} has sexpgpu but not the CUDA plugin — fix: "
      f"{sys.executable} -m pip install -e '.[cuda]' (GPU_CHECK_INSTALL=0 stopped the install)"]
  assert sorted(os.listdir(tmp_path / "out")) == ["report.txt", "setup.err"]
  with open(tmp_path / "out" / "report.txt") as f:
    assert f.read().splitlines() == lines


# the report's lines, in order, each kind by its format
REPORT = [
    r"# sexpgpu gpu_check report \(format 1\)",
    r"mode: dry, target H100, device cpu, 2 steps a run, \S+Z",
    r"PASS setup: .+ \(dry: on the CPU\)",
    r"PASS doctor: \d+ ok, \d+ warn \(--device cpu\)",
    r"LOWERING gpt2-small bf16",
    r"PLAN gpt2-small bf16: step [\d.]+ ms, [\d,]+ tokens/s, MFU \d+%, memory [\d.]+ [KMG]iB",
    r"LOWERING gpt2-small fp8",
    r"PLAN gpt2-small fp8: step .+",
    r"PLAN llama-1b bf16: step .+",
    r"PLAN llama-1b fp8: step .+",
    r"PASS lowering: the attention kernel and the fp8 products reported",
] + [rf"PASS run {name}: 2 steps, \d+ tokens/s, MFU [\d.]+%, step [\d.]+ ms \(plan [\d.]+ ms, "
     rf"measured/plan [\d.]+\), peak - of [\d.]+ GiB planned, attention XLA attention, loss "
     rf"[\d.]+, \d+ s wall"
     for name in ("gpt2-small bf16", "gpt2-small fp8", "llama-1b bf16", "llama-1b fp8")] + [
    r"PASS resume: (killed \(SIGKILL\) at its step-\d+ checkpoint|finished before the kill "
    r"landed \(resumed from its step-\d+ checkpoint\)); steps \d+\.\.8 bitwise equal to the "
    r"straight run's",
    r"total: \d+ s",
]


@pytest.mark.slow  # seven short CPU runs of one-layer stand-ins, four paper plans: ~2 min loaded
@pytest.mark.timeout(1800)
def test_the_dry_mode_runs_end_to_end_and_writes_the_report(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable, SEXPGPU_DEBUG="")
  p = subprocess.run(["bash", SCRIPT, "--dry", "--steps", "2", str(tmp_path / "out")],
                     cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
  with open(tmp_path / "out" / "report.txt") as f:
    lines = [ln for ln in f.read().splitlines() if not ln.startswith("  ")]  # reports indented
  assert len(lines) == len(REPORT), lines
  for line, pattern in zip(lines, REPORT):
    assert re.fullmatch(pattern, line), (line, pattern)
  with open(tmp_path / "out" / "report.txt") as f:
    text = f.read()
  # the lowering report names the attention kernel and the float8 products under it
  assert "→ cudnn (causal)" in text and "products traced in float8" in text

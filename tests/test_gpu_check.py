"""benchmarks/gpu_check.sh before it meets a GPU: its time limits fit the 10 minutes it
promises, and on a machine without the CUDA plugin it stops at once with a FAIL line and its
fix, spending no device time on runs that cannot start."""

import os
import re
import subprocess
import sys

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def test_the_time_limits_of_one_card_sum_under_ten_minutes():
  with open(SCRIPT, encoding="utf-8") as f:
    text = f.read()
  one_card = text.split('if [ "$NDEV" -ge 2 ]; then', 1)
  assert len(one_card) == 2  # the fsdp runs are the second card's, after this line
  # the install branch (GPU_CHECK_INSTALL=1) runs outside the check's time
  before, install = one_card[0].split('if [ "$rc" != 0 ] && [ "${GPU_CHECK_INSTALL:-0}" = 1 ]')
  install, before_rest = install.split("\nfi\n", 1)
  assert re.findall(r"\btimeout (\d+)", install) == ["300", "15"]  # pip, then the setup again
  after = one_card[1].split('say "WARN fsdp:', 1)[1]
  limits = [int(n) for part in (before, before_rest, after)
            for n in re.findall(r"\btimeout (\d+)", part)]
  assert sum(limits) < 600
  assert f"= {sum(limits)} s" in text  # the header says the same sum


def test_without_the_cuda_plugin_it_stops_at_once(tmp_path):
  env = dict(os.environ, PYTHON=sys.executable)
  env.pop("GPU_CHECK_INSTALL", None)
  p = subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=120)
  assert p.returncode == 1
  assert p.stdout.splitlines() == [
      f"FAIL setup: {sys.executable} has sexpgpu but not the CUDA plugin — fix: "
      f"{sys.executable} -m pip install -e '.[cuda]' (or GPU_CHECK_INSTALL=1)"]
  assert sorted(os.listdir(tmp_path / "out")) == ["setup.err", "summary.txt"]

"""README's example run is every line the first command's run prints, as it prints them.

The counters and line shapes must be equal, and the losses equal to a machine's rounding
(README's digits were printed on one processor; a CI run on an AVX-512 Xeon printed
2.05084 for its 2.05083); what a machine's speed and caches decide (seconds, executables
compiled against cache hits) is compared as a pattern.
"""

import math
import os
import re
import subprocess

import pytest

from conftest import BENCH_XLA_FLAGS, ROOT, sexpgpu_cmd

# the parts of a line that depend on the machine: seconds, and the timing lines' counts
_MACHINE = [re.compile(r"\d+\.\d+s\b"), re.compile(r"\b\d+ compiled\b"),
            re.compile(r"\b\d+ cache hits?\b"), re.compile(r"median \S+ p90 \S+")]


# a number with a fraction that is not a machine's (a loss, a metric)
_FRACTION = re.compile(r"(?<![\w.])-?\d+\.\d+(?![\w.])")
# how far two machines' losses part after README's 20 steps: 1e-5 seen, so 10x that
LOSS_RTOL = 1e-4


def _shape(line: str) -> str:
  for pattern in _MACHINE:
    line = pattern.sub("<machine>", line)
  return line


def _same_run(printed: list[str], shown: list[str]) -> list[str]:
  """Where the printed lines differ from the shown ones beyond a machine's rounding."""
  if len(printed) != len(shown):
    return [f"{len(printed)} lines printed, {len(shown)} shown"]
  out = []
  for got, want in zip(map(_shape, printed), map(_shape, shown)):
    got_numbers = [float(x) for x in _FRACTION.findall(got)]
    want_numbers = [float(x) for x in _FRACTION.findall(want)]
    if (_FRACTION.sub("<f>", got) != _FRACTION.sub("<f>", want)
        or not all(math.isclose(a, b, rel_tol=LOSS_RTOL)
                   for a, b in zip(got_numbers, want_numbers))):
      out.append(f"printed {got!r}, shown {want!r}")
  return out


def _readme_run() -> tuple[str, list[str]]:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  block = text[text.index("## A run"):]
  block = block[block.index("```\n") + 4:]
  lines = block[:block.index("```")].splitlines()
  assert lines[0].startswith("$ ")
  return lines[0][2:], lines[1:]


@pytest.mark.slow  # README's run compiled as a user's, without the suite's fast-compile flag
def test_readmes_run_is_what_the_run_prints():
  command, shown = _readme_run()
  assert command == "sexpgpu run configs/tiny-lm.sx"  # README's first command's run
  # as a user runs it: XLA's own optimization (the suite turns it off for speed), whose
  # rounding the last printed digit can see
  env = {**os.environ, "XLA_FLAGS": BENCH_XLA_FLAGS}
  r = subprocess.run(sexpgpu_cmd(*command.split()[1:]), cwd=ROOT, capture_output=True,
                     text=True, timeout=300, env=env)
  assert r.returncode == 0, r.stderr
  assert r.stdout == ""  # every line of a run without --json is on standard error
  printed = r.stderr.splitlines()
  assert _same_run(printed, shown) == []


def test_the_machine_patterns_keep_what_must_be_equal():
  assert _shape("step 10/20 loss 2.90611 | eval/loss 3.01543 | 80 records | 0.2s") == \
      "step 10/20 loss 2.90611 | eval/loss 3.01543 | 80 records | <machine>"
  assert _shape("timing kernels 0 compiled in 0.764s, 18 cache hits") == \
      "timing kernels <machine> in <machine>, <machine>"
  assert _shape("done: 20 steps, train/loss 2.0508") == "done: 20 steps, train/loss 2.0508"


def test_a_run_is_the_shown_one_to_a_machines_rounding_and_no_further():
  shown = ["step 20/20 loss 2.05083 | eval/loss 2.33686 | 160 records | 0.3s",
           "done: 20 steps, train/loss 2.0508"]
  assert _same_run(["step 20/20 loss 2.05084 | eval/loss 2.33685 | 160 records | 0.2s",
                    "done: 20 steps, train/loss 2.0508"], shown) == []
  assert _same_run(["step 20/20 loss 2.05214 | eval/loss 2.33685 | 160 records | 0.2s",
                    "done: 20 steps, train/loss 2.0508"], shown)  # a loss 6e-4 apart
  assert _same_run(["step 20/20 loss 2.05083 | eval/loss 2.33686 | 161 records | 0.3s",
                    "done: 20 steps, train/loss 2.0508"], shown)  # a counter
  assert _same_run(["step 20/20 loss 2.05083 | eval/loss 2.33686 | 160 records | 0.3s"],
                   shown)  # a line missing

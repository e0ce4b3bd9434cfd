"""Planning with :sharding auto: no layout because the microbatches do not divide over the
ranks is E-DP-003 (with a fix that plans), not E-MEM-001; a model too big for any layout is
still E-MEM-001."""

from __future__ import annotations

import os

from conftest import ROOT
from test_flag_values import TINY, _cli


# --- planning: a layout refused for its microbatches is not one that does not fit -----------

def test_no_layout_because_the_microbatches_do_not_divide_is_e_dp_003(capsys):
  code, out, err = _cli(capsys, "check", TINY, "--target", "cuda", "--gpu", "H100", "--devices",
                        "64", "--set", "sharding=auto")
  assert code == 1 and out == "" and "error[E-DP-003]" in err and "E-MEM-001" not in err
  assert "on 64 devices divides the 2 microbatches over its data-parallel ranks" in err
  assert "fsdp:16,tensor:4 +remat (16 ranks, " in err  # the layouts that would fit, named
  fix = err.split("= fix: ")[1].strip()
  assert fix == ("--set microbatches=16 (fsdp:16,tensor:4 +remat then runs 1 on each of its 16 "
                 "data-parallel ranks), or --devices 8 (data:2,tensor:4) or 4 (data:2,tensor:2) "
                 "or 2 (replicate)")


def test_the_microbatches_fix_plans(capsys):
  code, out, _ = _cli(capsys, "check", TINY, "--target", "cuda", "--gpu", "H100", "--devices",
                      "64", "--set", "sharding=auto", "--set", "microbatches=16")
  assert code == 0 and "on 64 × H100" in out and "\n    chosen    " in out
  code, out, _ = _cli(capsys, "check", TINY, "--target", "cuda", "--gpu", "H100", "--devices",
                      "8", "--set", "sharding=auto")
  assert code == 0 and "plan on paper" in out


def test_a_model_too_big_for_any_layout_is_still_e_mem_001(capsys):
  code, _, err = _cli(capsys, "check", os.path.join(ROOT, "configs", "llama3-70b.sx"), "--target",
                      "cuda", "--gpu", "H100", "--devices", "8", "--set", "sharding=auto")
  assert code == 1 and "error[E-MEM-001]: no layout of :sharding auto fits" in err
  assert "E-DP-003" not in err

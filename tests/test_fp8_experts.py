"""FP8 of an MoE's expert einsums under expert parallelism: configs/moe-lm.sx (smoke) with
`:fp8 ["*/moe-experts/*"]`, replicated and `expert:2` over two host devices, in one process.
Under expert:2 each device holds half of the experts; a tensor's scale is still its whole
amax (a reduction the partitioner completes across the devices), so the same float8
products are traced and the losses stay the replicated run's up to the order of sums
(measured: the first two equal, the third 4e-6 apart)."""

import numpy as np
import pytest

from test_fp8_patterns import _with, run_layouts


@pytest.mark.slow  # a process of its own on 2 host devices, two layouts' steps compiled
def test_expert_einsums_train_in_fp8_under_expert_parallelism(tmp_path):
  path = _with("moe-lm.sx", ':precision fp8 :fp8 ["*/moe-experts/*"]', tmp_path)
  out = run_layouts(path, tmp_path, ("replicate", "expert:2"),
                    {"steps": 3, "microbatches": 2}, variant="smoke")
  base, split = out["replicate"], out["expert:2"]
  # the three expert products (gate, up, down) forward in e4m3, their cotangents in e5m2
  assert base["e4m3"] > 0 and base["e5m2"] > 0, base
  assert split["e4m3"] == base["e4m3"] and split["e5m2"] == base["e5m2"], (base, split)
  assert len(base["losses"]) == len(split["losses"]) == 3
  rel = np.abs(np.array(split["losses"]) - base["losses"]) / np.array(base["losses"])
  assert rel.max() < 0.02, (split["losses"], base["losses"])

"""FP8 of an MoE's expert einsums under expert parallelism: configs/moe-lm.sx (smoke) with
`:fp8 ["*/moe-experts/*"]`, replicated and `expert:2` over two host devices, in one process.
Under expert:2 each device holds half of the experts; a tensor's scale is still its whole
amax (a reduction the partitioner completes across the devices), so the same float8
products are traced and the losses stay the replicated run's up to the order of sums
(measured: the first two equal, the third 4e-6 apart)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from test_fp8_patterns import _with

_RUNS = """
import json, re
import sexpgpu
from sexpgpu.run.check import CheckOptions, check
out = {{}}
for layout in ("replicate", "expert:2"):
  sets = {{"sharding": layout, "steps": 3, "microbatches": 2}}
  hlo = check({path!r}, "smoke", [(k, str(v)) for k, v in sets.items()], "hlo",
              CheckOptions())
  sexpgpu.compile({path!r}, variant="smoke", set=sets).run(
      metrics="jsonl:{tmp}/" + layout + ".jsonl")
  losses = [e["train/loss"] for e in map(json.loads, open("{tmp}/" + layout + ".jsonl"))
            if e["kind"] == "step"]
  out[layout] = {{"losses": losses, "e5m2": len(re.findall(r"convert[^\\n]*xf8E5M2>", hlo)),
                 "e4m3": len(re.findall(r"convert[^\\n]*xf8E4M3FN>", hlo))}}
print(json.dumps(out))
"""


@pytest.mark.slow  # a process of its own on 2 host devices, two layouts' steps compiled
def test_expert_einsums_train_in_fp8_under_expert_parallelism(tmp_path):
  path = _with("moe-lm.sx", ':precision fp8 :fp8 ["*/moe-experts/*"]', tmp_path)
  env = dict(os.environ, SEXPGPU_DEVICES="0,1", XLA_FLAGS="--xla_force_host_platform_device_"
             "count=2 " + os.environ.get("XLA_FLAGS", ""))
  env.pop("SEXPGPU_STACKING", None)
  p = subprocess.run([sys.executable, "-c", _RUNS.format(path=path, tmp=tmp_path)],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  base, split = out["replicate"], out["expert:2"]
  # the three expert products (gate, up, down) forward in e4m3, their cotangents in e5m2
  assert base["e4m3"] > 0 and base["e5m2"] > 0, base
  assert split["e4m3"] == base["e4m3"] and split["e5m2"] == base["e5m2"], (base, split)
  assert len(base["losses"]) == len(split["losses"]) == 3
  rel = np.abs(np.array(split["losses"]) - base["losses"]) / np.array(base["losses"])
  assert rel.max() < 0.02, (split["losses"], base["losses"])

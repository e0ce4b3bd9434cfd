"""`:sharding auto` against every fixed layout on this machine's 4 XLA host devices.

Usage:
  python benchmarks/bench_layouts.py [--rounds R] [--steps N] [--json OUT]

Two shapes of configs/llama3-8b.sx's smoke model: `batch` (many rows, a small model: the
gradients' all-reduce is cheap next to the compute, data parallel should win) and `wide`
(a wider model on few rows, where the state's traffic weighs more). For each shape every
fixed layout the device count allows (the plan's own enumeration, those that divide the
sizes) and `auto` (the layout `layout_choice.resolve` chooses, with a fresh choices.json)
train from the same initial parameters on the same zero batches; R rounds in a rotating
order, each layout N steps a round (the first compiles and is dropped), and a layout's time
is the median over rounds of its round's median step. `auto` is judged against the best
fixed layout: within 5%.

Host devices share this machine's cores and memory, so their collectives are memory copies
and their compute does not scale with the device count: layouts whose steps differ by
less than the rounds' spread cannot be told apart here, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=4 "
                           + os.environ.get("XLA_FLAGS", ""))
os.environ["SEXPGPU_DEVICES"] = "0,1,2,3"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "llama3-8b.sx")
SHAPES = {
    "batch": [("batch", "32"), ("width", "64"), ("hidden", "176"), ("microbatches", "4")],
    "wide": [("batch", "1"), ("width", "512"), ("hidden", "1408"), ("heads", "8"),
             ("kv-heads", "4"), ("microbatches", "4")],
}


def _compile(shape: str, sharding: str):
  from sexpgpu.run.compile import compile_file
  return compile_file(CONFIG, "smoke", SHAPES[shape] + [("sharding", sharding)])


def bench_shape(shape: str, rounds: int, steps: int, place) -> dict:
  """One shape: each layout's median step seconds, auto's choice and its lines."""
  import jax
  import numpy as np
  from sexpgpu.ir.shapes import np_dtype
  from sexpgpu.run.planning import layout_choice
  from sexpgpu.run.training import build
  c = _compile(shape, "auto")
  with tempfile.TemporaryDirectory() as cache:
    choice = layout_choice.resolve(c, place, cache)
  fixed = sorted({x.text for x in choice.candidates
                  if not (x.dropped or "").startswith(("tensor:", "expert:", "no ", "the "))})
  runs = {}
  for text in fixed:
    cc = _compile(shape, text)
    tr = build(cc, place)
    k = tr.k
    host = {f: np.zeros((k,) + sh, np_dtype(dt))
            for f, (dt, sh) in cc.fields[cc.stages[0].data].items()}
    runs[text] = [tr, tr.init_state(), place.shard(host, k), tr.step(0, k // tr.ranks), []]
  for r in range(rounds):
    order = fixed[r % len(fixed):] + fixed[:r % len(fixed)]  # rotating
    for text in order:
      tr, state, batches, step, out = runs[text]
      times = []
      for i in range(steps + 1):
        t = time.perf_counter()
        state, m = step(state, batches)
        jax.block_until_ready(m)
        if i:
          times.append(time.perf_counter() - t)
      runs[text][1] = state
      out.append(statistics.median(times))
  table = {text: statistics.median(v[4]) for text, v in runs.items()}
  spread = {text: (max(v[4]) - min(v[4])) / statistics.median(v[4]) for text, v in runs.items()}
  best = min(table, key=table.get)
  auto = choice.chosen.text
  return {"table": table, "spread": spread, "best": best, "auto": auto, "how": choice.how,
          "auto_vs_best": table.get(auto, float("nan")) / table[best],
          "predicted": {x.text: x.time for x in choice.candidates if not x.dropped},
          "lines": choice.lines()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  sys.path.insert(0, ROOT)
  from sexpgpu.run.backend import open_devices
  place = open_devices("cpu", [0, 1, 2, 3])
  results = {}
  for shape in SHAPES:
    res = bench_shape(shape, a.rounds, a.steps, place)
    results[shape] = res
    print(f"shape {shape}: auto chose {res['auto']} ({res['how']}); best fixed {res['best']}; "
          f"auto/best {res['auto_vs_best']:.3f}")
    for text, t in sorted(res["table"].items(), key=lambda kv: kv[1]):
      pred = res["predicted"].get(text)
      print(f"  {text:<20} {t * 1e3:8.2f} ms  (rounds' spread {100 * res['spread'][text]:.0f}%"
            + (f", model {pred * 1e3:.2f} ms" if pred else "") + ")")
    close = [x for x, t in res["table"].items() if t <= res["table"][res["best"]] * 1.05]
    if len(close) > 1:
      print(f"  within 5% of the best, not told apart here: {', '.join(sorted(close))}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""μP's learning-rate transfer (issue 38): a learning-rate sweep, five rates a factor of 2
apart, of a shipped transformer (configs/tiny-lm.sx: std/lm's transformer-lm on a Markov
chain, AdamW at a constant rate) at widths 64 and 512, under the standard parametrization
and under μP (`:parametrization mup :base-width 64`), each point trained in this process.
Prints each point's final eval/loss and the best rate per width; under μP the best rate
should be the same grid point at both widths, under the standard one it moves.

The heads grow with the width (a head of 16), so that attention's 1/√d is the same at both
widths (μP's 1/d is then a constant factor, and no μP warning applies).

    python benchmarks/mup_transfer.py [--steps 200] [--rates 0.0025,0.005,0.01,0.02,0.04]
                                      [--widths 64,512] [--eval-batches 16]
                                      [--params standard,mup] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny-lm.sx")


def experiment(folder: str, eval_batches: int) -> str:
  """configs/tiny-lm.sx with its parametrization a knob (`param`), a base width of 64 and
  its eval pass over `eval_batches` batches (2 in the file: too few to rank close rates)."""
  with open(CONFIG, encoding="utf-8") as f:
    text = f.read()
  text = text.replace(":batches 2 ", f":batches {eval_batches} ", 1)
  text = text.replace("(defrun ", "(defknob param standard \"standard or mup\")\n"
                      "(defrun :parametrization param :base-width 64 ", 1)
  path = os.path.join(folder, "tiny-lm-mup.sx")
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


def point(path: str, param: str, width: int, lr: float, steps: int) -> float:
  """One run's final eval/loss (inf when it diverged), trained in this process through the
  Python API (`sexpgpu.compile(...).run(...)`, as `sexpgpu run` trains)."""
  import sexpgpu
  exp = sexpgpu.compile(path, set={"param": param, "width": width, "heads": width // 16,
                                   "lr": lr})
  loss = exp.run(steps=steps).eval.get("eval/loss")
  return float(loss) if loss is not None and loss == loss else float("inf")


def main() -> int:
  """Runs the sweep and prints the table and the best rate per width."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--rates", default="0.0025,0.005,0.01,0.02,0.04")
  ap.add_argument("--widths", default="64,512")
  ap.add_argument("--eval-batches", type=int, default=16)
  ap.add_argument("--params", default="standard,mup")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  rates = [float(r) for r in args.rates.split(",")]
  widths = [int(w) for w in args.widths.split(",")]
  t0 = time.perf_counter()
  results: dict[str, dict[int, list[float]]] = {}
  with tempfile.TemporaryDirectory() as folder:
    path = experiment(folder, args.eval_batches)
    for param in args.params.split(","):
      for w in widths:
        for lr in rates:  # each point said as it ends: a long sweep shows its progress
          loss = point(path, param, w, lr, args.steps)
          results.setdefault(param, {}).setdefault(w, []).append(loss)
          print(f"point {param} width {w} lr {lr:g}: eval/loss {loss:.4f} "
                f"({time.perf_counter() - t0:.0f} s)", flush=True)
  print(f"mup_transfer: configs/tiny-lm.sx, {args.steps} steps, AdamW at a constant rate, "
        f"final eval/loss over {args.eval_batches} batches ({time.perf_counter() - t0:.0f} s)")
  print("param     width  " + "  ".join(f"{r:>8g}" for r in rates) + "  best")
  best = {}
  for param, by_width in results.items():
    for w, losses in by_width.items():
      i = min(range(len(rates)), key=lambda k: losses[k])
      best[(param, w)] = rates[i]
      print(f"{param:<9} {w:>5}  " + "  ".join(f"{x:>8.4f}" for x in losses)
            + f"  {rates[i]:g}")
  for param in results:
    same = len({best[(param, w)] for w in widths}) == 1
    print(f"{param}: best rate " + ", ".join(f"{best[(param, w)]:g} at {w}" for w in widths)
          + (" (the same grid point)" if same else " (it moves)"))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"rates": rates, "widths": widths, "steps": args.steps,
                 "loss": {p: {str(w): v for w, v in d.items()} for p, d in results.items()}},
                f)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""μP's learning-rate transfer (issue 38): a learning-rate sweep by `sexpgpu sweep`, five
rates a factor of 2 apart, of a shipped transformer (configs/tiny-lm.sx: std/lm's
transformer-lm on a Markov chain, AdamW at a constant rate) at widths 64 and 512, under the
standard parametrization and under μP (`:parametrization mup :base-width 64`). Prints each
cell's final eval/loss (the mean over `--seeds`) and the best rate per width; under μP the
best rate should be the same grid point at both widths, under the standard one it moves.

The heads grow with the width (a head of 16), so attention's 1/√d is the same at both widths
(μP's 1/d is then a constant factor: the μP warning says nothing new). Every point is one
`sexpgpu run` child of the sweep; `--dir` keeps the sweep's status folder, so a stopped
measurement started again runs only the points not done. At the base width μP is the file as
written, so the standard parametrization's base-width points are μP's, run once.
`--schedule cosine` sweeps the peak of a warmup-cosine schedule (a tenth of the steps up,
cosine down to a tenth of the peak) in place of the file's constant rate.

    python benchmarks/mup_transfer.py [--steps 200] [--rates 0.0025,0.005,0.01,0.02,0.04]
                                      [--widths 64,512] [--seeds 1] [--eval-batches 16]
                                      [--params standard,mup] [--schedule constant|cosine]
                                      [--dir D] [--json out.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny-lm.sx")


def experiment(folder: str, eval_batches: int, head: int = 16, base: int = 64,
               warmup: int | None = None) -> str:
  """configs/tiny-lm.sx with its parametrization (`param`) and seed (`seed`) knobs, a base
  width of `base`, heads of `head` (their count the width / head), its eval pass over
  `eval_batches` batches (2 in the file: too few to rank close rates) and, with `warmup`, the
  rate `lr` the peak of a warmup-cosine schedule (`warmup` steps up, cosine down to a tenth:
  nanoGPT's and GPT-3's shape) in place of the file's constant rate. Returns its path."""
  with open(CONFIG, encoding="utf-8") as f:
    text = f.read()
  edits = [(":batches 2 ", f":batches {eval_batches} "),
           (":heads heads", f":heads (/ width {head})"),
           (":seed 1", ":seed seed"),
           ("(defrun ", "(defknob param standard \"standard or mup\")\n"
            "(defknob seed 1 \"the run's seed\")\n"
            f"(defrun :parametrization param :base-width {base} ")]
  if warmup is not None:
    edits.append(("(adamw :lr lr ", f"(adamw :lr (warmup-cosine :peak lr :warmup {warmup} "
                  ":floor 0.1) "))
  for old, new in edits:
    if old not in text:
      raise SystemExit(f"mup_transfer: {CONFIG} no longer holds `{old}`; update experiment()")
    text = text.replace(old, new, 1)
  path = os.path.join(folder, "tiny-lm-mup.sx")
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


def sweep(path: str, grid: list[tuple[str, list]], steps: int, folder: str,
          name: str = "table") -> list[dict]:
  """Runs `sexpgpu sweep` over `grid` (every point `steps` steps, evaluated once at the end)
  and returns its table's rows (CSV records)."""
  table = os.path.join(folder, f"{name}.csv")
  argv = [sys.executable, "-m", "sexpgpu.cli.main", "sweep", path]
  for name, values in grid:
    argv += ["--set", f"{name}=" + ",".join(str(v) for v in values)]
  argv += ["--steps", str(steps), "--eval-every", str(steps), "--status-dir",
           os.path.join(folder, "points"), "--table", table]
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  code = subprocess.call(argv, env=env)
  if not os.path.exists(table):
    raise SystemExit(f"mup_transfer: the sweep wrote no table (exit {code})")
  with open(table, encoding="utf-8") as f:
    return list(csv.DictReader(f))


def loss_of(row: dict) -> float | None:
  """A row's final eval/loss: inf when it diverged, None when the point did not finish."""
  if row.get("state") != "done":
    return None
  v = row.get("eval/loss") or ""
  x = float(v) if v else float("inf")
  return x if math.isfinite(x) else float("inf")


def cells(rows: list[dict], params: list[str], widths: list[int], rates: list[float]
          ) -> dict[str, dict[int, list[float | None]]]:
  """{param: {width: [mean eval/loss over the seeds, one per rate]}}, None for a cell with a
  point not finished."""
  got: dict[tuple, list] = {}
  for r in rows:
    key = (r["param"], int(r["width"]), float(r["lr"]))
    got.setdefault(key, []).append(loss_of(r))

  def mean(xs):
    return None if not xs or None in xs else sum(xs) / len(xs)
  return {p: {w: [mean(got.get((p, w, lr), [])) for lr in rates] for w in widths}
          for p in params}


def main() -> int:
  """Runs the sweep and prints the table and the best rate per width."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--rates", default="0.0025,0.005,0.01,0.02,0.04")
  ap.add_argument("--widths", default="64,512")
  ap.add_argument("--seeds", default="1")
  ap.add_argument("--eval-batches", type=int, default=16)
  ap.add_argument("--params", default="standard,mup")
  ap.add_argument("--base", type=int, default=64)
  ap.add_argument("--dir", default=None, help="the sweep's folder (kept; default a temporary one)")
  ap.add_argument("--schedule", default="constant", choices=("constant", "cosine"),
                  help="the file's constant rate, or a warmup-cosine schedule peaking at it")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  rates = [float(r) for r in args.rates.split(",")]
  widths = [int(w) for w in args.widths.split(",")]
  seeds = [int(s) for s in args.seeds.split(",")]
  params = args.params.split(",")
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    folder = args.dir or tmp
    os.makedirs(folder, exist_ok=True)
    path = experiment(folder, args.eval_batches, base=args.base,
                      warmup=None if args.schedule == "constant" else args.steps // 10)
    # At the base width μP is the file as written (the same fingerprint: tests/test_mup.py),
    # so the standard parametrization's base-width points are μP's, run once.
    rows = sweep(path, [("param", [p for p in params if p == "mup"] or params[:1]),
                        ("width", widths), ("seed", seeds), ("lr", rates)], args.steps, folder)
    others = [w for w in widths if w != args.base]
    if "standard" in params and "mup" in params and others:
      rows += sweep(path, [("param", ["standard"]), ("width", others), ("seed", seeds),
                           ("lr", rates)], args.steps, folder, "standard")
    for r in list(rows):
      if r["param"] == "mup" and int(r["width"]) == args.base and "standard" in params:
        rows.append({**r, "param": "standard"})
  results = cells(rows, params, widths, rates)
  shape = ("a constant rate" if args.schedule == "constant" else
           f"warmup-cosine (warmup {args.steps // 10}, floor 0.1) peaking at the rate")
  print(f"mup_transfer: configs/tiny-lm.sx by `sexpgpu sweep`, {args.steps} steps, AdamW at "
        f"{shape}, base width {args.base}, final eval/loss over {args.eval_batches} "
        f"batches, mean of seeds {args.seeds} ({time.perf_counter() - t0:.0f} s)")
  print("param     width  " + "  ".join(f"{r:>8g}" for r in rates) + "  best")
  best = {}
  for param, by_width in results.items():
    for w, losses in by_width.items():
      done = None not in losses
      i = min(range(len(rates)), key=lambda k: losses[k]) if done else None
      best[(param, w)] = rates[i] if done else None
      print(f"{param:<9} {w:>5}  " + "  ".join("       -" if x is None else f"{x:>8.4f}"
                                                for x in losses)
            + (f"  {rates[i]:g}" if done else "  - (not finished)"))
  for param in results:
    if len(widths) < 2 or any(best[(param, w)] is None for w in widths):
      continue
    same = len({best[(param, w)] for w in widths}) == 1
    print(f"{param}: best rate " + ", ".join(f"{best[(param, w)]:g} at {w}" for w in widths)
          + (" (the same grid point)" if same else " (it moves)"))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"rates": rates, "widths": widths, "steps": args.steps, "seeds": seeds,
                 "schedule": args.schedule,
                 "base": args.base,
                 "loss": {p: {str(w): v for w, v in d.items()} for p, d in results.items()},
                 "points": rows}, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())

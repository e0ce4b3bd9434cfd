"""Evaluation benchmark: a task scored with requests packed into rows against one request a row.

Usage:
  python benchmarks/bench_eval.py [--shape text-lm|tiny] [--task configs/data/choice.jsonl]
                                  [--batch 8] [--rounds 7] [--json F]

One model of configs/text-lm.sx's shape (std/lm's `transformer-lm`, vocab 2048, width 128,
4 layers, 4 heads, a window of 64; `tiny` is the smoke test's), its parameters `exp.init(0)`,
and the tokenizer of `sexpgpu tokenize configs/data/*.txt --train-bpe 2048` (made in a
temporary folder). The task is scored two ways by `sexpgpu.models.evaluate.Scorer`, as
defeval and `sexpgpu eval` score it:

  packed     requests first-fit into rows of the window, each its own segment with positions
             from 0 (the model's :segments and :positions), `batch` rows a call;
  one-a-row  the same scorer with packed=False: a row holds one request.

Both must give the same log-likelihoods (to 1e-5 a request, checked: exit 1 otherwise). Each
leg is built and scored once (its first call, compile and tokenizing included, reported
apart), then timed warm, as an evaluation during training runs (the scorer keeps its compiled
call and the task's rows), in R rounds with the legs in alternating order; the ratio is the
median of the rounds' paired ratios one-a-row/packed, with their range.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TASK = os.path.join(ROOT, "configs", "data", "choice.jsonl")

# configs/text-lm.sx's model, with a function of tokens (and the packing keywords) to score.
SX = """
(require std/nn)
(require std/lm)
(defknob cache "cache")
(defknob vocab 2048)
(defknob width 128)
(defknob layers 4)
(defknob heads 4)
(defknob seq 64)
(defloader train (text cache :seq (+ seq 1) :batch 8 :pack docs :vocab vocab))
(defn lm [tokens :segments nil :positions nil]
  (transformer-lm tokens :vocab vocab :width width :layers layers :heads heads
                  :segments segments :positions positions))
(defn loss [batch]
  (let [t (get batch :tokens)
        s (get batch :segments)]
    (next-token-loss (lm (lm-inputs t) :segments (lm-inputs s)
                         :positions (lm-inputs (get batch :positions)))
                     t :segments s)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 1e-3) :precision f32 :seed 0)
"""
SHAPES = {
    "text-lm": {"width": 128, "layers": 4, "heads": 4},
    "tiny": {"width": 32, "layers": 1, "heads": 2},
}
LEGS = ("packed", "one-a-row")
GOAL = 3.0  # issue 28: packed at least 3x faster than one request a row
TOLERANCE = 1e-5  # a request's log-likelihood, packed against one a row


def build(shape: str, tmp: str):
  """The compiled experiment, its host parameters and the tokenizer.

  Returns:
    (c, params, tok): the Compiled experiment, path -> numpy array, a tokenizers.Tokenizer.
  """
  import numpy as np
  import sexpgpu
  from tokenizers import Tokenizer
  from sexpgpu.cli.main import main
  cache = os.path.join(tmp, "cache")
  txt = sorted(glob.glob(os.path.join(ROOT, "configs", "data", "*.txt")))
  if main(["tokenize", *txt, "-o", cache, "--train-bpe", "2048"]) != 0:
    raise RuntimeError("sexpgpu tokenize failed")
  path = os.path.join(tmp, "bench-eval.sx")
  with open(path, "w") as f:
    f.write(SX)
  exp = sexpgpu.compile(path, set=dict(SHAPES[shape], cache=cache))
  params = {k: np.asarray(v) for k, v in exp.init(0).params.items()}
  return exp._c, params, Tokenizer.from_file(os.path.join(cache, "tokenizer.json"))


def measure(c, params: dict, tok, task_path: str, batch: int, rounds: int) -> dict:
  """Both legs' first call and warm rounds, and their log-likelihoods' largest difference."""
  import numpy as np
  from sexpgpu.models import evaluate
  task = evaluate.load_task(task_path)
  res = {"task": task.name, "docs": len(task.docs), "batch": batch, "legs": {}}
  scorers, scores = {}, {}
  for leg in LEGS:
    t0 = time.perf_counter()
    scorers[leg] = evaluate.Scorer(c, "lm", tok, batch=batch, packed=leg == "packed")
    scores[leg] = scorers[leg].score(params, task)
    s = scores[leg]
    res["legs"][leg] = {"first_s": time.perf_counter() - t0, "round_s": [], "rows": s.rows,
                        "calls": -(-s.rows // batch), "requests": s.requests,
                        "metrics": s.metrics}
  res["window"] = scorers["packed"].window
  a, b = (np.array(scores[leg].loglikelihoods, np.float64) for leg in LEGS)
  res["max_diff"] = float(np.abs(a - b).max())
  for r in range(rounds):
    for leg in (LEGS if r % 2 == 0 else LEGS[::-1]):  # alternating order: paired rounds
      t0 = time.perf_counter()
      scorers[leg].score(params, task)  # ends with the scores on the host
      res["legs"][leg]["round_s"].append(time.perf_counter() - t0)
  per = [o / p for p, o in zip(res["legs"]["packed"]["round_s"],
                               res["legs"]["one-a-row"]["round_s"])]
  res["ratio"] = {"median": statistics.median(per), "min": min(per), "max": max(per),
                  "rounds": per}
  return res


def report(res: dict) -> list[str]:
  """The legs' table and the ratio line."""
  lines = [f"task {res['task']}: {res['docs']} docs, window {res['window']}, batch "
           f"{res['batch']}, log-likelihoods packed vs one-a-row max |diff| "
           f"{res['max_diff']:.3g}",
           f"{'leg':<10} {'requests':>8} {'rows':>5} {'calls':>5} {'first s':>8} "
           f"{'median s':>9} {'req/s':>8}"]
  for leg, x in res["legs"].items():
    med = statistics.median(x["round_s"])
    lines.append(f"{leg:<10} {x['requests']:>8} {x['rows']:>5} {x['calls']:>5} "
                 f"{x['first_s']:>8.2f} {med:>9.4f} {x['requests'] / med:>8.0f}")
  r = res["ratio"]
  met = "met" if r["median"] >= GOAL else "NOT met"
  lines.append(f"ratio eval one-a-row/packed {r['median']:.3g} ({r['min']:.3g}..{r['max']:.3g})"
               f" over {len(r['rounds'])} rounds: goal >= {GOAL:g} {met}")
  return lines


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  ap.add_argument("--shape", choices=sorted(SHAPES), default="text-lm")
  ap.add_argument("--task", default=TASK, help="a task .jsonl (default: the shipped choice task)")
  ap.add_argument("--batch", type=int, default=8, help="rows a call")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--json", help="write the measurements here")
  a = ap.parse_args()
  from sexpgpu.run.backend import cpu_flags
  cpu_flags()  # sexpgpu's XLA CPU flags, before the backend starts, as a run sets them
  with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
    c, params, tok = build(a.shape, tmp)
    res = measure(c, params, tok, a.task, a.batch, a.rounds)
  res["shape"] = a.shape
  print("\n".join(report(res)), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(res, f, indent=1)
  if res["max_diff"] > TOLERANCE:
    print(f"packed and one-a-row log-likelihoods differ by {res['max_diff']:.3g} > "
          f"{TOLERANCE:g}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())

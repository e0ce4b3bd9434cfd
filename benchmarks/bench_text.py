"""Text benchmarks: `sexpgpu tokenize` against `tokenizers`' own encode_batch, and the text loader
against the step it feeds.

Usage:
  python benchmarks/bench_text.py [--mb 4] [--files 8] [--rounds 3] [--steps 40] [--json OUT]

tokenize: F text files of about MB/F megabytes each (the shipped text in
configs/data/, its paragraphs shuffled) are tokenized R rounds, both legs in
each round, in rotating order: (a) `sexpgpu tokenize FILES -o CACHE
--tokenizer tokenizer.json` in this process (reading, sha256, encoding,
writing shards and manifest), (b) reading the same files and calling
`Tokenizer.encode_batch` on their documents, (c) the same with
`encode_batch_fast` (no offsets; what `tokenize` itself calls). The ratio is the median of the
rounds' a/b throughput ratios; the goal is >= 0.8.

loader: the `train` loader of configs/text-lm.sx (default variant: :seq 65
:batch 8 :pack docs) over a cache of the shipped text, batches drawn a second;
against the median step time of `sexpgpu run configs/text-lm.sx`, the loader's
time a batch as a fraction of a step (the loader must never be what the step
waits for: the fraction must stay well below 1; the loop draws ahead in a thread).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "configs", "text-lm.sx")
TOKENIZE_GOAL = 0.8


def make_sources(folder: str, total_mb: float, files: int) -> list[str]:
  """`files` .txt files of shuffled shipped paragraphs, about total_mb MB in all."""
  paras = []
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "data", "*.txt"))):
    with open(path, encoding="utf-8") as f:
      paras += [p for p in f.read().split("\n\n") if p.strip()]
  out = []
  for i in range(files):
    rng = np.random.default_rng(i)
    parts, size = [], 0
    while size < total_mb * 1e6 / files:
      p = paras[rng.integers(len(paras))]
      parts.append(p)
      size += len(p) + 2
    path = os.path.join(folder, f"part-{i:03d}.txt")
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n\n".join(parts))
    out.append(path)
  return out


def bench_tokenize(folder: str, sources: list[str], rounds: int) -> dict:
  """Throughput of both legs, MB/s each round, and the median ratio."""
  from tokenizers import Tokenizer
  from sexpgpu.tools.tokenize import Options, tokenize
  tok_dir = os.path.join(folder, "tok")
  tokenize(Options(tuple(sources[:1]), tok_dir, train_bpe=2048), progress=False)
  tok_file = os.path.join(tok_dir, "tokenizer.json")
  mb = sum(os.path.getsize(s) for s in sources) / 1e6

  def ours(r: int) -> float:
    t = time.perf_counter()
    tokenize(Options(tuple(sources), os.path.join(folder, f"cache-{r}"), tokenizer=tok_file),
             progress=False)
    return mb / (time.perf_counter() - t)

  def theirs(method: str):
    def leg(_: int) -> float:
      tok = Tokenizer.from_file(tok_file)
      t = time.perf_counter()
      docs = []
      for s in sources:
        with open(s, encoding="utf-8") as f:
          docs.append(f.read())
      getattr(tok, method)(docs)
      return mb / (time.perf_counter() - t)
    return leg

  rows = []
  for r in range(rounds):
    legs = [("sexpgpu", ours), ("tokenizers", theirs("encode_batch")),
            ("tokenizers-fast", theirs("encode_batch_fast"))]
    legs = legs[r % 3:] + legs[:r % 3]
    got = {name: fn(r) for name, fn in legs}
    rows.append(got)
    print(f"tokenize round {r}: sexpgpu {got['sexpgpu']:.2f} MB/s, tokenizers encode_batch "
          f"{got['tokenizers']:.2f} MB/s, encode_batch_fast {got['tokenizers-fast']:.2f} MB/s",
          file=sys.stderr)
  ratio = statistics.median(g["sexpgpu"] / g["tokenizers"] for g in rows)
  return {"mb": round(mb, 3), "files": len(sources), "rounds": rows,
          "sexpgpu_mb_s": statistics.median(g["sexpgpu"] for g in rows),
          "tokenizers_mb_s": statistics.median(g["tokenizers"] for g in rows),
          "tokenizers_fast_mb_s": statistics.median(g["tokenizers-fast"] for g in rows),
          "ratio": ratio,
          "ratio_fast": statistics.median(g["sexpgpu"] / g["tokenizers-fast"] for g in rows),
          "goal": TOKENIZE_GOAL, "met": ratio >= TOKENIZE_GOAL}


def bench_loader(folder: str, steps: int, batches: int = 2000) -> dict:
  """The text loader's batches a second against text-lm.sx's median step time."""
  from sexpgpu.data import make_loader
  from sexpgpu.data.spec import LoaderSpec
  from sexpgpu.tools.tokenize import Options, tokenize
  cache = os.path.join(folder, "cache")
  shipped = sorted(glob.glob(os.path.join(ROOT, "configs", "data", "*.txt")))
  tokenize(Options(tuple(shipped), cache, train_bpe=2048), progress=False)
  spec = LoaderSpec("train", "text", {"path": cache, "seq": 65, "batch": 8, "pack": "docs",
                                      "split": [0, 0.9]})
  loader = make_loader(spec, seed=0)
  loader.batch(0)
  t = time.perf_counter()
  for i in range(batches):
    loader.batch(i)
  per_batch = (time.perf_counter() - t) / batches
  r = subprocess.run([sys.executable, "-m", "sexpgpu.cli.main", "run", CONFIG, "--set",
                      f"cache={cache}", "--steps", str(steps), "--eval-every", "0"],
                     cwd=folder, capture_output=True, text=True, timeout=1800)
  if r.returncode != 0:
    raise SystemExit(f"text-lm.sx did not run:\n{r.stderr}")
  m = re.search(r"timing steps \S+ median ([0-9.]+)s", r.stderr)
  if m is None:
    raise SystemExit(f"no step timing in the run's output:\n{r.stderr}")
  step = float(m.group(1))
  return {"batches_per_s": 1.0 / per_batch, "batch_ms": per_batch * 1e3,
          "step_ms": step * 1e3, "loader_fraction_of_step": per_batch / step,
          "config": "configs/text-lm.sx (default variant)", "steps": steps}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--mb", type=float, default=4.0, help="megabytes of text to tokenize")
  ap.add_argument("--files", type=int, default=8, help="source files")
  ap.add_argument("--rounds", type=int, default=3, help="rounds of both tokenize legs")
  ap.add_argument("--steps", type=int, default=40, help="steps of text-lm.sx to time")
  ap.add_argument("--json", default=None, help="also write the results here")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    sources = make_sources(folder, args.mb, args.files)
    tok = bench_tokenize(folder, sources, args.rounds)
    ld = bench_loader(folder, args.steps)
  print(f"tokenize: sexpgpu {tok['sexpgpu_mb_s']:.2f} MB/s, tokenizers encode_batch "
        f"{tok['tokenizers_mb_s']:.2f} MB/s on the same {tok['mb']} MB in {tok['files']} files: "
        f"{tok['ratio']:.2f}x (goal >= {TOKENIZE_GOAL}: {'met' if tok['met'] else 'NOT met'}); "
        f"against encode_batch_fast (no offsets, what tokenize calls) "
        f"{tok['tokenizers_fast_mb_s']:.2f} MB/s: {tok['ratio_fast']:.2f}x")
  print(f"loader: {ld['batches_per_s']:.0f} batches/s ({ld['batch_ms']:.3f} ms a batch) against "
        f"a {ld['step_ms']:.1f} ms step of text-lm.sx: {100 * ld['loader_fraction_of_step']:.1f}% "
        "of a step")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"tokenize": tok, "loader": ld}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

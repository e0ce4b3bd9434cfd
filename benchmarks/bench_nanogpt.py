"""sexpgpu against a PyTorch twin of nanoGPT on its shakespeare_char CPU recipe.

    python benchmarks/bench_nanogpt.py [--rounds 3] [--iters 2000] [--quick] [--startup]
                                       [--data DIR] [--legs twin,sexpgpu,cold] [--json F]

Prepares the text (benchmarks/prepare_shakespeare.py DIR, once), then in each round, in a
rotating order, runs as separate processes:

- `twin`: benchmarks/nanogpt_twin.py (nanoGPT's train.py and model.py in PyTorch, torch's
  default threads) for --iters iterations;
- `sexpgpu`: `sexpgpu run configs/shakespeare-char.sx --set text=DIR/input.txt --steps N
  --metrics jsonl:F`, as a user would, on a warm XLA cache (JAX_COMPILATION_CACHE_DIR and
  SEXPGPU_CACHE_DIR filled by a run of the same N steps before the rounds; the schedule's
  numbers, N among them, are arguments of the train step, so any count would load it);
- `cold`: the same command with `--steps 1` and empty cache folders: start-up and peak
  memory with every executable compiled.

What is timed:

- ms/iteration: the median over every iteration after the first of the period from the end of one
  iteration (its loss on the host) to the end of the next, iterations that held an
  evaluation left out. The twin times it as nanoGPT's `dt` does; for sexpgpu it is the
  difference of the `time` stamps of consecutive `step` events in the metrics file (each
  written when that step's numbers reached the host; the loop reads them one step late, so
  the period is the same on average); a period that spans a pass is left out.
- start-up: from just before the child is launched to step 0, before the first evaluation
  (for the twin: before iteration 0's `estimate_loss`; for sexpgpu: the step-0 `pass`
  event's time less its `time/pass`).
- peak RSS: the child's `ru_maxrss` (os.wait4), which covers the process and any it waited on.
- validation loss: the twin's over the whole validation split after the last iteration; for
  sexpgpu its last `eval/loss` (the pass reads the whole split).

`--startup` runs every leg for one iteration: start-up and peak RSS only (no ms/iteration
and no loss compared).

Ratios are sexpgpu ÷ twin within a round, then the median (and range) over rounds.
The machine's load (os.getloadavg) is printed before and after each leg.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "configs", "shakespeare-char.sx")
DATA = os.path.join(ROOT, "cache", "shakespeare")


def prepare(data_dir: str) -> str:
  """DATA_DIR/input.txt, written by prepare_shakespeare.py when absent."""
  text = os.path.abspath(os.path.join(data_dir, "input.txt"))  # the config reads it, not the cwd
  if not os.path.isfile(text):
    subprocess.run([sys.executable, os.path.join(HERE, "prepare_shakespeare.py"), data_dir,
                    "--no-cache"], check=True)
  return text


def _launch(cmd: list[str], env: dict, out_path: str | None = None) -> dict:
  """Runs cmd; its wall clock at launch, exit status, peak RSS (MiB), stdout and stderr."""
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    res = {"t_launch": t0, "wall_s": time.time() - t0, "rc": proc.returncode,
           "rss_mib": usage.ru_maxrss / 1024, "stdout": out.read(), "stderr": err.read()}
  if res["rc"] != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited {res['rc']}:\n{res['stderr'][-4000:]}")
  return res


def _env(**extra) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  env.update(extra)
  return env


def _sexpgpu_bin() -> list[str]:
  exe = shutil.which("sexpgpu", path=os.path.dirname(sys.executable)) or shutil.which("sexpgpu")
  return [exe] if exe else [sys.executable, "-m", "sexpgpu.cli.main"]


def leg_sexpgpu(text: str, iters: int, caches: str, config: str = CONFIG) -> dict:
  """One `sexpgpu run` of the config for `iters` steps with the caches under `caches`."""
  with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as tmp:
    metrics = os.path.join(tmp, "m.jsonl")
    res = _launch(_sexpgpu_bin() + ["run", config, "--set", f"text={text}", "--steps",
                                    str(iters), "--metrics", f"jsonl:{metrics}"],
                  _env(JAX_COMPILATION_CACHE_DIR=os.path.join(caches, "xla"),
                       SEXPGPU_CACHE_DIR=os.path.join(caches, "sexpgpu")))
    with open(metrics) as f:
      events = [json.loads(line) for line in f if line.strip()]
  steps = [e for e in events if e["kind"] == "step"]
  passes = [e for e in events if e["kind"] == "pass"]
  first = next(e for e in passes if e["step"] == 0)
  pass_steps = {e["step"] for e in passes}
  periods = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])
             if a["step"] >= 1 and a["step"] not in pass_steps]
  evals = [e["metrics"]["eval/loss"] for e in passes]
  kernels = next((line for line in res["stderr"].splitlines()
                  if line.startswith("timing kernels")), "")
  return {"periods": periods, "startup_s": first["time"] - first["time/pass"] - res["t_launch"],
          "rss_mib": res["rss_mib"], "val_loss": evals[-1], "wall_s": res["wall_s"],
          "kernels": kernels, "steps": len(steps)}


def leg_twin(text: str, iters: int, vocab: int) -> dict:
  """One run of benchmarks/nanogpt_twin.py."""
  res = _launch([sys.executable, os.path.join(HERE, "nanogpt_twin.py"), "--text", text,
                 "--iters", str(iters), "--vocab", str(vocab)], _env())
  out = json.loads(res["stdout"].strip().splitlines()[-1])
  evals = set(out["evals"])
  # iteration 0 left out, and every iteration that held an evaluation
  periods = [p for i, p in enumerate(out["periods"]) if i >= 1 and i not in evals]
  return {"periods": periods, "startup_s": out["t_first_step"] - res["t_launch"],
          "rss_mib": res["rss_mib"], "val_loss": out["val_loss"], "wall_s": res["wall_s"],
          "threads": out["threads"], "params": out["params"]}


def _load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def processor(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The processor's model and its vector units, from /proc/cpuinfo ("" elsewhere).

  The ratio depends on them: where AVX-512 is present, torch's products run the recipe's
  [768, 128] x [128, n] shapes about twice as fast as XLA's (benchmarks/README.md).
  """
  try:
    with open(cpuinfo, encoding="utf-8", errors="replace") as f:
      lines = f.read().splitlines()
  except OSError:
    return ""

  def first(key: str) -> str:  # the first processor's value (all list the same)
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith(key) and ":" in line), "")
  model, flags = first("model name"), set(first("flags").split())
  units = [u for u, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
           if flag in flags]
  return f"{model} ({', '.join(units) or 'no AVX2'})" if model else ""


def run_rounds(text: str, rounds: int, iters: int, legs: list[str], vocab: int,
               config: str = CONFIG, log=print) -> list[dict]:
  """R rounds of the legs in a rotating order; each round's results by leg."""
  warm = tempfile.mkdtemp(prefix="bench-nanogpt-warm-")
  try:
    if "sexpgpu" in legs:  # fills the warm caches (the legs' own count: what a user reruns)
      log(f"filling the warm caches: {leg_sexpgpu(text, iters, warm, config)['kernels']}")
    out = []
    for r in range(rounds):
      order = legs[r % len(legs):] + legs[:r % len(legs)]
      got = {}
      for leg in order:
        before = _load()
        if leg == "twin":
          got[leg] = leg_twin(text, iters, vocab)
        elif leg == "sexpgpu":
          got[leg] = leg_sexpgpu(text, iters, warm, config)
        else:
          with tempfile.TemporaryDirectory(prefix="bench-nanogpt-cold-") as cold:
            got[leg] = leg_sexpgpu(text, 1, cold, config)
        got[leg]["load"] = f"{before} → {_load()}"
        x = got[leg]
        ms = statistics.median(x["periods"]) * 1e3 if x["periods"] else float("nan")
        log(f"round {r + 1} {leg:8s} {ms:7.2f} ms/it  start-up {x['startup_s']:6.2f}s  "
            f"peak RSS {x['rss_mib']:6.0f} MiB  val {x['val_loss']:.4f}  load {x['load']}"
            + (f"  ({x['kernels']})" if x.get("kernels") else ""))
      out.append(got)
    return out
  finally:
    shutil.rmtree(warm, ignore_errors=True)


def _ratio_line(name: str, ratios: list[float]) -> str:
  return (f"{name:34s} {statistics.median(ratios):6.3f} "
          f"({min(ratios):.3f}..{max(ratios):.3f})")


def report(results: list[dict]) -> list[str]:
  """The per-leg medians and the paired ratios (sexpgpu ÷ twin, median over rounds)."""
  lines = []
  legs = list(results[0])
  for leg in legs:
    rs = [r[leg] for r in results]
    ms = "/".join(f"{statistics.median(x['periods']) * 1e3:.1f}" for x in rs if x["periods"])
    up = "/".join(f"{x['startup_s']:.2f}" for x in rs)
    rss = "/".join(f"{x['rss_mib']:.0f}" for x in rs)
    val = "/".join(f"{x['val_loss']:.4f}" for x in rs)
    lines.append(f"{leg:8s} ms/it {ms or '-'}  start-up {up} s  peak RSS {rss} MiB  val {val}")
  if "twin" not in legs:
    return lines

  def paired(leg, f):
    return [f(r[leg]) / f(r["twin"]) for r in results if leg in r]
  if "sexpgpu" in legs:
    timed = all(r[leg]["periods"] for r in results for leg in ("sexpgpu", "twin"))
    if timed:  # not under --startup: one iteration has no period
      lines.append(_ratio_line("ms/iteration sexpgpu ÷ twin",
                               paired("sexpgpu", lambda x: statistics.median(x["periods"]))))
    lines.append(_ratio_line("start-up warm sexpgpu ÷ twin",
                             paired("sexpgpu", lambda x: x["startup_s"])))
    lines.append(_ratio_line("peak RSS warm sexpgpu ÷ twin",
                             paired("sexpgpu", lambda x: x["rss_mib"])))
    d = [r["sexpgpu"]["val_loss"] - r["twin"]["val_loss"] for r in results]
    if timed:
      lines.append(f"{'val loss sexpgpu − twin':34s} {statistics.median(d):+.4f} "
                   f"({min(d):+.4f}..{max(d):+.4f})")
  if "cold" in legs:
    lines.append(_ratio_line("start-up cold sexpgpu ÷ twin",
                             paired("cold", lambda x: x["startup_s"])))
    lines.append(_ratio_line("peak RSS cold sexpgpu ÷ twin",
                             paired("cold", lambda x: x["rss_mib"])))
  return lines


def main(argv=None) -> int:
  """Prepares the text, runs the rounds, prints the table."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--iters", type=int, default=2000)
  ap.add_argument("--quick", action="store_true", help="300 iterations (the loss not compared)")
  ap.add_argument("--startup", action="store_true",
                  help="one iteration a leg: start-up and peak RSS only")
  ap.add_argument("--data", default=DATA, help="where the prepared text is (or is written)")
  ap.add_argument("--legs", default="twin,sexpgpu,cold")
  ap.add_argument("--config", default=CONFIG)
  ap.add_argument("--vocab", type=int, default=78, help="the config's vocab knob")
  ap.add_argument("--json", help="write the rounds' results here")
  args = ap.parse_args(argv)
  iters = 1 if args.startup else 300 if args.quick else args.iters
  text = prepare(args.data)
  legs = [x for x in args.legs.split(",") if x]
  print(f"bench_nanogpt: {args.rounds} rounds of {', '.join(legs)}, {iters} iterations, "
        f"{os.cpu_count()} cores ({processor() or 'processor unknown'}), load {_load()}")
  results = run_rounds(text, args.rounds, iters, legs, args.vocab, args.config)
  for line in report(results):
    print(line)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())

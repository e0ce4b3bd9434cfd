"""Fuzzes the front door: generated `.sx` files, flags and variables through `check` and `run`.

Each input is a mutated or random experiment (deep nesting, huge and non-finite numbers,
bad encodings, stray brackets) with random `--set`, `--steps`, `--eval-every`, `--variant`
and variable values, fed to `sexpgpu check` (and a share of them to `sexpgpu run --steps 1`)
in this process. A finding is: an exception other than SxError escaping, an exit status
other than 0 or 1, an exit 1 without an `error[E-...]` line, a traceback on standard
error, or a run that exits 0 with a non-finite loss in its summary.

    python benchmarks/fuzz.py --count 10000 --runs 50 --seed 1

prints the count, the time and each finding (exit 1 when there is one).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = [os.path.join(ROOT, "configs", n) for n in ("tiny-lm.sx", "classifier.sx", "char-lm.sx")]
SEEDS += [os.path.join(ROOT, "tests", "sx", n) for n in ("ok_tiny.sx", "ok_curr_lr.sx",
                                                        "ok_variant_set.sx")]

NUMBERS = ["0", "-0", "1", "-1", "2", "3", "7", "43", "-5", "0.0", "-0.5", "1e-9", "1e30",
           "1e308", "1e309", "1e400", "-1e400", "1e-400", "99999999999999999999",
           "-99999999999999999999", "9223372036854775807", "9223372036854775808", "nan", "inf",
           "-inf", "NaN", "1_000", "0x10", "1.5.5", "4294967296", "65536"]
TOKENS = NUMBERS + ["(", ")", "[", "]", '"', '"s"', ":", ":batch", ":lr", ":init", ":heads",
                    "nil", "true", "false", "x", "relu", "matmul", "dense", "let", "fn", "if",
                    "repeat", "param", "defn", "defknob", "#;", ";", "\\", "\ufeff", "\x00",
                    "é", "∑", "{", "}", "'", "`", "@", "#"]
BAD_BYTES = [b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf"]
KNOBS = ["lr", "width", "heads", "layers", "seq", "vocab", "steps", "seed", "microbatches",
         "precision", "on-nan", "keep", "checkpoint-every", "hidden", "nope", ""]
VARIANTS = ["smoke", "nope", "", "smoke smoke"]
# Variables this fuzz sets (the device and node variables are another suite's).
VARIABLES = {
    "SEXPGPU_PATTERNS": ["on", "off", "maybe", ""],
    "SEXPGPU_STACKING": ["auto", "1", "2", "0", "-3", "x", "99999999999999999999"],
    "SEXPGPU_RUN_SLUG": ["a", "../x", "é", "a b", ""],
    "SEXPGPU_MEMORY": ["40GiB", "1", "-1GiB", "lots", "1e400GiB"],
}


def _mutate(rng: random.Random, data: bytes) -> bytes:
  for _ in range(rng.randint(1, 4)):
    i = rng.randrange(len(data) + 1)
    j = min(len(data), i + rng.randint(0, 40))
    choice = rng.random()
    if choice < 0.25:
      data = data[:i] + data[j:]  # delete a span
    elif choice < 0.4:
      data = data[:i] + data[i:j] * rng.randint(2, 4) + data[j:]  # repeat a span
    elif choice < 0.55:
      data = data[:i] + rng.choice(BAD_BYTES) + data[i:]
    else:
      tok = rng.choice(TOKENS)
      data = data[:i] + (" " + tok + " ").encode("utf-8") + data[i:]
  return data


def _numbers(rng: random.Random, text: str) -> str:
  """Replaces some numeric literals with extreme ones."""
  out = []
  for tok in text.split(" "):
    if tok[:1].isdigit() and rng.random() < 0.3:
      tok = rng.choice(NUMBERS)
    out.append(tok)
  return " ".join(out)


def _deep(rng: random.Random, seed_text: str) -> bytes:
  n = rng.choice([10, 200, 999, 1000, 1001, 3000])
  kind = rng.random()
  if kind < 0.4:
    return ("(def x " + "(" * n + ")" * n + ")").encode()
  if kind < 0.7:
    expr = "(lm (lm-inputs t))"
    wrapped = "(relu " * n + expr + ")" * n
    return seed_text.replace(expr, wrapped, 1).encode()
  return ("[" * n + "1" + "]" * (n - rng.randint(0, 2))).encode()


def generate(rng: random.Random, seeds: dict[str, str], light: bool = False
             ) -> tuple[bytes, list[str], dict]:
  """One input: (file bytes, flags after the file, variables).

  Args:
    light: only the flags, variables and numbers change (an input that mostly compiles:
      what a run is fed).
  """
  name = rng.choice(list(seeds))
  text = seeds[name]
  r = rng.choice([0.1, 0.1, 0.7]) if light else rng.random()  # light: as is, or numbers
  if r < 0.25:
    data = text.encode()  # the flags and variables are the input
  elif r < 0.55:
    data = _mutate(rng, text.encode())
  elif r < 0.75:
    data = text.encode() if r < 0.65 else _numbers(rng, text).encode()
  elif r < 0.8:
    data = _deep(rng, text)
  elif r < 0.9:
    data = " ".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 60))).encode("utf-8")
  else:
    data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
  flags: list[str] = []
  if light:  # a run: at most one numeric knob, often an extreme one
    if rng.random() < 0.7:
      flags = ["--set", f"{rng.choice(['lr', 'width', 'seed', 'layers'])}={rng.choice(NUMBERS)}"]
    return data, flags, {}
  for _ in range(rng.choice([0, 0, 1, 2, 3])):
    flags += ["--set", f"{rng.choice(KNOBS)}={rng.choice(NUMBERS + ['f32', 'bf16', 'x', ''])}"]
  if rng.random() < 0.3:
    flags += ["--variant", rng.choice(VARIANTS)]
  if rng.random() < 0.15:
    flags += ["--steps", rng.choice(NUMBERS)]
  if rng.random() < 0.15:
    flags += ["--eval-every", rng.choice(NUMBERS)]
  if rng.random() < 0.05:
    flags += ["--diagnostics", rng.choice(["all", "nope", ",", ""])]
  env = {}
  if rng.random() < 0.2:
    var = rng.choice(list(VARIABLES))
    env[var] = rng.choice(VARIABLES[var])
  return data, flags, env


@contextlib.contextmanager
def _environ(env: dict):
  old = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


# (command, exit status) → how many inputs ended so.
OUTCOMES: dict[tuple[str, int], int] = {}


def feed(path: str, argv: list[str], env: dict) -> str | None:
  """Runs `sexpgpu ARGV` in this process on one input; returns a finding, or None."""
  from sexpgpu.cli.main import main
  out, err = io.StringIO(), io.StringIO()
  try:
    with _environ(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      code = main(argv)
  except BaseException as e:  # noqa: BLE001 - any escape is the finding
    return f"{type(e).__name__}: {e}"[:300]
  OUTCOMES[(argv[0], code)] = OUTCOMES.get((argv[0], code), 0) + 1
  text = err.getvalue()
  if "Traceback" in text:
    return "a traceback on standard error: " + text[-300:]
  if code not in (0, 1):
    return f"exit {code}"
  if code == 1 and "error[E-" not in text:
    return "exit 1 without an error code: " + text[-300:]
  if code == 0 and argv[0] == "run":
    line = out.getvalue().strip().splitlines()[-1:] or [""]
    try:
      s = json.loads(line[0])
    except ValueError:
      return "run: no JSON summary"
    values = [v for v in [s.get("train_loss")] + list((s.get("eval") or {}).values())
              if v is not None]
    if any(not math.isfinite(v) for v in values):
      if "nan" not in text and "inf" not in text:
        return f"run exit 0 with a non-finite loss, unannounced: {s}"
  return None


def fuzz(count: int, runs: int, seed: int, folder: str) -> tuple[int, list[str]]:
  """Feeds `count` inputs through check, `runs` of them through run --steps 1.

  Returns:
    (inputs fed, findings as "input N (args): what").
  """
  rng = random.Random(seed)
  seeds = {p: open(p, encoding="utf-8").read() for p in SEEDS}
  for p in seeds:  # relative requires and data of the seeds resolve beside the copies
    for sub in ("data", "lib"):
      src = os.path.join(os.path.dirname(p), sub)
      dst = os.path.join(folder, sub)
      if os.path.isdir(src) and not os.path.exists(dst):
        os.symlink(src, dst)
  findings = []
  run_every = max(1, count // max(runs, 1)) if runs else 0
  for i in range(count):
    runs_it = bool(run_every) and i % run_every == 0
    data, flags, env = generate(rng, seeds, light=runs_it)
    path = os.path.join(folder, f"in{i % 50}.sx")
    with open(path, "wb") as f:
      f.write(data)
    argv = ["check", path] + flags
    if runs_it:
      argv = ["run", path, "--json"] + flags + ["--steps", "1", "--eval-every", "0"]
    found = feed(path, argv, env)
    if found:
      keep = os.path.join(folder, f"finding{len(findings)}.sx")
      with open(keep, "wb") as f:
        f.write(data)
      findings.append(f"input {i} ({keep} {' '.join(argv[2:])} {env}): {found}")
  return count, findings


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--count", type=int, default=10000)
  ap.add_argument("--runs", type=int, default=50)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--keep", default=None, help="folder for the inputs and findings")
  args = ap.parse_args()
  folder = args.keep or tempfile.mkdtemp(prefix="sexpgpu-fuzz-")
  os.makedirs(folder, exist_ok=True)
  os.environ.setdefault("SEXPGPU_CACHE_DIR", os.path.join(folder, "cache"))
  t0 = time.perf_counter()
  n, findings = fuzz(args.count, args.runs, args.seed, folder)
  dt = time.perf_counter() - t0
  print(f"fuzz: {n} inputs ({args.runs} through run --steps 1) in {dt:.1f}s, "
        f"{len(findings)} findings; inputs in {folder}")
  print("  outcomes: " + ", ".join(f"{c} exit {k}: {v}" for (c, k), v in sorted(OUTCOMES.items())))
  for f in findings:
    print("  " + f)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())

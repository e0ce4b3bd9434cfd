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
import glob
import io
import json
import math
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a run is fed: small experiments that train a step in well under a second.
RUN_SEEDS = [os.path.join(ROOT, "configs", n) for n in ("tiny-lm.sx", "classifier.sx",
                                                        "char-lm.sx")]
RUN_SEEDS += [os.path.join(ROOT, "tests", "sx", n) for n in ("ok_tiny.sx", "ok_curr_lr.sx",
                                                            "ok_variant_set.sx")]
# What check is fed: every `.sx` of the repository (its configs, examples and fixtures).
SEEDS = sorted({p for pattern in ("configs/*.sx", "examples/**/*.sx", "tests/sx/*.sx",
                                  "tests/data/*.sx")
                for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)} | set(RUN_SEEDS))
# A marker of a credential: no output, status file or metrics file may ever hold it.
SECRET = "SXFUZZSECRET42"
LONG = "9" * 4301  # past Python's 4,300-digit limit on int()

NUMBERS = ["0", "-0", "1", "-1", "2", "3", "7", "43", "-5", "0.0", "-0.5", "1e-9", "1e30",
           "1e308", "1e309", "1e400", "-1e400", "1e-400", "99999999999999999999",
           "-99999999999999999999", "9223372036854775807", "9223372036854775808", "nan", "inf",
           "-inf", "NaN", "1_000", "0x10", "1.5.5", "4294967296", "65536", LONG, "-" + LONG,
           "2147483647", "2147483648", "4294967295", "4294967297", "131072", "131073",
           "0" * 5000 + "7"]
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
    "SEXPGPU_STACKING": ["auto", "1", "2", "3", "0", "-3", "x", "99999999999999999999", LONG],
    "SEXPGPU_RUN_SLUG": ["a", "../x", "é", "a b", "", "..", ".", "a/b", "a\\b", "\udcff",
                         "x" * 300],
    "SEXPGPU_MEMORY": ["40GiB", "1", "-1GiB", "lots", "1e400GiB", LONG + "GiB"],
    "SEXPGPU_NODES": ["1", "0", "x", LONG],
    "SEXPGPU_DEVICES": ["0", "0,0", "x", LONG],
    "SEXPGPU_PROFILE": ["1..2", "2..1", LONG, "1.." + LONG],
    "SEXPGPU_REMOTE_TIMEOUT": ["5", "0", "-1", "nan", "inf", LONG],
    "SEXPGPU_CACHE_DIR": ["/proc/self", "/proc/version/x", "/etc/passwd", "\udcff\udcfe",
                          f"s3://KEY:{SECRET}@bucket/cache"],
    "SEXPGPU_METRICS": ["jsonl:s3://bucket/m.jsonl", f"mlflow:http://u:{SECRET}@127.0.0.1:9",
                        "nope:x", ""],
}
# Flags whose value is a location: a run must write there or refuse, and never show a secret.
LOCATIONS = {
    "--metrics": ["jsonl:s3://bucket/m.jsonl", f"jsonl:s3://K:{SECRET}@bucket/m.jsonl",
                  "tensorboard:gs://bucket/tb", ""],
    "--status": ["s3://bucket/s.json", f"s3://K:{SECRET}@bucket/s.json", ""],
    "--checkpoint-dir": ["", "\udcff", f"gs://K:{SECRET}@bucket/p"],
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
  names = [n for n in seeds if n in RUN_SEEDS] if light else list(seeds)
  name = rng.choice(names or list(seeds))
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
  if light:  # a run: at most one numeric knob, often an extreme one (so at times none,
    # and the run trains: most extreme values are refused, as they should be)
    if rng.random() < 0.4:
      flags = ["--set", f"{rng.choice(['lr', 'width', 'seed', 'layers'])}={rng.choice(NUMBERS)}"]
    if rng.random() < 0.2:
      flag = rng.choice(sorted(LOCATIONS))
      value = rng.choice(LOCATIONS[flag])
      if value:
        flags += [flag, value]
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
  if SECRET in text or SECRET in out.getvalue():
    return "a secret of a URI in the output: " + (text + out.getvalue())[-300:]
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


DAMAGES = ("removed", "truncated", "flipped", "emptied")


def _damage(path: str, how: str) -> None:
  if how == "removed":
    os.unlink(path)
    return
  with open(path, "rb") as f:
    data = bytearray(f.read())
  if how == "truncated":
    data = data[:len(data) // 2]
  elif how == "flipped" and data:
    data[len(data) // 2] ^= 0x01
  elif how == "emptied":
    data = bytearray()
  with open(path, "wb") as f:
    f.write(bytes(data))


def fuzz_checkpoints(folder: str, restore: bool = True, limit: int | None = None
                     ) -> tuple[int, list[str]]:
  """Each file of a real checkpoint removed, truncated, flipped or emptied, one at a time.

  Two steps are saved; the newer one is damaged. `--resume latest` must fall back to the
  older one with a `checkpoint: skipped` line naming the newer, and (with `restore`)
  reading the damaged step itself must be E-CKPT-003: never the damaged data, another
  exception, or a silent fresh start.

  Returns:
    (cases, findings).
  """
  import shutil  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from sexpgpu.ckpt import CheckpointStore, resolve_resume, restore_checkpoint
  from sexpgpu.errors import SxError
  state = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "pos": np.int64(3)}
  base = os.path.join(folder, "ckpt-base")
  with CheckpointStore(base, "run", keep=5) as store:
    for step in (1, 2):
      store.save(step, state, {"step": step}, wait=True)
  newer = os.path.join(base, "run", "2")
  files = sorted(os.path.relpath(os.path.join(r, n), newer)
                 for r, _, ns in os.walk(newer) for n in ns)
  cases = [(rel, how) for rel in files for how in DAMAGES
           if not (how == "flipped" and os.path.getsize(os.path.join(newer, rel)) == 0)]
  findings = []
  for k, (rel, how) in enumerate(cases[:limit]):
    trial = os.path.join(folder, f"ckpt-{k}")
    shutil.copytree(base, trial)
    step_dir = os.path.join(trial, "run", "2")
    _damage(os.path.join(step_dir, rel), how)
    err = io.StringIO()
    try:
      with contextlib.redirect_stderr(err):
        found, _ = resolve_resume("latest", trial, "run")
      if found != os.path.join(trial, "run", "1"):
        findings.append(f"{rel} {how}: --resume latest chose {found}")
      elif f"checkpoint: skipped {step_dir}" not in err.getvalue():
        findings.append(f"{rel} {how}: the fallback printed no skipped line")
      if restore:
        try:
          restore_checkpoint(step_dir, state)
          findings.append(f"{rel} {how}: the damaged step restored")
        except SxError as e:
          if e.code != "E-CKPT-003":
            findings.append(f"{rel} {how}: restore is {e.code}")
    except SxError as e:
      findings.append(f"{rel} {how}: {e.code} {e.message[:200]}")
    except BaseException as e:  # noqa: BLE001 - any escape is the finding
      findings.append(f"{rel} {how}: {type(e).__name__}: {e}"[:300])
    shutil.rmtree(trial, ignore_errors=True)
  return len(cases[:limit]), findings


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--count", type=int, default=10000)
  ap.add_argument("--runs", type=int, default=50)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--keep", default=None, help="folder for the inputs and findings")
  ap.add_argument("--checkpoints", action="store_true",
                  help="also damage each file of a real checkpoint, one at a time")
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
  if args.checkpoints:
    cases, more = fuzz_checkpoints(folder)
    print(f"fuzz: {cases} damaged checkpoints, {len(more)} findings")
    findings += more
  for f in findings:
    print("  " + f)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())

"""Fuzzes the front door: generated `.sx` files, flags and variables through `check` and `run`.

Each input is a mutated or random experiment (deep nesting, huge and non-finite numbers,
bad encodings, stray brackets, values known to be invalid) with random flags (`--set`,
`--steps`, `--eval-every`, `--variant`, locations, a flag where a value belongs) and
`SEXPGPU_*` variables, fed to `sexpgpu check` (and a share of them to `sexpgpu run --steps 1`).
A finding is: an exception other than SxError escaping, an exit status other than 0 or 1, an
exit 1 without an `error[E-...]` line, a traceback on standard error, a secret of a URI or
the environment in any output or written file, an exit 0 although the input holds a value
known to be invalid, a run that exits 0 with a non-finite loss in its summary, an input that
hangs past 60 s, or one that aborts the process.

In-process inputs run in a worker process that the supervisor restarts past an input that
hangs or kills it; `--cli N` feeds N more through the `sexpgpu` command in a fresh process
each. Input i of seed S is generated from (S, i) alone, so any finding is replayed by
`--seed S --start i --count i+1`.

    python benchmarks/fuzz.py --count 20000 --runs 50 --seed 1 --cli 500

prints the counts, the time and each finding (exit 1 when there is one).
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
import re
import select
import signal
import subprocess
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
# Every SEXPGPU_* variable, with ordinary and invalid values (INVALID_VARIABLES marks those a
# run must refuse). Variables that make a run wait for other nodes are fed to check only.
VARIABLES = {
    "SEXPGPU_PATTERNS": ["on", "off", "maybe", ""],
    "SEXPGPU_TRUST_PYTHON": ["1", "0", "yes"],
    "SEXPGPU_STACKING": ["auto", "1", "2", "3", "0", "-3", "x", "99999999999999999999", LONG],
    "SEXPGPU_RUN_SLUG": ["a", "../x", "é", "a b", "", "..", ".", "a/b", "a\\b", "\udcff",
                         "x" * 300],
    "SEXPGPU_MEMORY": ["40GiB", "1", "-1GiB", "lots", "1e400GiB", LONG + "GiB"],
    "SEXPGPU_NODES": ["1", "0", "x", LONG],
    "SEXPGPU_NODE_RANK": ["0", "-1", "x", LONG],
    "SEXPGPU_RENDEZVOUS": ["127.0.0.1:1", "nohost", ":", "h:99999"],
    "SEXPGPU_NODE_GRADIENTS": ["bf16", "f32", "f16", ""],
    "SEXPGPU_DEVICES": ["0", "0,0", "x", LONG],
    "SEXPGPU_DEVICE": ["cpu", "gpu", ""],  # (an environment cannot hold a NUL)
    "SEXPGPU_PROFILE": ["1..2", "2..1", LONG, "1.." + LONG],
    "SEXPGPU_PROFILE_DIR": ["\udcff", "/proc/version/x"],
    "SEXPGPU_REMOTE_TIMEOUT": ["5", "0", "-1", "nan", "inf", LONG],
    "SEXPGPU_RENDEZVOUS_TIMEOUT": ["5", "-1", "nan", LONG],
    "SEXPGPU_CACHE_DIR": ["/proc/self", "/proc/version/x", "/etc/passwd", "\udcff\udcfe",
                          f"s3://KEY:{SECRET}@bucket/cache"],
    "SEXPGPU_METRICS": ["jsonl:s3://bucket/m.jsonl", f"mlflow:http://u:{SECRET}@127.0.0.1:9",
                        "nope:x", ""],
    "SEXPGPU_STATUS": [f"s3://K:{SECRET}@bucket/s.json", "/proc/version/x", ""],
    "SEXPGPU_CHECKPOINT_DIR": [f"gs://K:{SECRET}@bucket/p", "\udcff", ""],
    "SEXPGPU_RESUME": ["latest", "nope", f"s3://K:{SECRET}@127.0.0.1:9/x"],
    "SEXPGPU_INIT_FROM": ["nope.safetensors", "hf:/nope", ""],
    "SEXPGPU_DETERMINISTIC": ["1", "0", "yes", "2"],
    "SEXPGPU_CPU_COLLECTIVES": ["gloo", "mpi"],
    "SEXPGPU_DECODE": ["recompute", "fast"],
    "SEXPGPU_DEBUG": ["0", "2"],
}
INVALID_VARIABLES = {
    "SEXPGPU_TRUST_PYTHON": {"yes"},
    "SEXPGPU_PATTERNS": {"maybe"}, "SEXPGPU_STACKING": {"0", "-3", "x", "99999999999999999999",
                                                        LONG},
    "SEXPGPU_RUN_SLUG": {"../x", "..", ".", "a/b", "a\\b", "x" * 300},
    "SEXPGPU_MEMORY": {"-1GiB", "lots", "1e400GiB", LONG + "GiB"},
    "SEXPGPU_NODES": {"0", "x", LONG}, "SEXPGPU_DEVICES": {"x", LONG},
    "SEXPGPU_PROFILE": {"2..1", LONG, "1.." + LONG},
    "SEXPGPU_REMOTE_TIMEOUT": {"-1", "nan", LONG},
    "SEXPGPU_CACHE_DIR": {"/proc/self", "/proc/version/x", "/etc/passwd", "\udcff\udcfe",
                          f"s3://KEY:{SECRET}@bucket/cache"},
    "SEXPGPU_METRICS": {"jsonl:s3://bucket/m.jsonl", "nope:x"},
    "SEXPGPU_DEVICE": {"gpu"},
    "SEXPGPU_DETERMINISTIC": {"yes", "2"}, "SEXPGPU_CPU_COLLECTIVES": {"mpi"},
    "SEXPGPU_DECODE": {"fast"}, "SEXPGPU_NODE_GRADIENTS": {"f16"},
}
# Variables a one-step run may be given (the others make it wait on other nodes or devices).
RUN_VARIABLES = ("SEXPGPU_PATTERNS", "SEXPGPU_STACKING", "SEXPGPU_RUN_SLUG", "SEXPGPU_MEMORY",
                 "SEXPGPU_PROFILE", "SEXPGPU_REMOTE_TIMEOUT", "SEXPGPU_CACHE_DIR",
                 "SEXPGPU_METRICS", "SEXPGPU_STATUS", "SEXPGPU_DETERMINISTIC", "SEXPGPU_DECODE")
# Edits of an experiment that make it invalid whatever else changes: (what the seed holds,
# what replaces it). A check or run of such a file must not exit 0.
INVALID_EDITS = [
    (":warmup 20", ":warmup -5"), (":warmup 20", ":warmup -9223372036854775808"),
    (":warmup 20", ":warmup 2.5"), ("(adamw :lr lr", "(adamw :lr -1"),
    ("(adamw :lr lr", "(adamw :b1 1 :lr lr"), ("(adamw :lr lr", "(adamw :eps \"x\" :lr lr"),
    ("(adamw :lr lr", "(adamw :lr (warmup-cosine :peak lr :steps 0)"),
    (":seq (+ seq 1)", ":seq 2147483648"), (":seq (+ seq 1)", ":seq 0"),
    (":batch 4", ":batch 4294967296"), (":batch 4", ":batch -4"),
    ("(defknob vocab 32", "(defknob vocab 4294967296"),
    ("(defknob layers 2", "(defknob layers 4294967296"),
    ("(require std/lm)", "", "next-token-loss"), ("(require std/nn)", "(require std/nn)\n(require std/nope)"),
    (":steps 20", ":steps -1"), (":microbatches 2", ":microbatches 0"),
    ("(defrun", "(defrun :seed 1 :seed 2"),
    ("(defknob experts-per-token 2", "(defknob top-k 2", "top-k"),
]
# Values an integer flag (--steps, --eval-every) must refuse.
_COUNT = re.compile(r"[+-]?[0-9]{1,30}")


def _invalid_count(value: str) -> bool:
  return not _COUNT.fullmatch(value) or not 0 <= int(value) < 2**31


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


def _edit(rng: random.Random, text: str) -> tuple[str, str | None]:
  """The text with one INVALID_EDITS edit that applies to it, and the edit; else unchanged."""
  edits = [e for e in INVALID_EDITS if e[0] in text and (len(e) < 3 or e[2] in text)]
  if not edits:
    return text, None
  e = rng.choice(edits)
  return text.replace(e[0], e[1], 1), f"{e[0]!r} → {e[1]!r}"


def _flags(rng: random.Random, invalid: list[str]) -> list[str]:
  flags: list[str] = []
  for _ in range(rng.choice([0, 0, 1, 2, 3])):
    knob, value = rng.choice(KNOBS), rng.choice(NUMBERS + ["f32", "bf16", "x", ""])
    flags += ["--set", f"{knob}={value}"]
    if knob in ("nope", ""):
      invalid.append(f"--set {knob}={value}")
  if rng.random() < 0.3:
    v = rng.choice(VARIANTS)
    flags += ["--variant", v]
    if v in ("nope", "", "smoke smoke"):
      invalid.append(f"--variant {v!r}")
  for flag in ("--steps", "--eval-every"):
    if rng.random() < 0.15:
      v = rng.choice(NUMBERS + ["-h", "--help", "--json", "+3", "007"])
      flags += [flag, v]
      if _invalid_count(v) and v != "-0":
        invalid.append(f"{flag} {v[:20]}")
  if rng.random() < 0.05:
    flags += ["--diagnostics", rng.choice(["all", "nope", ",", ""])]
  return flags


def generate(rng: random.Random, seeds: dict[str, str], light: bool = False
             ) -> tuple[bytes, list[str], dict, list[str]]:
  """One input: (file bytes, flags after the file, variables, what in it is invalid).

  Args:
    light: only the flags, variables and numbers change (an input that mostly compiles:
      what a run is fed).

  Returns:
    The last item names each value the input holds that a check or run must refuse
    (empty when the input may be valid or its validity is not known).
  """
  names = [n for n in seeds if n in RUN_SEEDS] if light else list(seeds)
  name = rng.choice(names or list(seeds))
  text = seeds[name]
  invalid: list[str] = []
  r = rng.choice([0.1, 0.1, 0.6, 0.7]) if light else rng.random()  # light: as is, edits, numbers
  if r < 0.25:
    data = text.encode()  # the flags and variables are the input
  elif r < 0.55:
    data = _mutate(rng, text.encode())
  elif r < 0.65:
    edited, what = _edit(rng, text)
    data = edited.encode()
    if what:
      invalid.append(what)
  elif r < 0.75:
    data = _numbers(rng, text).encode()
  elif r < 0.8:
    data = _deep(rng, text)
  elif r < 0.9:
    data = " ".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 60))).encode("utf-8")
  else:
    data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
  env: dict = {}
  if light:  # a run: at most one numeric knob, often an extreme one (so at times none,
    # and the run trains: most extreme values are refused, as they should be)
    flags: list[str] = []
    if rng.random() < 0.4:
      flags = ["--set", f"{rng.choice(['lr', 'width', 'seed', 'layers'])}={rng.choice(NUMBERS)}"]
    if rng.random() < 0.2:
      flag = rng.choice(sorted(LOCATIONS))
      value = rng.choice(LOCATIONS[flag])
      if value:
        flags += [flag, value]
    if rng.random() < 0.15:
      var = rng.choice(RUN_VARIABLES)
      env[var] = rng.choice(VARIABLES[var])
      if env[var] in INVALID_VARIABLES.get(var, ()):
        invalid.append(f"{var}={env[var][:30]!r}")
    return data, flags, env, invalid
  flags = _flags(rng, invalid)
  if rng.random() < 0.2:
    var = rng.choice(list(VARIABLES))
    env[var] = rng.choice(VARIABLES[var])
    if env[var] in INVALID_VARIABLES.get(var, ()):
      invalid.append(f"{var}={env[var][:30]!r}")
  return data, flags, env, invalid


def case_rng(seed: int, i: int) -> random.Random:
  """Input i of seed `seed`: generated from the two alone, so that it can be replayed."""
  return random.Random(seed * 1_000_003 + i)


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


def _judge(argv: list[str], code: int, out: str, err: str, invalid: list[str]) -> str | None:
  """The oracle: what is wrong with how `sexpgpu ARGV` ended, or None."""
  if SECRET in err or SECRET in out:
    return "a secret of a URI in the output: " + (err + out)[-300:]
  if "Traceback" in err:
    return "a traceback on standard error: " + err[-300:]
  if code not in (0, 1):
    return f"exit {code}: " + err[-300:]
  if code == 1 and "error[E-" not in err:
    return "exit 1 without an error code: " + err[-300:]
  if code == 0 and invalid:
    return "exit 0 although the input holds an invalid value: " + "; ".join(invalid)
  if code == 0 and argv[0] == "run":
    line = out.strip().splitlines()[-1:] or [""]
    try:
      s = json.loads(line[0])
    except ValueError:
      return "run: no JSON summary"
    values = [v for v in [s.get("train_loss")] + list((s.get("eval") or {}).values())
              if v is not None]
    if any(not math.isfinite(v) for v in values):
      if "nan" not in err and "inf" not in err:
        return f"run exit 0 with a non-finite loss, unannounced: {s}"
  return None


def _secret_in_files(folder: str, since: float) -> str | None:
  """A file under `folder` written since `since` that holds SECRET (a status or metrics file)."""
  for root, _, names in os.walk(folder):
    for n in names:
      path = os.path.join(root, n)
      try:
        if os.path.getmtime(path) < since or os.path.getsize(path) > 50_000_000:
          continue
        with open(path, "rb") as f:
          if SECRET.encode() in f.read():
            return path
      except OSError:
        continue
  return None


def feed(path: str, argv: list[str], env: dict, invalid: list[str] = ()) -> str | None:
  """Runs `sexpgpu ARGV` in this process on one input; returns a finding, or None."""
  from sexpgpu.cli.main import main
  out, err = io.StringIO(), io.StringIO()
  since = time.time() - 1
  try:
    with _environ(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      code = main(argv)
  except BaseException as e:  # noqa: BLE001 - any escape is the finding
    return f"{type(e).__name__}: {e}"[:300]
  OUTCOMES[(argv[0], code)] = OUTCOMES.get((argv[0], code), 0) + 1
  found = _judge(argv, code, out.getvalue(), err.getvalue(), list(invalid))
  if found is None and argv[0] == "run":
    leaked = _secret_in_files(os.path.dirname(path), since)
    if leaked:
      found = f"a secret of a URI in a written file: {leaked}"
  return found


def _prepare(folder: str) -> dict[str, str]:
  """The seeds' texts; relative requires and data of the seeds resolve beside the copies."""
  seeds = {p: open(p, encoding="utf-8").read() for p in SEEDS}
  for p in seeds:
    for sub in ("data", "lib"):
      src = os.path.join(os.path.dirname(p), sub)
      dst = os.path.join(folder, sub)
      if os.path.isdir(src) and not os.path.exists(dst):
        os.symlink(src, dst)
  return seeds


def _argv(i: int, count: int, runs: int, path: str, flags: list[str]) -> tuple[list[str], bool]:
  run_every = max(1, count // max(runs, 1)) if runs else 0
  if run_every and i % run_every == 0:
    return ["run", path, "--json"] + flags + ["--steps", "1", "--eval-every", "0"], True
  return ["check", path] + flags, False


def fuzz(count: int, runs: int, seed: int, folder: str, start: int = 0,
         report=None, stall: frozenset = frozenset()) -> tuple[int, list[str]]:
  """Feeds inputs start..count-1 through check, about `runs` of all `count` through run.

  Args:
    report: a text stream told `start I` before input I and `done I SECONDS` after it,
      for the supervisor that restarts this process past a hang.
    stall: inputs at which to stop for ever after `start I`: a hang for the supervisor's
      restart to be rehearsed on, whatever the machine's speed.

  Returns:
    (inputs fed, findings as "input N (args): what").
  """
  seeds = _prepare(folder)
  findings = []
  for i in range(start, count):
    if report is not None:
      report.write(f"start {i}\n")
      report.flush()
    while i in stall:
      time.sleep(3600)
    t0 = time.perf_counter()
    rng = case_rng(seed, i)
    _, light = _argv(i, count, runs, "", [])
    data, flags, env, invalid = generate(rng, seeds, light=light)
    path = os.path.join(folder, f"in{i % 50}.sx")
    with open(path, "wb") as f:
      f.write(data)
    argv, _ = _argv(i, count, runs, path, flags)
    before = dict(OUTCOMES)
    found = feed(path, argv, env, invalid)
    ended = next((f"{c}-{k}" for (c, k), v in OUTCOMES.items() if before.get((c, k), 0) != v),
                 f"{argv[0]}-escaped")
    if found:
      keep = os.path.join(folder, f"finding{seed}-{i}.sx")
      with open(keep, "wb") as f:
        f.write(data)
      findings.append(f"input {i} ({keep} {' '.join(argv[2:])[:300]} {env}): {found}")
      if report is not None:
        report.write("finding " + json.dumps(findings[-1]) + "\n")
    if report is not None:
      report.write(f"done {i} {ended} {time.perf_counter() - t0:.2f}\n")
      report.flush()
  return count - start, findings


def _rss_bytes(pid: int) -> int:
  """The resident memory of a process and its children (their VmRSS), 0 when gone."""
  total = 0
  pids = [pid]
  try:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
      pids += [int(x) for x in f.read().split()]
  except OSError:
    pass
  for p in pids:
    try:
      with open(f"/proc/{p}/status", encoding="ascii") as f:
        for line in f:
          if line.startswith("VmRSS:"):
            total += int(line.split()[1]) * 1024
    except OSError:
      pass
  return total


def supervise(count: int, runs: int, seed: int, folder: str, hang_s: float = 60.0,
              memory_bytes: int = 6 << 30, log=None, stall: tuple[int, ...] = ()) -> dict:
  """Runs fuzz() in a worker process, restarted past any input that hangs, aborts or grows
  past `memory_bytes`.

  `stall` makes the worker hang at those inputs (fuzz()'s `stall`), to rehearse the restart.

  Returns:
    {"fed", "findings", "outcomes", "restarts", "slowest": (seconds, input), "peak_rss"}.
  """
  findings: list[str] = []
  outcomes: dict[str, int] = {}
  slowest, peak, restarts, fed = (0.0, -1), 0, 0, 0
  i = 0
  worker_log = open(os.path.join(folder, "worker.log"), "ab")  # pylint: disable=consider-using-with
  while i < count:
    r, w = os.pipe()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(seed), "--start",
           str(i), "--count", str(count), "--runs", str(runs), "--keep", folder,
           "--report-fd", str(w)] + (["--stall", ",".join(map(str, stall))] if stall else [])
    proc = subprocess.Popen(cmd, pass_fds=(w,), stdout=worker_log, stderr=worker_log,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    os.close(w)
    reader = os.fdopen(r, "r", encoding="utf-8")
    current, last, buf = None, time.monotonic(), ""
    why = None
    while True:
      ready, _, _ = select.select([reader], [], [], 1.0)
      if ready:
        chunk = os.read(r, 65536).decode("utf-8", "replace")
        if not chunk:
          break
        buf += chunk
        *lines, buf = buf.split("\n")
        for line in lines:
          kind, _, rest = line.partition(" ")
          if kind == "start":
            current, last = int(rest), time.monotonic()
          elif kind == "finding":
            findings.append(json.loads(rest))
            if log is not None:
              log.write(f"fuzz: finding: {findings[-1]}\n")
              log.flush()
          elif kind == "done":
            n, command, secs = rest.split()
            fed += 1
            command = command.replace("-", " exit ")
            outcomes[command] = outcomes.get(command, 0) + 1
            if float(secs) > slowest[0]:
              slowest = (float(secs), int(n))
            current, i = None, int(n) + 1
            if log is not None and fed % 1000 == 0:
              log.write(f"fuzz: {fed} fed, {len(findings)} findings, {restarts} restarts\n")
              log.flush()
      rss = _rss_bytes(proc.pid)
      peak = max(peak, rss)
      if current is not None and time.monotonic() - last > hang_s:
        why = f"hang past {hang_s:.0f} s"
      elif rss > memory_bytes:
        why = f"memory past {memory_bytes >> 30} GiB ({rss >> 20} MiB)"
      if why:
        os.killpg(proc.pid, signal.SIGKILL)
        break
    proc.wait()
    reader.close()
    if why is None and proc.returncode != 0 and current is not None:
      why = f"the process died (status {proc.returncode}) on it"
    if why is not None:
      stuck = current if current is not None else i
      findings.append(f"input {stuck} (seed {seed}; replay: --seed {seed} --start {stuck} "
                      f"--count {stuck + 1} --runs 0): {why}")
      if log is not None:
        log.write(f"fuzz: finding: {findings[-1]}\n")
        log.flush()
      i, restarts, fed = stuck + 1, restarts + 1, fed + 1
    elif proc.returncode != 0:
      findings.append(f"the worker ended with status {proc.returncode} between inputs")
      i, restarts = i + 1, restarts + 1
  worker_log.close()
  return {"fed": fed, "findings": findings, "outcomes": outcomes, "restarts": restarts,
          "slowest": slowest, "peak_rss": peak}


def fuzz_cli(count: int, seed: int, folder: str, timeout_s: float = 60.0,
             exe: str | None = None) -> dict:
  """Feeds `count` inputs through the `sexpgpu` command, a process each (a tenth of them a
  `run --steps 1`), under the same oracle plus a hang (past timeout_s) and death by a signal.

  Returns:
    {"fed", "findings", "outcomes": {"check 0": n, ...}, "slowest": (seconds, input)}.
  """
  exe = exe or os.path.join(os.path.dirname(sys.executable), "sexpgpu")
  seeds = _prepare(folder)
  findings, outcomes, slowest, slow = [], {}, (0.0, -1), []
  for i in range(count):
    rng = case_rng(seed + 7919, i)
    light = i % 10 == 0
    data, flags, env, invalid = generate(rng, seeds, light=light)
    path = os.path.join(folder, f"cli{i % 20}.sx")
    with open(path, "wb") as f:
      f.write(data)
    argv = (["run", path, "--json"] + flags + ["--steps", "1", "--eval-every", "0"] if light
            else ["check", path] + flags)
    full_env = {**os.environ, **env}
    since, t0 = time.time() - 1, time.perf_counter()
    try:
      p = subprocess.run([exe] + argv, env=full_env, capture_output=True, timeout=timeout_s,
                         cwd=folder, stdin=subprocess.DEVNULL, check=False)
      code, out, err = (p.returncode, p.stdout.decode("utf-8", "replace"),
                        p.stderr.decode("utf-8", "replace"))
      found = (f"killed by signal {-code}" if code < 0 else
               _judge(argv, code, out, err, invalid))
    except subprocess.TimeoutExpired:
      # On a loaded machine a one-step run can pass the limit: the input runs again with
      # five times as long, and only one that still has not ended is a hang.
      code, found = -1, f"hang past {timeout_s:.0f} s"
      try:
        p = subprocess.run([exe] + argv, env=full_env, capture_output=True, cwd=folder,
                           timeout=5 * timeout_s, stdin=subprocess.DEVNULL, check=False)
        code, found = p.returncode, _judge(argv, p.returncode,
                                           p.stdout.decode("utf-8", "replace"),
                                           p.stderr.decode("utf-8", "replace"), invalid)
        slow.append((i, time.perf_counter() - t0))
      except subprocess.TimeoutExpired:
        found = f"hang past {timeout_s:.0f} s, and past {5 * timeout_s:.0f} s run again"
    except ValueError as e:  # an argument the OS cannot pass (a NUL): not sexpgpu's input
      code, found = -2, None
      del e
    secs = time.perf_counter() - t0
    slowest = max(slowest, (secs, i))
    outcomes[f"{argv[0]} {code}"] = outcomes.get(f"{argv[0]} {code}", 0) + 1
    if found is None and code == 0 and argv[0] == "run":
      leaked = _secret_in_files(folder, since)
      found = f"a secret of a URI in a written file: {leaked}" if leaked else None
    if found:
      keep = os.path.join(folder, f"cli-finding{seed}-{i}.sx")
      with open(keep, "wb") as f:
        f.write(data)
      findings.append(f"cli input {i} ({keep} {' '.join(argv[2:])[:300]} {env}): {found}")
      print(f"fuzz: finding: {findings[-1]}", flush=True)
    if (i + 1) % 50 == 0:
      print(f"fuzz: {i + 1} through the command, {len(findings)} findings", flush=True)
  return {"fed": count, "findings": findings, "outcomes": outcomes, "slowest": slowest,
          "slow": slow}


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
  ap.add_argument("--start", type=int, default=0, help="the first input (to replay one)")
  ap.add_argument("--cli", type=int, default=0, help="inputs through the sexpgpu command")
  ap.add_argument("--hang", type=float, default=60.0, help="seconds an input may take")
  ap.add_argument("--keep", default=None, help="folder for the inputs and findings")
  ap.add_argument("--in-process", action="store_true",
                  help="feed the inputs in this process (no restart past a hang)")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--report-fd", type=int, default=None, help=argparse.SUPPRESS)
  ap.add_argument("--stall", default="", help=argparse.SUPPRESS)
  ap.add_argument("--checkpoints", action="store_true",
                  help="also damage each file of a real checkpoint, one at a time")
  args = ap.parse_args()
  folder = os.path.abspath(args.keep or tempfile.mkdtemp(prefix="sexpgpu-fuzz-"))
  os.makedirs(folder, exist_ok=True)
  os.environ.setdefault("SEXPGPU_CACHE_DIR", os.path.join(folder, "cache"))
  os.chdir(folder)  # what a run writes by default (metrics, status) lands here
  if args.worker:
    with os.fdopen(args.report_fd, "w", encoding="utf-8") as report:
      fuzz(args.count, args.runs, args.seed, folder, args.start, report,
           frozenset(int(x) for x in args.stall.split(",") if x))
    return 0
  t0 = time.perf_counter()
  if args.in_process:
    n, findings = fuzz(args.count, args.runs, args.seed, folder, args.start)
    print(f"fuzz: {n} inputs in this process in {time.perf_counter() - t0:.1f}s, "
          f"{len(findings)} findings; inputs in {folder}")
    print("  outcomes: " + ", ".join(f"{c} exit {k}: {v}"
                                     for (c, k), v in sorted(OUTCOMES.items())))
  else:
    res = supervise(args.count, args.runs, args.seed, folder, args.hang, log=sys.stdout)
    findings = res["findings"]
    print(f"fuzz: {res['fed']} inputs (seed {args.seed}, about {args.runs} through run "
          f"--steps 1) in {time.perf_counter() - t0:.1f}s, {len(findings)} findings, "
          f"{res['restarts']} worker restarts, slowest {res['slowest'][0]:.1f}s (input "
          f"{res['slowest'][1]}), peak {res['peak_rss'] >> 20} MiB; inputs in {folder}")
    print("  fed: " + ", ".join(f"{k} {v}" for k, v in sorted(res["outcomes"].items())))
  if args.cli:
    t1 = time.perf_counter()
    cli_folder = os.path.join(folder, "cli")
    os.makedirs(cli_folder, exist_ok=True)
    res = fuzz_cli(args.cli, args.seed, cli_folder, args.hang)
    print(f"fuzz: {res['fed']} inputs through the sexpgpu command in "
          f"{time.perf_counter() - t1:.1f}s, {len(res['findings'])} findings, slowest "
          f"{res['slowest'][0]:.1f}s (input {res['slowest'][1]})")
    print("  outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(res["outcomes"].items())))
    if res["slow"]:
      print("  past the limit once, then ended when run again (input, seconds both times): "
            + ", ".join(f"{i} {s:.0f}" for i, s in res["slow"]))
    findings = findings + res["findings"]
  if args.checkpoints:
    cases, more = fuzz_checkpoints(folder)
    print(f"fuzz: {cases} damaged checkpoints, {len(more)} findings")
    findings += more
  for f in findings:
    print("  " + f)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())

"""Fuzzes the commands that read a user's files whole: `sample`, `eval`, `plot` and `watch`.

`cases(rng, folder, ckpt)` writes hostile inputs into `folder` and returns the command lines
that feed them: prompt, tokenizer, task, metrics and status files that are binary, empty,
nested deep, huge, `/dev/zero`, a FIFO, a folder or missing, JSON of the wrong types, and
flag values that are negative, zero, huge, NaN, infinite, no number or empty. Each case
knows whether it is bad (then it must end in an error code). `fuzz` runs them in this
process through `sexpgpu.cli.main.main` with the oracle of benchmarks/fuzz.py's `feed`: a
finding is an exception other than SxError, a traceback on standard error, an exit status
other than 0 or 1 (or the one `watch` documents for the case), an exit 1 without an
`error[E-...]` line, an exit 0 for a bad case, or a case that runs past 60 s.

    python benchmarks/fuzz_commands.py --count 1000 --seed 1

prints the outcomes, the time and each finding (exit 1 when there is one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_S = 60
_spec = importlib.util.spec_from_file_location("fuzz", os.path.join(ROOT, "benchmarks",
                                                                     "fuzz.py"))
fuzz_front = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_front)

# The model the cases sample from and score with: a GPT-2 of 24 tokens and a window of 8.
SX = """
(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (gpt2 tokens :vocab 24 :width 16 :layers 1 :heads 2 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""
WORDS = ["<|endoftext|>", "[UNK]", "the", "sky", "is", "blue", "green", "red", "a", "river",
         "ran", "past", "mill", "keeper", "stone", "light"]


class Checkpoint(NamedTuple):
  """The experiment file, its step-0 checkpoint and a word-level tokenizer of its vocabulary."""

  sx: str
  step: str
  tokenizer: str


def checkpoint(folder: str) -> Checkpoint:
  """Writes the experiment, a step-0 checkpoint of it and a tokenizer into `folder`."""
  import numpy as np
  from tokenizers import Tokenizer, models, pre_tokenizers
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  os.makedirs(folder, exist_ok=True)
  sx = os.path.join(folder, "lm.sx")
  with open(sx, "w", encoding="utf-8") as f:
    f.write(SX)
  c = compile_file(sx)
  params = {k: np.asarray(v) for k, v in init_params(5, c.params).items()}
  step = write_step0(c, params, os.path.join(folder, "ck"))
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok_path = os.path.join(folder, "tokenizer.json")
  tok.save(tok_path)
  return Checkpoint(sx, step, tok_path)


class Case(list):
  """One command line (a list of arguments), with what is known of how it must end.

  Attributes:
    bad: why the input is known to be bad (it must end in an error code), or "".
    expect: an exit status the command documents for this input besides 0 and 1 (`watch`:
      2 stopped, 3 timed out), or None.
  """

  def __init__(self, argv, bad: str = "", expect: int | None = None):
    super().__init__(argv)
    self.bad, self.expect = bad, expect


# --- hostile files, written once a folder ----------------------------------------------------

def hostile_files(folder: str) -> dict[str, str]:
  """Files no command may read as its input: {what: path}. Each is made once."""
  out = {"missing": os.path.join(folder, "missing.json"), "dev-zero": "/dev/zero",
         "dev-null": "/dev/null", "folder": folder, "proc": "/proc/self/mem"}
  blobs = {"binary": b"\xff\xfe" + bytes(range(256)) * 4, "empty": b"",
           "blank-lines": b"\n\n \n",
           "deep-array": b"[" * 100_000 + b"]" * 100_000,
           "deep-object": b'{"a":' * 5000 + b"1" + b"}" * 5000,
           "deep-line-900": b"[" * 900 + b"]" * 900 + b"\n",
           "not-json": b"{this is not json\n", "nul": b"\x00" * 64,
           "latin1": "caf\u00e9 \u00fcber".encode("latin-1"),
           "huge-line": b"1 " * (9 << 20),  # 18 MiB on one line: past every line bound
           "huge-int": b'{"step": ' + b"9" * 5000 + b"}\n"}
  for what, data in blobs.items():
    path = os.path.join(folder, f"hostile-{what}")
    if not os.path.exists(path):
      with open(path, "wb") as f:
        f.write(data)
    out[what] = path
  fifo = os.path.join(folder, "hostile-fifo")
  if not os.path.exists(fifo):
    os.mkfifo(fifo)
  out["fifo"] = fifo
  link = os.path.join(folder, "hostile-link-to-zero")
  if not os.path.lexists(link):
    os.symlink("/dev/zero", link)
  out["link-to-dev-zero"] = link
  return out


# --- flag values ----------------------------------------------------------------------------

INTS = ["0", "1", "-1", "2", "3", "8", "4096", "4097", "65536", "65537", "2147483647",
        "2147483648", "4294967295", "4294967296", "1000000000", "1000000000000",
        "9223372036854775807", "9223372036854775808", "-9223372036854775809", "", " ", "x",
        "1.5", "1e3", "0x10", "1_0", "nan", "inf", "-inf", "\u0661", "9" * 5000]
FLOATS = ["0", "-0", "0.01", "0.05", "0.5", "0.8", "1", "1.0", "2", "1e-9", "1e-4", "100",
          "100.5", "3600", "3601", "604800", "604801", "1e300", "-1", "-0.5", "nan", "inf",
          "-inf", "", "x", "1e400", "0x1p3", "1,5", "5e-324", " 1"]
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _int(text: str) -> int | None:
  """The value `sexpgpu` reads from an integer flag, or None when it refuses the text."""
  if not _INT.fullmatch(text) or len(text) > 25 or not -2**63 <= int(text) < 2**63:
    return None
  return int(text)


def _float(text: str) -> float | None:
  """The value `sexpgpu` reads from a number flag, or None when it refuses the text."""
  if not _FLOAT.fullmatch(text) or not math.isfinite(float(text)):
    return None
  return float(text)


# Each flag's accepted values: (reader, the value's test).
SAMPLE_FLAGS = {
    "--tokens": (_int, lambda v: 1 <= v <= 65536),
    "--temperature": (_float, lambda v: v == 0 or 1e-4 <= v <= 100),
    "--top-k": (_int, lambda v: 0 <= v < 2**31),
    "--top-p": (_float, lambda v: 0 < v <= 1),
    "--seed": (_int, lambda v: 0 <= v < 2**32),
}
EVAL_FLAGS = {"--batch": (_int, lambda v: 1 <= v <= 4096), "--limit": (_int, lambda v: v >= 1)}
WATCH_FLAGS = {"--interval": (_float, lambda v: 0.01 <= v <= 3600),
               "--timeout": (_float, lambda v: v > 0),
               "--wait": (_float, lambda v: 0 <= v <= 604800)}


def _flag(rng: random.Random, name: str, table: dict, argv: list, bad: list,
          keep=lambda v: True) -> float | None:
  """Adds `name` with a value from the pools; notes in `bad` a value the flag refuses.
  `keep` turns down an accepted value the case cannot use (one that waits too long)."""
  read, ok = table[name]
  pool = INTS if read is _int else FLOATS
  for _ in range(20):
    text = rng.choice(pool)
    value = read(text)
    if value is None or not ok(value) or keep(value):
      break
  argv += [name, text] if rng.random() < 0.8 or not text else [f"{name}={text}"]
  if value is None or not ok(value):
    bad.append(f"{name} {text[:30]!r}")
    return None
  return value


# --- JSON values of every type --------------------------------------------------------------

POOL = [None, True, False, 0, -1, 1, 2, 1.5, 10**30, float("inf"), float("nan"), "", "x",
        "the sky", "x" * 5000, [], ["a"], ["blue", "green"], ["a", 3], ["", "b"], [[1]], {},
        {"a": 1}, [[[[[[[[[[]]]]]]]]]]]


def _valid_doc(kind: str, doc: dict) -> bool:
  """Whether `sexpgpu eval` takes the task document (the rules of models/evaluate.py)."""
  if not isinstance(doc, dict):
    return False
  if kind == "text" and "text" in doc and not {"context", "choices", "gold"} & doc.keys():
    return isinstance(doc["text"], str) and bool(doc["text"])
  if not {"context", "choices", "gold"} <= doc.keys():
    return False
  choices, gold = doc["choices"], doc["gold"]
  return (isinstance(doc["context"], str) and isinstance(choices, list) and len(choices) >= 2
          and all(isinstance(c, str) and c for c in choices)
          and isinstance(gold, int) and not isinstance(gold, bool)
          and 0 <= gold < len(choices))


def _doc(rng: random.Random, kind: str) -> dict:
  if kind == "text":
    return {"text": " ".join(rng.choice(WORDS[2:]) for _ in range(rng.randint(1, 12)))}
  return {"context": rng.choice(["the sky is", "a river ran past the", "", "the keeper  "]),
          "choices": rng.sample(["blue", "green", "red", "mill", "stone"], rng.randint(2, 4)),
          "gold": 0}


def _write(folder: str, rng: random.Random, stem: str, data: str | bytes) -> str:
  path = os.path.join(folder, f"{stem}-{rng.getrandbits(40):010x}")
  with open(path, "wb") as f:
    f.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
  return path


# --- the commands ---------------------------------------------------------------------------

# Hostile files whose every line is one a metrics reader skips (a torn or garbled line):
# `plot` refuses them only when no other file has values.
SKIPPED_LINES = {"empty", "blank-lines", "deep-array", "deep-object", "deep-line-900",
                 "not-json", "nul", "huge-int"}


# Hostile files that are UTF-8 text of words: a prompt when a tokenizer reads them.
TEXT_FILES = {"deep-array", "deep-object", "deep-line-900", "not-json", "nul", "huge-int"}


def _hostile(rng: random.Random, folder: str, bad: list, lines_skipped: list | None = None
             ) -> str:
  """A hostile file's path; why it is bad goes to `bad`, or its name to `lines_skipped`
  when it is only lines a reader skips (or, for a prompt, text)."""
  what, path = rng.choice(sorted(hostile_files(folder).items()))
  if lines_skipped is not None and what in SKIPPED_LINES:
    lines_skipped.append(what)
  else:
    bad.append(f"a {what} file")
  return path


def sample_case(rng: random.Random, folder: str, ckpt: Checkpoint) -> Case:
  """`sexpgpu sample` with a hostile prompt, prompt file, tokenizer or flag values."""
  argv, bad = ["sample", ckpt.sx, "--resume", ckpt.step], []
  if rng.random() < 0.05:
    argv[3] = _hostile(rng, folder, bad)  # no checkpoint
  tokenizer = rng.random() < 0.3
  if tokenizer:
    argv += ["--tokenizer", ckpt.tokenizer]
  elif rng.random() < 0.08:
    argv += ["--tokenizer", _hostile(rng, folder, bad)]
  how = rng.random()
  if how < 0.35:
    prompt = rng.choice(["1 2 3", "5", "0 0 0 0 0 0 0 0 0 0 0 0", "the sky is", "", " ",
                         "99", "-1", "\u00b2", "9" * 30, "one two", "1\x002"])
    argv += ["--prompt", prompt]
    ids = prompt.split()
    if not tokenizer and not (ids and all(re.fullmatch(r"[0-9]+", w) and int(w) < 24
                                          for w in ids)):
      bad.append(f"the prompt {prompt[:20]!r}")
    elif tokenizer and not prompt.split():
      bad.append("an empty prompt")
  elif how < 0.75:
    text = []  # a UTF-8 file of words the tokenizer reads (as [UNK]): a prompt like any
    argv += ["--prompt-file", _hostile(rng, folder, bad, text)]
    if text and (not tokenizer or text[0] not in TEXT_FILES):
      bad.append(f"a {text[0]} file, as token ids")
  elif how < 0.9:
    argv += ["--prompt-file", _write(folder, rng, "prompt", "3 1 4 1 5\n")]
  elif how < 0.95:
    argv += ["--prompt", "1", "--prompt-file", _write(folder, rng, "prompt", "2")]
    bad.append("both --prompt and --prompt-file")
  else:
    bad.append("no prompt")
  chosen = [name for name in SAMPLE_FLAGS if rng.random() < 0.15]
  for name in chosen:
    # a valid count past a few dozen tokens is slow on this model, not wrong: kept small
    _flag(rng, name, SAMPLE_FLAGS, argv, bad, keep=lambda v, n=name: n != "--tokens" or v <= 64)
  if "--tokens" not in chosen:
    argv += ["--tokens", "3"]
  if rng.random() < 0.3:
    argv.append("--json")
  return Case(argv, "; ".join(bad))


def eval_case(rng: random.Random, folder: str, ckpt: Checkpoint) -> Case:
  """`sexpgpu eval --tasks` of hostile task files, documents of the wrong types and flags."""
  argv, bad = ["eval", ckpt.sx, "--resume", ckpt.step, "--tokenizer", ckpt.tokenizer], []
  if rng.random() < 0.05:
    argv[rng.choice([3, 5])] = _hostile(rng, folder, bad)  # no checkpoint, no tokenizer
  limit = None
  for name in EVAL_FLAGS:
    if rng.random() < 0.3:
      value = _flag(rng, name, EVAL_FLAGS, argv, bad)
      limit = value if name == "--limit" else limit
  paths = []
  for _ in range(rng.choice([1, 1, 1, 2])):
    if rng.random() < 0.3:
      paths.append(_hostile(rng, folder, bad))
      continue
    kind = rng.choice(["choice", "text"])
    docs = [_doc(rng, kind) for _ in range(rng.randint(1, 4))]
    lines = [json.dumps(d) for d in docs]
    if rng.random() < 0.7:  # one document's field replaced, or a hostile line
      at = rng.randrange(len(docs))
      if rng.random() < 0.7:
        doc = dict(docs[at])
        key = rng.choice(sorted(doc) + ["context", "choices", "gold", "text", "extra"])
        if rng.random() < 0.2:
          doc.pop(key, None)
        else:
          doc[key] = rng.choice(POOL)
        lines[at] = json.dumps(doc)
        if not _valid_doc(kind, doc) and (limit is None or at < limit):
          bad.append(f"a document with {key} {str(doc.get(key))[:30]}")
      else:
        lines[at] = rng.choice(["[" * 100_000 + "]" * 100_000, "[" * 500 + "]" * 500, "{",
                                "null", "[1, 2]", '"text"', "1e400", "\udcff", "{} {}"])
        if limit is None or at < limit:  # a line past --limit is not read
          bad.append(f"the line {lines[at][:20]!r}")
    if not paths and rng.random() < 0.05 and (limit is None or limit > 1):
      lines = [json.dumps(_doc(rng, "choice")), json.dumps(_doc(rng, "text"))]
      bad.append("two kinds of document")
    paths.append(_write(folder, rng, "task", "\n".join(lines) + "\n"))
  argv += ["--tasks", ",".join(paths)]
  if rng.random() < 0.2:
    argv.append("--json")
  return Case(argv, "; ".join(bad))


def _metrics_lines(rng: random.Random) -> list[str]:
  lines = [json.dumps({"kind": "step", "slug": "a", "step": s, "train/loss": 3 - s / 10})
           for s in range(1, rng.randint(2, 30))]
  hostile = ["[" * 100_000 + "]" * 100_000, '{"kind": "step", "step": "x", "train/loss": 1}',
             '{"kind": "step", "step": 1e400, "train/loss": 1}', '{"kind": "pass", "step": 3, '
             '"metrics": [1]}', '{"kind": "stage", "step": [1]}', '{"kind": "step", "step": 2, '
             '"train/loss": 1e400}', '{"kind": "checkpoint", "action": "restored", "step": '
             'true}', "null", "[]", '"s"', '{"kind": "st', '{"slug": [1], "kind": "step", '
             '"step": 4, "train/loss": 1}', '{"kind": "step", "step": -5, "train/loss": NaN}',
             '{"kind": "step", "step": ' + "9" * 400 + ', "train/loss": 1}']
  for _ in range(rng.randint(0, 4)):
    lines.insert(rng.randrange(len(lines) + 1), rng.choice(hostile))
  return lines


def plot_case(rng: random.Random, folder: str, ckpt: Checkpoint) -> Case:
  """`sexpgpu plot` of hostile metrics files, hostile lines, metrics and outputs."""
  del ckpt
  argv, bad, skipped = ["plot"], [], []
  for _ in range(rng.choice([1, 1, 2])):
    if rng.random() < 0.3:
      argv.append(_hostile(rng, folder, bad, skipped))
    else:
      argv.append(_write(folder, rng, "metrics", "\n".join(_metrics_lines(rng)) + "\n"))
  if len(skipped) == len(argv) - 1:
    bad.append(f"no values: only {', '.join(skipped)} files")
  if rng.random() < 0.3:
    metric = rng.choice(["train/loss", "train/loss,eval/loss", "", ",", "nope", "x" * 1000,
                         ",".join(f"m{i}" for i in range(40))])
    argv += ["--metric", metric]
    if "train/loss" not in metric:
      bad.append(f"the metrics {metric[:20]!r}")
  out = os.path.join(folder, f"curves{rng.randrange(4)}.png")
  if rng.random() < 0.2:
    out = rng.choice([folder, hostile_files(folder)["fifo"], "/dev/null", "/proc/nope/c.png",
                      ""])
    bad.append(f"the output {out!r}")
  argv += ["-o", out]
  return Case(argv, "; ".join(bad))


STATES = {"done": 0, "failed": 1, "stopped": 2, "running": 3}


def watch_case(rng: random.Random, folder: str, ckpt: Checkpoint) -> Case:
  """`sexpgpu watch` of hostile status files, statuses of the wrong types and flag values."""
  del ckpt
  argv, bad, expect = ["watch"], [], None
  state = rng.choice(sorted(STATES))
  status = {"slug": "x", "pid": 1, "state": state, "step": 3, "steps": 10, "stage": 0,
            "train_loss": 2.5, "last_pass": {"eval/loss": 2.0}, "steps_per_second": 10.0,
            "eta_seconds": 0.7, "checkpoint": {"step": 2, "location": "/ck/x/2"},
            "error": {"code": "E-NUM-001", "message": "the loss is not finite"}}
  how = rng.random()
  if how < 0.3:
    argv.append(_hostile(rng, folder, bad))
  elif how < 0.55:
    value = rng.choice(POOL)
    field = rng.choice(sorted(status))
    status[field] = value
    text = json.dumps(status)
    types = {"slug": str, "state": str, "step": (int, type(None)), "steps": (int, type(None)),
             "stage": int, "train_loss": (int, float, type(None)),
             "last_pass": (dict, type(None)), "steps_per_second": (int, float, type(None)),
             "eta_seconds": (int, float, type(None)), "checkpoint": (dict, type(None)),
             "error": (dict, type(None)), "pid": object}[field]
    fits = not isinstance(value, bool) and isinstance(value, types)
    if field in ("step", "steps", "stage") and isinstance(value, int):
      fits = fits and 0 <= value < 2**53
    elif isinstance(value, int):
      fits = fits and -2**63 <= value < 2**63
    fits = fits or field == "pid"  # not read
    if field == "last_pass" and isinstance(value, dict):
      fits = all(isinstance(v, (int, float, type(None))) and not isinstance(v, bool)
                 for v in value.values())
    if field == "state" and isinstance(value, str):
      expect = STATES.get(value, 3)  # another state: followed until the timeout
    if not fits:
      bad.append(f"the field {field} {str(value)[:20]}")
    argv.append(_write(folder, rng, "status", text))
  elif how < 0.7:
    argv.append(_write(folder, rng, "status", rng.choice(
        ["[1, 2]", '"running"', "null", "3", "{", json.dumps([status])])))
    bad.append("a status that is no object")
  else:
    argv.append(_write(folder, rng, "status", json.dumps(status)))
  if expect is None and not bad:
    expect = STATES[state]
  # Accepted values that wait long (the file to appear, a run to end) are not drawn where
  # they would wait: that is the command doing as told, not a hang.
  for name, default, long_ok in (("--interval", "0.05", True),
                                 ("--timeout", "1", expect != 3), ("--wait", "0.2", not bad)):
    if rng.random() < 0.3:
      _flag(rng, name, WATCH_FLAGS, argv, bad, keep=lambda v, ok=long_ok: ok or v <= 2)
    else:
      argv += [name, default]
  return Case(argv, "; ".join(bad), None if bad else expect)


COMMANDS = (sample_case, eval_case, plot_case, watch_case)


def cases(rng: random.Random, folder: str, ckpt: Checkpoint) -> list[Case]:
  """One case for each command (sample, eval, plot, watch), from `rng` alone.

  Args:
    rng: the cases' random source; folder: where their files are written; ckpt: the model.

  Returns:
    Case objects: each a list of the arguments after `sexpgpu`, with `.bad` and `.expect`.
  """
  hostile_files(folder)
  return [make(rng, folder, ckpt) for make in COMMANDS]


# --- feeding --------------------------------------------------------------------------------

class _Hang(BaseException):
  """Raised in the main thread past HANG_S (a BaseException: no `except Exception` in the
  code under test takes it)."""


def _hang(signum, frame):
  raise _Hang()


def feed(case: Case, folder: str) -> str | None:
  """Runs one case through benchmarks/fuzz.py's `feed` (its oracle), stopped past HANG_S.

  The stop is SIGUSR1 from a timer thread: `main` keeps SIGALRM for its own stop handling
  (and cancels a pending alarm), so an alarm would not reach a hang.

  Returns:
    A finding, or None.
  """
  before = dict(fuzz_front.OUTCOMES)
  old = signal.signal(signal.SIGUSR1, _hang)
  main_thread = threading.main_thread().ident
  timer = threading.Timer(HANG_S, lambda: signal.pthread_kill(main_thread, signal.SIGUSR1))
  timer.start()
  try:
    found = fuzz_front.feed(folder, list(case), {}, [case.bad] if case.bad else [])
  finally:
    timer.cancel()
    signal.signal(signal.SIGUSR1, old)
  if found and found.startswith("_Hang"):
    return f"a hang past {HANG_S} s"
  code = next((k for (c, k), v in fuzz_front.OUTCOMES.items()
               if c == case[0] and before.get((c, k), 0) != v), None)
  if found and case.expect is not None and code == case.expect and (
      found.startswith(f"exit {code}:") or found.startswith("exit 1 without an error code")):
    return None  # watch's documented status for this file (1: the run's own failure)
  if found is None and case.expect is not None and code != case.expect:
    return f"exit {code}, where the status file says {case.expect}"
  return found


def fuzz(count: int, seed: int, folder: str, start: int = 0,
         ckpt: Checkpoint | None = None) -> tuple[int, list[str]]:
  """Feeds cases start..count-1 (four at a time, one a command) in this process.

  Args:
    ckpt: the model (default: `checkpoint` writes one into `folder`).

  Returns:
    (cases fed, findings as "case N (argv): finding").
  """
  os.makedirs(folder, exist_ok=True)
  ckpt = ckpt or checkpoint(os.path.join(folder, "model"))
  findings, fed, i = [], 0, start
  while fed < count - start:
    for case in cases(random.Random(seed * 1_000_003 + i), folder, ckpt):
      if fed >= count - start:
        break
      found = feed(case, folder)
      fed += 1
      if found:
        shown = " ".join(a if len(a) < 60 else a[:60] + "..." for a in case)
        findings.append(f"case {i} ({shown}; bad: {case.bad or '-'}): {found}")
    i += 1
  return fed, findings


def main() -> int:
  """The command line: prints what was fed and found; exit 1 when anything was found."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--count", type=int, default=1000)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--keep", default=None, help="the folder of the cases (default: a temp one)")
  args = ap.parse_args()
  folder = os.path.abspath(args.keep or tempfile.mkdtemp(prefix="fuzz-commands-"))
  os.environ.setdefault("SEXPGPU_CACHE_DIR", os.path.join(folder, "cache"))
  t = time.perf_counter()
  fed, findings = fuzz(args.count, args.seed, folder)
  outcomes = {f"{c} exit {k}": v for (c, k), v in sorted(fuzz_front.OUTCOMES.items())}
  print(f"fuzz_commands: {fed} cases in {time.perf_counter() - t:.1f}s, {len(findings)} "
        f"findings; outcomes {outcomes}; cases in {folder}")
  for f in findings:
    print("  " + f)
  return 1 if findings else 0


if __name__ == "__main__":
  sys.exit(main())

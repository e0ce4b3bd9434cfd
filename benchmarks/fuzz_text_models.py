"""Fuzzes `sexpgpu import` and `sexpgpu tokenize` with hostile files and flag values.

Each case is a command line over a freshly made input: a Hugging Face folder whose
config.json, weights or weight index is binary, empty, nested 100,000 deep, larger than its
bound, a FIFO, /dev/zero, a folder, JSON of the wrong type, a known key of the wrong type or
size, NaN or infinity; text sources, tokenizers and caches of the same kinds; and hostile
values of --train-bpe, --workers, --tokenizer, -o, --eos and --allow-nonfinite. Every case
runs in this process through `sexpgpu.cli.main.main(argv)` and is judged by the oracle of
benchmarks/fuzz.py's `feed`: a finding is an exception other than SxError, a traceback on
standard error, an exit other than 0 or 1, an exit 1 without an error code, an exit 0 for
an input known to be bad, or a case that takes longer than 60 s.

    python benchmarks/fuzz_text_models.py --count 1000 --seed 1

prints the counts by command and exit, the time and each finding (exit 1 when there is one).
Case i of seed S depends on (S, i) alone: `--seed S --start i --count i+1` replays it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_spec = importlib.util.spec_from_file_location("fuzz", os.path.join(HERE, "fuzz.py"))
fuzz_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_base)

HANG_S = 60
SX = """(require std/lm)
(require std/gpt2)
(defknob width 16)
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (gpt2 tokens :vocab 24 :width width :layers 1 :heads 2 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""
# config.json keys the twins read, each with values of a wrong type or out of range
CONFIG_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
               "layer_norm_epsilon", "model_type", "activation_function",
               "tie_word_embeddings", "scale_attn_by_inverse_layer_idx", "architectures")
WRONG_VALUES = ("24", -24, 0, 10 ** 12, 10 ** 40, 2.5, True, [], {}, [1, [2]], {"a": {}},
                "", "x" * 300, -1e-5)
NONFINITE = (float("nan"), float("inf"), float("-inf"))


class Case(list):
  """A command line (a list of arguments), and why it must be refused ("" when it may pass)."""

  def __init__(self, argv, bad: str):
    super().__init__(argv)
    self.bad = bad


class Hang(BaseException):
  """A case ran past HANG_S."""


# --- what every case starts from ---------------------------------------------------------------

def prepare(folder: str) -> dict[str, str]:
  """The experiment, its exported Hugging Face folder, a text corpus and a tokenizer.json,
  made once under `folder`; returns their paths."""
  base = os.path.join(folder, "base")
  paths = {"sx": os.path.join(base, "w.sx"), "hf": os.path.join(base, "hf"),
           "text": os.path.join(base, "corpus.txt"), "tok": os.path.join(base, "tokenizer.json")}
  if os.path.exists(paths["tok"]):
    return paths
  os.makedirs(base, exist_ok=True)
  import numpy as np
  from sexpgpu.lower.init import init_params
  from sexpgpu.models import export
  from sexpgpu.run.compile import compile_file
  from sexpgpu.tools.tokenize import train_bpe
  with open(paths["sx"], "w", encoding="utf-8") as f:
    f.write(SX)
  c = compile_file(paths["sx"])
  params = {k: np.asarray(v) for k, v in init_params(11, c.params).items()}
  export.export(c, params, {"step": 0}, paths["hf"], "hf")
  with open(os.path.join(ROOT, "tests", "data", "corpus.txt"), encoding="utf-8") as f:
    text = f.read()[:20000]
  with open(paths["text"], "w", encoding="utf-8") as f:
    f.write(text)
  tok = train_bpe(iter([text]), 300, "<|endoftext|>")
  with open(paths["tok"] + ".part", "w", encoding="utf-8") as f:
    f.write(tok.to_str())
  os.replace(paths["tok"] + ".part", paths["tok"])
  return paths


def _special(rng: random.Random, path: str) -> str:
  """Puts a FIFO, /dev/zero, a folder or a dangling link at `path`; returns which."""
  kind = rng.choice(["fifo", "zero", "folder", "dangling"])
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.remove(path)
  if kind == "fifo":
    os.mkfifo(path)
  elif kind == "zero":
    os.symlink("/dev/zero", path)
  elif kind == "folder":
    os.makedirs(path)
  else:
    os.symlink(path + ".nowhere", path)
  return kind


def _hostile_json(rng: random.Random) -> tuple[bytes, str]:
  """A file that is no JSON object: (its bytes, what it is)."""
  kind = rng.choice(["binary", "empty", "deep-array", "deep-object", "huge", "list", "string",
                     "number", "null", "not-json", "utf16"])
  n = rng.choice([70, 1000, 100_000])
  data = {"binary": bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))),
          "empty": b"", "deep-array": b"[" * n + b"]" * n,
          "deep-object": b'{"a":' * n + b"1" + b"}" * n,
          "huge": b'{"pad": "' + b"x" * (64 << 20) + b'"}' if rng.random() < 0.05 else b"[]",
          "list": b"[1, 2]", "string": b'"config"', "number": b"12", "null": b"null",
          "not-json": b"{model_type: gpt2", "utf16": '{"a": 1}'.encode("utf-16")}[kind]
  return data, kind


# --- import ----------------------------------------------------------------------------------

def _import_case(rng: random.Random, case: str, paths: dict[str, str]) -> Case:
  hf = os.path.join(case, "hf")
  shutil.copytree(paths["hf"], hf)
  cfg, weights = os.path.join(hf, "config.json"), os.path.join(hf, "model.safetensors")
  allow = rng.random() < 0.2
  out = os.path.join(case, "ck")
  what = rng.choice(["config", "config", "key", "key", "nonfinite-config", "weights",
                     "nonfinite-weights", "index", "folder", "output", "good"])
  bad = ""
  if what == "config":
    if rng.random() < 0.3:
      bad = "config.json is " + _special(rng, cfg)
    else:
      data, kind = _hostile_json(rng)
      with open(cfg, "wb") as f:
        f.write(data)
      bad = f"config.json is {kind}"
  elif what in ("key", "nonfinite-config"):
    with open(cfg, encoding="utf-8") as f:
      config = json.load(f)
    key = rng.choice(CONFIG_KEYS + ("rope_scaling", "initializer_range", "resid_pdrop"))
    if what == "key":
      config[key] = rng.choice(WRONG_VALUES)
      bad = "" if _valid_anyway(key, config[key]) else f"config.json {key} {config[key]!r}"[:80]
    else:
      path = [key] if rng.random() < 0.7 else ["sexpgpu", "nested"]
      (config.setdefault(path[0], {}) if len(path) == 2 else config)[path[-1]] = (
          rng.choice(NONFINITE))
      bad = "" if allow else f"config.json {'.'.join(path)} is not finite"
    with open(cfg, "w", encoding="utf-8") as f:
      json.dump(config, f)  # writes NaN and Infinity as Python's json does
  elif what in ("weights", "nonfinite-weights"):
    bad = _hostile_weights(rng, weights, what == "nonfinite-weights", allow)
  elif what == "index":
    bad = _hostile_index(rng, hf)
  elif what == "folder":
    target = rng.choice(["/dev/zero", os.path.join(case, "fifo"), cfg, "org/model",
                         os.path.join(case, "none")])
    if target.endswith("fifo"):
      os.mkfifo(target)
    hf, bad = target, f"the folder is {target}"
  elif what == "output":
    out = rng.choice(["/dev/null", cfg, "/proc/sexpgpu-fuzz/ck"])
    bad = f"-o {out}"
  argv = ["import", hf, "-o", out, paths["sx"]] + (["--allow-nonfinite"] if allow else [])
  return Case(argv, bad)


def _valid_anyway(key: str, value) -> bool:
  """Whether a gpt2 config.json may hold `value` at `key` and still import (a key the gpt2
  twin does not compare, of the right type)."""
  if key in ("initializer_range", "resid_pdrop"):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
  return (key == "rope_scaling" and isinstance(value, dict)) or (
      key == "architectures" and value == []) or (key == "tie_word_embeddings" and value is True)


def _hostile_weights(rng: random.Random, weights: str, nonfinite: bool, allow: bool) -> str:
  import numpy as np
  from safetensors.numpy import load_file, save_file
  if nonfinite:
    tensors = load_file(weights)
    name = rng.choice(sorted(tensors))
    value = tensors[name].copy()
    value.flat[rng.randrange(value.size)] = rng.choice(NONFINITE)
    tensors[name] = value
    save_file(tensors, weights, metadata={"format": "pt"})
    return "" if allow else f"{name} is not finite"
  kind = rng.choice(["special", "garbage", "truncated", "empty", "huge-header", "extra"])
  if kind == "special":
    return "model.safetensors is " + _special(rng, weights)
  with open(weights, "rb") as f:
    data = f.read()
  if kind == "extra":
    tensors = load_file(weights)
    tensors["transformer.h.9.mlp.c_fc.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, weights, metadata={"format": "pt"})
    return "an extra tensor"
  data = {"garbage": bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400))),
          "truncated": data[:rng.randrange(len(data))], "empty": b"",
          "huge-header": (1 << 60).to_bytes(8, "little") + b'{"a": 1}'}[kind]
  with open(weights, "wb") as f:
    f.write(data)
  return f"model.safetensors is {kind}"


def _hostile_index(rng: random.Random, hf: str) -> str:
  """Replaces model.safetensors by shards and an index; a hostile index unless 'good'."""
  from safetensors.numpy import load_file, save_file
  weights = os.path.join(hf, "model.safetensors")
  tensors = load_file(weights)
  os.remove(weights)
  names = sorted(tensors)
  half = len(names) // 2
  shards = {"model-00001-of-00002.safetensors": names[:half],
            "model-00002-of-00002.safetensors": names[half:]}
  for shard, held in shards.items():
    save_file({k: tensors[k] for k in held}, os.path.join(hf, shard), metadata={"format": "pt"})
  weight_map = {k: shard for shard, held in shards.items() for k in held}
  index = os.path.join(hf, "model.safetensors.index.json")
  kind = rng.choice(["good", "outside", "absolute", "missing-shard", "wrong-types", "hostile",
                     "special", "listed-absent"])
  body: object = {"metadata": {}, "weight_map": weight_map}
  if kind == "outside":
    body["weight_map"][names[0]] = "../" + shards_first(shards)
  elif kind == "absolute":
    body["weight_map"][names[0]] = "/etc/passwd"
  elif kind == "missing-shard":
    os.remove(os.path.join(hf, shards_first(shards)))
  elif kind == "wrong-types":
    body["weight_map"] = rng.choice([[], "x", {names[0]: 3}, None, {}])
  elif kind == "listed-absent":
    body["weight_map"]["transformer.none.weight"] = shards_first(shards)
  if kind == "hostile":
    data, what = _hostile_json(rng)
    with open(index, "wb") as f:
      f.write(data)
    return f"the weight index is {what}"
  if kind == "special":
    return "the weight index is " + _special(rng, index)
  with open(index, "w", encoding="utf-8") as f:
    json.dump(body, f)
  return "" if kind == "good" else f"the weight index: {kind}"


def shards_first(shards: dict) -> str:
  """The first shard's file name."""
  return sorted(shards)[0]


# --- tokenize --------------------------------------------------------------------------------

def _tokenize_case(rng: random.Random, case: str, paths: dict[str, str]) -> Case:
  from sexpgpu.tools import textsources
  src = os.path.join(case, "good.txt")
  shutil.copy(paths["text"], src)
  sources, bad, out = [src], {}, os.path.join(case, "cache")
  given = {"vocab": ["--train-bpe", "300"]}  # flag → its arguments; the last choice stands
  for n in range(rng.randint(1, 2)):
    what = rng.choice(["source", "source", "train-bpe", "workers", "tokenizer", "output",
                       "eos", "manifest"])
    bad.pop(what, None)
    if what == "source":
      path, why = _hostile_source(rng, case, getattr(textsources, "WORD_LIMIT", 32768))
      sources.append(path)
      bad[f"source{n}"] = why
    elif what in ("train-bpe", "tokenizer"):
      bad.pop("train-bpe", None)
      bad.pop("tokenizer", None)
      if what == "train-bpe":
        value = rng.choice(["0", "-1", "1", "256", "257", "300", "1000000", "1048577",
                            "1000000000", "10" * 12, "1e3", "0x10", "abc", ""])
        given["vocab"] = ["--train-bpe", value]
        if value not in ("257", "300"):
          bad[what] = f"--train-bpe {value}"
      else:
        tok = os.path.join(case, f"tokenizer{n}.json")
        kind = rng.choice(["good", "json", "special", "name"])
        if kind == "good":
          shutil.copy(paths["tok"], tok)
        elif kind == "json":
          data, why = _hostile_json(rng)
          with open(tok, "wb") as f:
            f.write(data)
          bad[what] = f"--tokenizer {why}"
        elif kind == "special":
          bad[what] = "--tokenizer " + _special(rng, tok)
        else:
          tok = "gpt2"
          bad[what] = "--tokenizer gpt2"
        given["vocab"] = ["--tokenizer", tok]
    elif what == "workers":
      value = rng.choice(["0", "-1", "1", "2", "100000", "10" * 10, "x"])
      given[what] = ["--workers", value]
      if value not in ("1", "2"):
        bad[what] = f"--workers {value}"
    elif what == "output":
      out = rng.choice(["/dev/null", src, "/proc/sexpgpu-fuzz/c", "/sys/kernel/c",
                        os.path.join(case, "fifo")])
      if out.endswith("fifo") and not os.path.exists(out):
        os.mkfifo(out)
      bad[what] = f"-o {out}"
    elif what == "eos":
      given[what] = ["--eos", rng.choice(["", "x" * 5000, "<|endoftext|>", "\u0000"])]
    elif what == "manifest" and out == os.path.join(case, "cache"):
      os.makedirs(out, exist_ok=True)
      manifest = os.path.join(out, "manifest.json")
      if os.path.lexists(manifest):  # an earlier choice of this case made it already
        pass
      elif rng.random() < 0.5:
        _special(rng, manifest)
      else:
        data, _ = _hostile_json(rng)
        with open(manifest, "wb") as f:
          f.write(data)
  flags = [a for args in given.values() for a in args]
  return Case(["tokenize", *sources, "-o", out, *flags], "; ".join(bad.values()))


def _hostile_source(rng: random.Random, case: str, word_limit: int) -> tuple[str, str]:
  kind = rng.choice(["binary", "empty", "special", "long-word", "deep-line", "wrong-type",
                     "not-json", "latin1", "parquet", "unknown-ext", "folder-with-fifo"])
  ext = {"deep-line": ".jsonl", "wrong-type": ".jsonl", "not-json": ".jsonl",
         "parquet": ".parquet", "unknown-ext": ".bin"}.get(kind, ".txt")
  path = os.path.join(case, f"{kind}{rng.randrange(1000)}{ext}")
  if kind == "special":
    return path, "a source is " + _special(rng, path)
  if kind == "folder-with-fifo":
    os.makedirs(path[:-4])
    os.mkfifo(os.path.join(path[:-4], "x.txt"))
    return path[:-4], "a folder holding a FIFO"
  letters = "".join(rng.choice("abcdefgh") for _ in range(word_limit + 1 + rng.randrange(99)))
  depth = rng.choice([100, 100_000])
  data = {"binary": bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 500))) + b"\x00",
          "empty": b"", "long-word": f"one line {letters} and more".encode(),
          "deep-line": ('{"text": ' + "[" * depth + "]" * depth + "}\n").encode(),
          "wrong-type": json.dumps({"text": rng.choice([1, None, [], {}, True])}).encode(),
          "not-json": b'{"text": "a"\n', "latin1": "caf\xe9 cr\xe8me".encode("latin-1"),
          "parquet": b"PAR1" + bytes(rng.getrandbits(8) for _ in range(64)) + b"PAR1",
          "unknown-ext": b"some text"}[kind]
  with open(path, "wb") as f:
    f.write(data)
  return path, f"a source is {kind}"


# --- the run ---------------------------------------------------------------------------------

def cases(rng: random.Random, folder: str) -> list[Case]:
  """Hostile command lines for `import` and `tokenize`, each over inputs made fresh under a
  folder of `folder` (prepared once by `prepare`).

  Returns:
    Cases: lists of arguments for `sexpgpu.cli.main.main`, each with `.bad`, why it must be
    refused ("" when it may pass).
  """
  paths = prepare(folder)
  case = os.path.join(folder, f"case-{rng.getrandbits(48):012x}")
  os.makedirs(case)
  make = rng.choice([_import_case, _tokenize_case])
  return [make(rng, case, paths)]


def _on_alarm(signum, frame):
  raise Hang(f"over {HANG_S} s")


@contextlib.contextmanager
def _deadline(seconds: int):
  old = signal.signal(signal.SIGALRM, _on_alarm)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def fuzz(count: int, seed: int, folder: str, start: int = 0) -> tuple[int, list[str], dict]:
  """Feeds cases start..count-1 through `main` in this process, judged as fuzz.feed judges.

  Returns:
    (cases fed, findings as "case N (argv): what", {(command, exit): how many}).
  """
  prepare(folder)
  findings, outcomes = [], {}
  fuzz_base.OUTCOMES.clear()
  for i in range(start, count):
    rng = fuzz_base.case_rng(seed, i)
    for argv in cases(rng, folder):
      try:
        with _deadline(HANG_S):
          found = fuzz_base.feed(folder, list(argv), {}, [argv.bad] if argv.bad else [])
      except Hang as e:  # the alarm came between feed's own handlers
        found = f"Hang: {e}"
      if found:
        findings.append(f"case {i} ({' '.join(argv)[:300]}): {found}")
    for path in os.listdir(folder):
      if path.startswith("case-"):
        _remove(os.path.join(folder, path))
  outcomes.update(fuzz_base.OUTCOMES)
  return count - start, findings, outcomes


def _remove(path: str) -> None:
  with contextlib.suppress(OSError):
    shutil.rmtree(path)


def main() -> int:
  """The command line: --count, --seed, --start, --folder."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--count", type=int, default=1000)
  ap.add_argument("--seed", type=int, default=1)
  ap.add_argument("--start", type=int, default=0)
  ap.add_argument("--folder", default=None)
  args = ap.parse_args()
  import tempfile
  folder = args.folder or tempfile.mkdtemp(prefix="fuzz-text-models-")
  t0 = time.perf_counter()
  n, findings, outcomes = fuzz(args.count, args.seed, folder, args.start)
  took = time.perf_counter() - t0
  print(f"{n} cases in {took:.0f} s; outcomes "
        + ", ".join(f"{c} exit {e}: {k}" for (c, e), k in sorted(outcomes.items())))
  for f in findings:
    print(f)
  print(f"{len(findings)} findings")
  return 1 if findings else 0


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  sys.exit(main())

"""defeval's scores against lm-evaluation-harness's own: a gpt2 trained here on a token cache
of configs/data, exported as a Hugging Face folder (its tokenizer.json beside it), scored on
the shipped tasks (configs/data/choice.jsonl and cloze.jsonl) by the harness's `hf` model
and a local task definition, offline, and by sexpgpu.models.evaluate, packed and one
request a row. The shipped task files are what benchmarks/make_eval_tasks.py writes."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import sexpgpu
from sexpgpu.cli.main import main

pytestmark = pytest.mark.slow  # PyTorch parity: lm-evaluation-harness on an exported model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "configs", "data")
TASKS = {"choice": os.path.join(DATA, "choice.jsonl"), "cloze": os.path.join(DATA, "cloze.jsonl")}

# The model: text-lm's tokenizer and window, GPT-2's blocks (so `export --format hf` hands it
# to transformers), small enough to train in seconds; its function takes :segments and
# :positions, so the scorer may pack requests.
GPT2_SX = """
(require std/lm)
(require std/gpt2)
(defknob cache "cache")
(defknob vocab 2048)
(defknob seq 64)
(defloader train (text cache :seq (+ seq 1) :batch 8 :vocab vocab))
(defn lm [tokens :segments nil :positions nil]
  (gpt2 tokens :vocab vocab :width 64 :layers 2 :heads 4 :context seq :segments segments
        :positions positions))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 150 :optimizer (adamw :lr 3e-3 :weight-decay 0.0)
        :precision f32 :seed 1)
"""
STEPS = 150

# lm-evaluation-harness's task definitions of the two files: its multiple_choice scoring
# (acc, acc_norm) and its rolling log-likelihood (bits_per_byte).
CHOICE_YAML = """task: sx_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
CLOZE_YAML = """task: sx_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""

# Run in its own process (torch, and datasets reading the offline switches at import): the
# harness's `hf` model on the exported folder, every connection it tries recorded and refused
# (nothing may be downloaded), and the exported tokenizer as transformers' AutoTokenizer
# reads it, encoding every string a request is made of.
HARNESS = r"""
import json, socket, sys
hf, tasks, out, strings = sys.argv[1:5]
tried = []
def _refuse(what, addr):
  host = addr[0] if isinstance(addr, tuple) else addr
  if host not in ("127.0.0.1", "::1", "localhost"):
    tried.append(f"{what} {addr}")
    raise OSError(f"no network in this test: {what} {addr}")
_connect = socket.socket.connect
def connect(self, addr):
  if self.family in (socket.AF_INET, socket.AF_INET6):
    _refuse("connect", addr)
  return _connect(self, addr)
_getaddrinfo = socket.getaddrinfo
def getaddrinfo(host, *a, **k):
  _refuse("resolve", (host,))
  return _getaddrinfo(host, *a, **k)
socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer
lm = HFLM(pretrained=hf, dtype="float32", device="cpu", batch_size=8)
r = lm_eval.simple_evaluate(model=lm, tasks=["sx_choice", "sx_cloze"], log_samples=True,
                            task_manager=TaskManager(include_path=tasks, include_defaults=False))
auto = AutoTokenizer.from_pretrained(hf)
json.dump({
    "results": r["results"],
    "resps": {k: [[x[0] for x in s["resps"]] for s in v] for k, v in r["samples"].items()},
    "arguments": {k: [[list(a) for a in s["arguments"]] for s in v]
                  for k, v in r["samples"].items()},
    "max_length": lm.max_length, "eot": lm.eot_token_id, "tokenizer": type(auto).__name__,
    "eos": [auto.eos_token, auto.eos_token_id],
    "encoded": [auto.encode(s, add_special_tokens=False) for s in json.load(open(strings))],
    "tried": tried}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """A gpt2 trained STEPS steps on `sexpgpu tokenize configs/data/*.txt --train-bpe 2048`,
  exported with its tokenizer."""
  tmp = str(tmp_path_factory.mktemp("eval-harness"))
  cache = os.path.join(tmp, "cache")
  assert main(["tokenize", *sorted(glob.glob(os.path.join(DATA, "*.txt"))), "-o", cache,
               "--train-bpe", "2048"]) == 0
  path = os.path.join(tmp, "twin.sx")
  with open(path, "w") as f:
    f.write(GPT2_SX)
  ck = os.path.join(tmp, "ck")
  sexpgpu.compile(path).run(steps=STEPS, checkpoint_dir=ck)
  step_dir = os.path.join(ck, "twin", str(STEPS))
  hf = os.path.join(tmp, "hf")
  assert main(["export", path, "--resume", step_dir, "-o", hf, "--format", "hf"]) == 0
  return {"tmp": tmp, "path": path, "step_dir": step_dir, "hf": hf,
          "tokenizer": os.path.join(cache, "tokenizer.json")}


def _strings() -> list[str]:
  """Every string the harness encodes for the two tasks: each context, each context with
  " " + a choice, each text."""
  out = []
  for line in open(TASKS["choice"], encoding="utf-8"):
    d = json.loads(line)
    out += [d["context"]] + [d["context"] + " " + c for c in d["choices"]]
  out += [json.loads(line)["text"] for line in open(TASKS["cloze"], encoding="utf-8")]
  return out


@pytest.fixture(scope="module")
def harness(model):
  """lm-evaluation-harness's results, per-request log-likelihoods and AutoTokenizer's
  encodings, from its own process."""
  tmp = model["tmp"]
  tasks = os.path.join(tmp, "tasks")
  os.makedirs(tasks)
  for name, yaml in (("choice", CHOICE_YAML), ("cloze", CLOZE_YAML)):
    with open(os.path.join(tasks, f"sx_{name}.yaml"), "w") as f:
      f.write(yaml.format(path=TASKS[name]))
  strings = os.path.join(tmp, "strings.json")
  with open(strings, "w") as f:
    json.dump(_strings(), f)
  out = os.path.join(tmp, "harness.json")
  home = os.path.join(tmp, "hf-home")
  env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             HF_EVALUATE_OFFLINE="1", HF_HOME=home, HF_DATASETS_CACHE=os.path.join(home, "ds"),
             TOKENIZERS_PARALLELISM="false")
  r = subprocess.run([sys.executable, "-c", HARNESS, model["hf"], tasks, out, strings],
                     capture_output=True, text=True, cwd=tmp, env=env, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  with open(out) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def scored(model):
  """sexpgpu's scores of both tasks, packed and one request a row."""
  from tokenizers import Tokenizer
  from sexpgpu.models import evaluate
  from sexpgpu.models.source import checkpoint_params
  from sexpgpu.run.compile import compile_file
  c = compile_file(model["path"])
  params, _ = checkpoint_params(model["step_dir"])
  tok = Tokenizer.from_file(os.path.join(model["hf"], "tokenizer.json"))
  out = {}
  for packed in (True, False):
    scorer = evaluate.Scorer(c, "lm", tok, batch=8, packed=packed)
    for name, path in TASKS.items():
      out[name, packed] = scorer.score(params, evaluate.load_task(path))
  return out


def test_the_harness_ran_offline_on_the_exported_folder(harness):
  assert harness["tried"] == []  # no connection, no name looked up
  assert harness["max_length"] == 64  # the twin's n_positions: no request is cut
  assert set(harness["resps"]) == {"sx_choice", "sx_cloze"}


def test_the_exported_tokenizer_loads_in_transformers_and_encodes_as_tokenizers(model, harness):
  from tokenizers import Tokenizer
  # the class export's tokenizer_config.json names: tokenizer.json read as it is
  assert harness["tokenizer"] == "PreTrainedTokenizerFast"
  tok = Tokenizer.from_file(os.path.join(model["hf"], "tokenizer.json"))
  eot = tok.token_to_id("<|endoftext|>")
  assert harness["eos"] == ["<|endoftext|>", eot] and harness["eot"] == eot
  ours = [tok.encode(s).ids for s in _strings()]
  assert harness["encoded"] == ours


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-a-row"])
def test_acc_and_acc_norm_equal_the_harness_and_every_loglikelihood(harness, scored, packed):
  res = scored["choice", packed]
  theirs = harness["results"]["sx_choice"]
  assert res.skipped == [] and res.docs == list(range(len(harness["resps"]["sx_choice"])))
  assert abs(res.metrics["acc"] - theirs["acc,none"]) <= 1e-6
  assert abs(res.metrics["acc_norm"] - theirs["acc_norm,none"]) <= 1e-6
  their_ll = np.array([[ll for ll, _ in doc] for doc in harness["resps"]["sx_choice"]])
  our_ll = np.array(res.loglikelihoods)
  assert our_ll.shape == their_ll.shape == (64, 4)
  assert np.abs(our_ll - their_ll).max() <= 1e-4
  assert res.greedy == [[g for _, g in doc] for doc in harness["resps"]["sx_choice"]]
  # the equal accuracies are no tie broken alike: every document's best choice leads its
  # next by far more than the tolerance
  top2 = np.sort(their_ll, axis=1)[:, -2:]
  assert (top2[:, 1] - top2[:, 0]).min() > 1e-2
  # and the harness made the requests sexpgpu made: " " + choice after the context
  first = json.loads(open(TASKS["choice"], encoding="utf-8").readline())
  assert harness["arguments"]["sx_choice"][0] == [[first["context"], " " + c]
                                                  for c in first["choices"]]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-a-row"])
def test_bits_per_byte_equals_the_harness_rolling_loglikelihood(harness, scored, packed):
  res = scored["cloze", packed]
  theirs = harness["results"]["sx_cloze"]
  assert abs(res.metrics["bits_per_byte"] - theirs["bits_per_byte,none"]) <= 1e-6
  their_ll = np.array([doc[0] for doc in harness["resps"]["sx_cloze"]])
  assert np.abs(np.array(res.loglikelihoods) - their_ll).max() <= 1e-4


@pytest.mark.parametrize("task", ["choice", "cloze"])
def test_packed_rows_score_as_one_request_a_row(scored, task):
  packed, alone = scored[task, True], scored[task, False]
  assert packed.requests == alone.requests and alone.rows == alone.requests
  assert packed.rows * 3 <= alone.rows  # packing does share rows
  assert np.abs(np.array(packed.loglikelihoods) - np.array(alone.loglikelihoods)).max() <= 1e-5
  assert packed.metrics.keys() == alone.metrics.keys()
  for k, v in packed.metrics.items():
    assert abs(v - alone.metrics[k]) <= 1e-6, k


def test_the_shipped_tasks_are_what_the_script_writes(tmp_path):
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "make_eval_tasks.py"),
                      "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  for path in TASKS.values():
    with open(path, "rb") as shipped, open(tmp_path / os.path.basename(path), "rb") as made:
      assert shipped.read() == made.read(), path
  choice = [json.loads(line) for line in open(TASKS["choice"], encoding="ascii")]
  cloze = [json.loads(line) for line in open(TASKS["cloze"], encoding="ascii")]
  assert 40 <= len(choice) <= 100 and 20 <= len(cloze) <= 50
  assert all(len(set(d["choices"])) == 4 for d in choice)
  # the gold as often in each place: no habit of a model scores above chance
  assert np.bincount([d["gold"] for d in choice]).tolist() == [len(choice) // 4] * 4


def test_bench_eval_tiny_smoke(tmp_path):
  """benchmarks/bench_eval.py end to end at the tiny shape: both legs agree and the ratio
  line is printed."""
  out = tmp_path / "bench.json"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_eval.py"),
                      "--shape", "tiny", "--rounds", "1", "--json", str(out)],
                     capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert "ratio eval one-a-row/packed " in r.stdout
  res = json.loads(out.read_text())
  assert res["max_diff"] <= 1e-5 and res["window"] == 64
  packed, alone = res["legs"]["packed"], res["legs"]["one-a-row"]
  assert packed["requests"] == alone["requests"] == alone["rows"] == 256
  assert packed["rows"] < alone["rows"] and packed["metrics"] == pytest.approx(alone["metrics"])
  assert len(packed["round_s"]) == len(alone["round_s"]) == 1

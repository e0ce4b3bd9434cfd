"""defeval and `sexpgpu eval`: downstream tasks scored during training and from a checkpoint;
packed rows score as one request a row does; the training steps are the same with or
without an evaluation, and a resume reports the same scores at the same step."""

import glob
import json
import math
import os
import re

import numpy as np
import pytest

from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SX = """
(require std/nn)
(require std/lm)
(defknob cache "cache")
(defknob vocab 512)
(defknob every 10)
(defloader train (text cache :seq 17 :batch 4 :pack docs :vocab vocab))
(defn lm [tokens :segments nil :positions nil]
  (transformer-lm tokens :vocab vocab :width 16 :layers 1 :heads 2 :segments segments
                  :positions positions))
(defn loss [batch]
  (let [t (get batch :tokens) s (get batch :segments)]
    (next-token-loss (lm (lm-inputs t) :segments (lm-inputs s)
                         :positions (lm-inputs (get batch :positions))) t :segments s)))
EVAL
(defrun :loss loss :data train :steps 20 :optimizer (adamw :lr 1e-2) :precision f32 :seed 0)
"""
EVAL = '(defeval bench :fn lm :tasks ["choice.jsonl" "cloze.jsonl"] :every every :batch 4)'

CHOICE = [
    {"context": "The river", "choices": ["ran past the mill", "blue", "and the"], "gold": 0},
    {"context": "The keeper climbed  ", "choices": ["the stairs", "a wall"], "gold": 1},
    {"context": "The lighthouse " * 12, "choices": ["stood", "fell"], "gold": 0},  # too long
    {"context": "", "choices": ["garden", "river"], "gold": 1},
]
CLOZE = [{"text": "The river ran past the old mill and the keeper watched it from the tower, "
                  "where the light turned all night over the water and the stones."},
         {"text": "A garden of stones."}]


def _jsonl(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def _write(folder, name, with_eval=True):
  path = os.path.join(folder, name)
  with open(path, "w") as f:
    f.write(SX.replace("EVAL", EVAL if with_eval else ""))
  return path


def _events(path, kind):
  with open(path) as f:
    return [e for e in map(json.loads, f) if e["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A token cache, two tasks, and four runs: with the evaluation, without it, and the
  first stopped at step 10 then resumed to 20."""
  tmp = str(tmp_path_factory.mktemp("eval"))
  assert main(["tokenize", *sorted(glob.glob(os.path.join(ROOT, "configs/data/*.txt"))),
               "-o", os.path.join(tmp, "cache"), "--train-bpe", "512"]) == 0
  _jsonl(os.path.join(tmp, "choice.jsonl"), CHOICE)
  _jsonl(os.path.join(tmp, "cloze.jsonl"), CLOZE)
  paths = {"with": _write(tmp, "e.sx"), "without": _write(tmp, "plain.sx", with_eval=False),
           "split": _write(tmp, "split.sx")}
  out = {"tmp": tmp, "paths": paths}
  for key, path, extra in (("with", paths["with"], []), ("without", paths["without"], []),
                           ("split1", paths["split"], ["--steps", "10"]),
                           ("split2", paths["split"], ["--resume", "latest"])):
    metrics = os.path.join(tmp, f"{key}.jsonl")
    assert main(["run", path, "--metrics", f"jsonl:{metrics}", "--checkpoint-dir",
                 os.path.join(tmp, "ck"), *extra]) == 0, key
    out[key] = metrics
  return out


@pytest.mark.slow  # reads defeval's runs: with, without, stopped and resumed
def test_a_defeval_scores_its_tasks_at_its_steps(runs):
  got = _events(runs["with"], "eval")
  assert [(e["step"], e["task"]) for e in got] == [
      (s, t) for s in (0, 10, 20) for t in ("choice", "cloze")]
  first = got[0]
  assert first["documents"] == 3 and first["skipped"] == 1 and first["requests"] == 7
  assert set(first["metrics"]) == {"bench/choice/acc", "bench/choice/acc_norm"}
  assert set(got[1]["metrics"]) == {"bench/cloze/bits_per_byte"}
  (summary,) = _events(runs["with"], "summary")
  assert summary["eval"]["bench/cloze/bits_per_byte"] == got[5]["metrics"][
      "bench/cloze/bits_per_byte"]


@pytest.mark.slow  # reads defeval's runs: with, without, stopped and resumed
def test_the_evaluation_leaves_the_training_steps_unchanged(runs):
  def losses(path):
    return [(e["step"], e["train/loss"]) for e in _events(path, "step")]
  assert len(losses(runs["with"])) == 20
  assert losses(runs["with"]) == losses(runs["without"])  # bitwise


@pytest.mark.slow  # reads defeval's runs: with, without, stopped and resumed
def test_a_resume_reports_the_same_scores_at_the_same_step(runs):
  full = {(e["step"], e["task"]): e["metrics"] for e in _events(runs["with"], "eval")}
  first = _events(runs["split1"], "eval")
  resumed = _events(runs["split2"], "eval")
  assert [e["step"] for e in first] == [0, 0, 10, 10]
  assert [e["step"] for e in resumed] == [20, 20]  # none again at the step it resumed from
  for e in first + resumed:
    assert e["metrics"] == full[(e["step"], e["task"])]


def test_sexpgpu_eval_scores_a_checkpoint_as_the_run_did(runs, capsys):
  capsys.readouterr()
  assert main(["eval", runs["paths"]["with"], "--resume", "latest", "--checkpoint-dir",
               os.path.join(runs["tmp"], "ck"), "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["step"] == 20
  at_20 = {k: v for e in _events(runs["with"], "eval") if e["step"] == 20
           for k, v in e["metrics"].items()}
  assert out["metrics"].keys() == at_20.keys()
  for k, v in at_20.items():
    assert out["metrics"][k] == pytest.approx(v, abs=1e-6)
  assert out["tasks"][0]["skipped_lines"] == [3]


def test_check_lists_each_task_and_its_rows(runs, capsys):
  capsys.readouterr()
  assert main(["check", runs["paths"]["with"]]) == 0
  text = capsys.readouterr().out
  assert "bench: :fn lm, window 16, packed, 4 rows a call" in text
  assert re.search(r"choice \(choice\): 4 documents, 7 requests in \d rows, 1 skipped", text)
  assert re.search(r"cloze \(text\): 2 documents, \d requests in \d rows", text)


@pytest.fixture(scope="module")
def scorer_parts(runs):
  from sexpgpu.models import sample
  from sexpgpu.run.compile import compile_file
  from sexpgpu.lower.init import init_params
  c = compile_file(runs["paths"]["with"])
  params = {k: np.asarray(v) for k, v in init_params(3, c.params).items()}
  return c, params, sample.tokenizer_of(c, None), runs["tmp"]


def test_packed_rows_score_as_one_request_a_row(scorer_parts):
  from sexpgpu.models import evaluate
  c, params, tok, tmp = scorer_parts
  for name in ("choice", "cloze"):
    task = evaluate.load_task(os.path.join(tmp, f"{name}.jsonl"))
    packed = evaluate.Scorer(c, "lm", tok, batch=4, packed=True).score(params, task)
    alone = evaluate.Scorer(c, "lm", tok, batch=4, packed=False).score(params, task)
    assert packed.rows < alone.rows if name == "choice" else packed.rows <= alone.rows
    a = np.array(packed.loglikelihoods, dtype=object)
    b = np.array(alone.loglikelihoods, dtype=object)
    np.testing.assert_allclose(np.hstack(a).astype(float), np.hstack(b).astype(float),
                               atol=1e-5, rtol=0)
    assert packed.metrics.keys() == alone.metrics.keys()


def test_bits_per_byte_of_a_nearly_uniform_model(scorer_parts):
  """At initialization the logits are nearly equal: every token costs about log2(512) bits."""
  from sexpgpu.models import evaluate
  c, params, tok, tmp = scorer_parts
  task = evaluate.load_task(os.path.join(tmp, "cloze.jsonl"))
  got = evaluate.Scorer(c, "lm", tok, batch=4).score(params, task)
  tokens = sum(len(tok.encode(d["text"]).ids) for d in CLOZE)
  nbytes = sum(len(d["text"].encode()) for d in CLOZE)
  # a window of 16 predictions a request: the long text takes several
  assert got.requests == sum(math.ceil(len(tok.encode(d["text"]).ids) / 16) for d in CLOZE) > 2
  assert got.metrics["bits_per_byte"] == pytest.approx(tokens * 9 / nbytes, rel=0.02)


def test_rolling_windows_predict_every_token_once_after_the_prefix():
  from sexpgpu.models.evaluate import rolling_windows
  ids = list(range(10, 47))  # 37 tokens in windows of 16
  wins = list(rolling_windows(ids, 0, 16))
  assert [n for _, n in wins] == [16, 16, 5]
  predicted = [t for toks, n in wins for t in toks[1:][-n:]]
  assert predicted == ids
  assert all(len(toks) - 1 <= 16 for toks, _ in wins)
  assert wins[0][0][0] == 0 and wins[-1][0] == tuple(ids[-17:])  # the last reads 16 before


def test_the_harness_split_moves_the_context_s_trailing_spaces(scorer_parts):
  from sexpgpu.models.evaluate import encode_pair
  _, _, tok, _ = scorer_parts
  ctx, cont = encode_pair(tok, "The keeper climbed  ", " the stairs")
  whole = tok.encode("The keeper climbed   the stairs").ids
  assert ctx == tok.encode("The keeper climbed").ids and ctx + cont == whole


@pytest.mark.parametrize("lines,line,what", [
    (['{"text": "ok"}', '{"text": "a" '], 2, "not JSON"),
    (['{"context": "a", "choices": ["x", "y"]}'], 1, "no 'gold'"),
    (['{"context": "a", "choices": ["x", "y"], "gold": 2}'], 1, '"gold" must be the index'),
    (['{"context": "a", "choices": ["x"], "gold": 0}'], 1, "two or more"),
    (['{"text": "ok"}', '{"context": "a", "choices": ["x", "y"], "gold": 0}'], 2,
     "a choice document in a task whose first document is text"),
    (['[1, 2]'], 1, "not an object"),
    (['{"text": ""}'], 1, "non-empty"),
])
def test_a_task_file_that_does_not_parse_names_its_file_and_line(tmp_path, lines, line, what):
  from sexpgpu.models.evaluate import load_task
  path = tmp_path / "t.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(SxError) as e:
    load_task(str(path))
  assert e.value.code == "E-EVAL-001"
  assert f"{path}:{line}:" in e.value.message and what in e.value.message
  assert e.value.location.line == line


def test_an_empty_task_file_and_a_missing_one(tmp_path, runs, capsys):
  from sexpgpu.models.evaluate import load_task
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(SxError, match="holds no document") as e:
    load_task(str(tmp_path / "empty.jsonl"))
  assert e.value.code == "E-EVAL-001"
  path = tmp_path / "m.sx"
  path.write_text(SX.replace("EVAL", EVAL.replace("cloze.jsonl", "nope.jsonl"))
                  .replace('"cache"', json.dumps(os.path.join(runs["tmp"], "cache")))
                  .replace('"choice.jsonl"', json.dumps(os.path.join(runs["tmp"],
                                                                    "choice.jsonl"))))
  capsys.readouterr()
  assert main(["check", str(path)]) != 0
  err = capsys.readouterr().err
  assert "E-EVAL-001" in err and "nope.jsonl" in err and f"{path}:" in err


def test_a_defeval_without_a_tokenizer(tmp_path, capsys):
  path = tmp_path / "markov.sx"
  path.write_text("""
(require std/lm)
(defloader train (markov :vocab 16 :seq 9 :batch 2 :seed 7))
(defn lm [tokens] (transformer-lm tokens :vocab 16 :width 8 :layers 1 :heads 2))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defeval bench :fn lm :tasks ["t.jsonl"] :every 5)
(defrun :loss loss :data train :steps 2 :optimizer (adamw :lr 1e-2))
""")
  _jsonl(tmp_path / "t.jsonl", CLOZE)
  capsys.readouterr()
  assert main(["check", str(path)]) != 0
  err = capsys.readouterr().err
  assert "E-EVAL-002" in err and "defeval bench has no tokenizer" in err and ":tokenizer" in err


def test_packing_asked_of_a_function_without_segments(scorer_parts, tmp_path):
  from sexpgpu.models import evaluate
  from sexpgpu.run.compile import compile_file
  _, _, tok, tmp = scorer_parts
  path = tmp_path / "np.sx"
  path.write_text(SX.replace("EVAL", "").replace('"cache"', json.dumps(os.path.join(tmp, "cache")))
                  .replace("(defn loss", "(defn bare [tokens] (lm tokens))\n(defn loss"))
  c = compile_file(str(path))
  with pytest.raises(SxError, match="takes no :segments and :positions") as e:
    evaluate.Scorer(c, "bare", tok, packed=True)
  assert e.value.code == "E-EVAL-002"


def test_a_task_the_model_cannot_score(scorer_parts, tmp_path):
  from tokenizers import Tokenizer
  from sexpgpu.models import evaluate
  c, params, tok, tmp = scorer_parts
  _jsonl(tmp_path / "long.jsonl", [CHOICE[2]])
  scorer = evaluate.Scorer(c, "lm", tok, batch=4)
  with pytest.raises(SxError, match="fits the model's window of 16 tokens") as e:
    scorer.score(params, evaluate.load_task(str(tmp_path / "long.jsonl")))
  assert e.value.code == "E-EVAL-003"
  # a tokenizer of 2048 ids for a model of 512
  assert main(["tokenize", *sorted(glob.glob(os.path.join(ROOT, "configs/data/*.txt"))), "-o",
               str(tmp_path / "big"), "--train-bpe", "2048"]) == 0
  big = Tokenizer.from_file(str(tmp_path / "big" / "tokenizer.json"))
  with open(os.path.join(ROOT, "configs/data/lighthouse.txt")) as f:
    text = f.read()[:2000]
  assert max(big.encode(text).ids) >= 512
  _jsonl(tmp_path / "words.jsonl", [{"text": text}])
  with pytest.raises(SxError, match="past the model's vocabulary of 512") as e:
    evaluate.Scorer(c, "lm", big, batch=4).score(
        params, evaluate.load_task(str(tmp_path / "words.jsonl")))
  assert e.value.code == "E-EVAL-003"

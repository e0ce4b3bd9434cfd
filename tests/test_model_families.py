"""The model families past transformers, each a shipped config trained in its smoke variant:
a masked LM (random masking in the graph), a CNN on shipped images, a mixture-of-experts LM
(std/moe.sx: routing with a capacity, auxiliary losses reported) and a gated linear
recurrence LM. Each trains (its loss falls); the masked LM is the same twice and its pass
draws the same masks each time it runs; the MoE routing equals a NumPy reference."""

import json
import math
import os

import numpy as np
import pytest

import sexpgpu
from conftest import ROOT

CONFIGS = os.path.join(ROOT, "configs")


def _train(name, tmp_path, tag="run", **run):
  """Trains configs/<name>.sx --variant smoke; (summary, step events, pass events)."""
  m = tmp_path / f"{name}-{tag}.jsonl"
  exp = sexpgpu.compile(os.path.join(CONFIGS, f"{name}.sx"), variant="smoke",
                        diagnostics=run.pop("diagnostics", None))
  s = exp.run(metrics=f"jsonl:{m}", **run)
  events = [json.loads(line) for line in m.read_text().splitlines()]
  return (s, [e for e in events if e["kind"] == "step"],
          [e for e in events if e["kind"] == "pass"], events)


def _falls(steps, passes, metric="eval/loss", ratio=0.9):
  """The loss of the last pass is below `ratio` × the first (at step 0), and the mean train
  loss of the last five steps below that of the first five."""
  first, last = passes[0]["metrics"][metric], passes[-1]["metrics"][metric]
  assert passes[0]["step"] == 0 and last < ratio * first, (first, last)
  losses = [e["train/loss"] for e in steps]
  assert len(losses) >= 10 and np.mean(losses[-5:]) < np.mean(losses[:5]), losses


# --- the masked LM -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("mlm")
  return tmp, _train("mlm", tmp, checkpoint_dir=str(tmp / "ck"))


@pytest.mark.slow  # trains a model family's smoke variant
def test_masked_lm_trains(mlm):
  _, (s, steps, passes, _) = mlm
  assert s.steps == 60 and [p["step"] for p in passes] == [0, 20, 40, 60]
  assert passes[0]["metrics"]["eval/loss"] == pytest.approx(math.log(32), abs=1e-3)
  _falls(steps, passes, ratio=0.9)
  assert passes[-1]["metrics"]["eval/accuracy"] > 3 / 32  # chance is 1/32


@pytest.mark.slow  # trains a model family's smoke variant
def test_masked_lm_is_the_same_twice(mlm, tmp_path):
  _, (s, steps, passes, _) = mlm
  s2, steps2, passes2, _ = _train("mlm", tmp_path, "again")
  # the masks are drawn from the run's key: the same run is the same, bit for bit
  assert [e["train/loss"] for e in steps2] == [e["train/loss"] for e in steps]
  assert s2.train_loss == s.train_loss and s2.eval == s.eval
  assert [p["metrics"] for p in passes2] == [p["metrics"] for p in passes]


@pytest.mark.slow  # trains a model family's smoke variant
def test_masked_lm_pass_draws_the_same_masks_each_time(mlm):
  tmp, (s, _, passes, _) = mlm
  exp = sexpgpu.compile(os.path.join(CONFIGS, "mlm.sx"), variant="smoke")
  # --steps 0 with --resume: only the final passes, on the checkpoint of the last step
  again = [exp.run(steps=0, checkpoint_dir=str(tmp / "ck"), resume="latest").eval
           for _ in range(2)]
  assert again[0] == again[1] == s.eval == passes[-1]["metrics"]


# --- the CNN -------------------------------------------------------------------------------
def test_shipped_images_are_what_the_script_writes():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "make_images", os.path.join(ROOT, "benchmarks", "make_images.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  made = mod.make(0, 1200)
  with np.load(os.path.join(CONFIGS, "data", "shapes.npz")) as z:
    assert sorted(z.files) == ["x", "y"]
    np.testing.assert_array_equal(z["x"], made["x"])
    np.testing.assert_array_equal(z["y"], made["y"])
  assert made["x"].shape == (1200, 12, 12, 1) and made["x"].dtype == np.uint8
  assert np.bincount(made["y"]).tolist() == [300, 300, 300, 300]


@pytest.mark.slow  # trains a model family's smoke variant
def test_cnn_trains_past_chance(tmp_path):
  s, steps, passes, _ = _train("cnn", tmp_path)
  assert s.steps == 60 and [p["step"] for p in passes] == [0, 20, 40, 60]
  _falls(steps, passes, ratio=0.8)
  assert s.eval["eval/accuracy"] > 0.55  # four classes: chance is 0.25


# --- the mixture of experts ----------------------------------------------------------------
@pytest.mark.slow  # trains a model family's smoke variant
def test_moe_lm_trains_and_reports_its_auxiliary_losses(tmp_path):
  s, steps, passes, events = _train("moe-lm", tmp_path,
                                    diagnostics="train-balance,train-z-loss")
  assert s.steps == 60
  _falls(steps, passes, ratio=0.6)
  for p in passes:
    m = p["metrics"]
    assert sorted(m) == ["eval/balance", "eval/lm-loss", "eval/loss", "eval/z-loss"]
    assert all(np.isfinite(v) for v in m.values())
    # the load-balancing loss is 1 for a balanced router; the z-loss is logsumexp² > 0
    assert 0.9 < m["eval/balance"] < 2.0 and m["eval/z-loss"] > 0
    # the loss is the LM loss plus the weighted auxiliary losses
    assert m["eval/loss"] == pytest.approx(
        m["eval/lm-loss"] + 0.01 * m["eval/balance"] + 0.001 * m["eval/z-loss"], rel=1e-5)
  diags = {}
  for e in events:
    if e["kind"] == "diagnostic":
      diags.setdefault(e["name"], []).append((e["step"], e["value"]))
  assert sorted(diags) == ["train-balance", "train-z-loss"]
  for name, vals in diags.items():
    assert [st for st, _ in vals] == list(range(1, 61)), name
    assert all(np.isfinite(v) and v > 0 for _, v in vals), name


ROUTE = """(require std/moe)
(defloader train (markov :vocab 8 :seq 4 :batch 2 :seed 1))
(defn loss [batch] (* (param w [] :init ones) (mean (cast (get batch :tokens) f32))))
(defn dispatch [logits] (get (moe-route logits :k 2 :capacity 3) 0))
(defn combine [logits] (get (moe-route logits :k 2 :capacity 3) 1))
(defn balance [logits] (get (moe-route logits :k 2 :capacity 3) 2))
(defn z-loss [logits] (get (moe-route logits :k 2 :capacity 3) 3))
(defn slots [x] (zeros [(moe-capacity 256 4 :k 2 :factor 1.25) (moe-capacity 10 3 :k 1 :factor 1.0)
                        (moe-capacity 7 2 :k 2 :factor 1.5) (moe-capacity 1 8 :k 1 :factor 1.0)
                        (moe-capacity 8 4 :k 2 :factor 1.0)]))
(defrun :loss loss :data train :steps 1 :optimizer (sgd :lr 0.1))
"""


def _np_route(logits, k, capacity):
  """GShard's routing with a capacity, by loops: first choices take slots before second ones."""
  n, e = logits.shape
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
  gates = np.take_along_axis(p, idx, -1)
  gates /= gates.sum(-1, keepdims=True)
  dispatch = np.zeros((n, e, capacity), np.float32)
  combine = np.zeros((n, e, capacity), np.float32)
  used = [0] * e
  for j in range(k):
    for t in range(n):
      x = idx[t, j]
      if used[x] < capacity:
        dispatch[t, x, used[x]] = 1.0
        combine[t, x, used[x]] = gates[t, j]
      used[x] += 1
  fraction = np.bincount(idx.ravel(), minlength=e) / (n * k)
  balance = e * np.sum(fraction * p.mean(0))
  lse = np.log(np.exp(logits).sum(-1))
  return dispatch, combine, balance, np.mean(lse ** 2)


def test_moe_routing_equals_a_reference_with_capacity():
  exp = sexpgpu.compile_text(ROUTE, "route.sx")
  rng = np.random.default_rng(0)
  # 9 tokens, 4 experts, 2 each, 3 slots an expert: 18 assignments for 12 slots, so some
  # drop; experts 0 and 1 are favoured so that they overflow
  logits = (rng.normal(size=(9, 4)) + np.array([1.5, 1.0, 0.0, -0.5])).astype(np.float32)
  want = _np_route(logits, 2, 3)
  got = [np.asarray(exp.call(f, {}, logits)) for f in ("dispatch", "combine", "balance",
                                                        "z-loss")]
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
  np.testing.assert_allclose(got[3], want[3], rtol=1e-6)
  chosen = np.bincount(np.argsort(-logits, axis=-1)[:, :2].ravel(), minlength=4)
  held = got[0].sum(axis=(0, 2))
  assert held.tolist() == np.minimum(chosen, 3).tolist() and held.sum() < 18  # some dropped
  assert np.asarray(exp.call("slots", {}, logits)).shape == (160, 4, 11, 1, 4)


# --- the gated linear recurrence -----------------------------------------------------------
@pytest.mark.slow  # trains a model family's smoke variant
def test_ssm_lm_trains(tmp_path):
  s, steps, passes, _ = _train("ssm-lm", tmp_path)
  assert s.steps == 60
  _falls(steps, passes, ratio=0.6)


# --- the benchmark's twins -----------------------------------------------------------------
def test_bench_ops_twins_compute_what_the_graphs_compute(tmp_path):
  # a smoke of benchmarks/bench_ops.py at its --quick shapes: its hand-written twin of
  # linear attention by cumsum agrees with the compiled graph (loss and every gradient:
  # run_case asserts it) and one timed round gives a ratio
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "bench_ops", os.path.join(ROOT, "benchmarks", "bench_ops.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  table = bench.cases(quick=True)
  assert sorted(table) == ["cnn", "linear-attention", "moe", "recurrence"]
  res = bench.run_case("linear-attention", *table["linear-attention"], 1, 1, str(tmp_path))
  assert res["case"] == "linear-attention" and res["grad_err"] < 1e-4 and res["ratio"] > 0

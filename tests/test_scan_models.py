"""Models made with `scan` and `associative-scan`: a GRU language model (tests/data/gru-lm.sx)
trains with falling loss and its FLOPs agree with XLA's; decoding a scan keeps its carry and
an associative scan its running combination, with logits equal to the full forward's at
every position and greedy tokens equal to recomputing the window."""

import json
import os

import jax
import numpy as np
import pytest

import sexpgpu
from conftest import ROOT
from sexpgpu.ir import ops_scan
from sexpgpu.ir.ops import DTYPES, LowerCtx
from sexpgpu.lower.flops import forward_flops, train_flops
from sexpgpu.lower.init import init_params
from sexpgpu.lower.interp import run_graph
from sexpgpu.models import decode, sample, source
from sexpgpu.run.compile import compile_file, compile_source
from decoding import incremental_against_full
from test_decode_carries import HEAD

GRU = os.path.join(ROOT, "tests", "data", "gru-lm.sx")
W = 12

ASSOC = HEAD + """(defn lm [tokens]
  (let [h (embed tokens)
        a (sigmoid (matmul h (param wa [16 16] :init (normal 0.5))))
        x (matmul h (param wx [16 16] :init (normal 0.5)))
        [_ s] (associative-scan (fn [[a1 x1] [a2 x2]] [(* a1 a2) (+ (* a2 x1) x2)]) [a x]
                                :axis 1)]
    (head (+ h s))))"""

# a scan inside a repeat: its parameters stacked per layer, shared over positions
IN_REPEAT = HEAD + """(defn layer [e]
  (let [[_ hs] (scan (fn [h x] (let [n (tanh (+ (matmul h (param w [16 16] :init (normal 0.3)))
                                                x))] [n n]))
                     (zeros [(dim e 0) 16]) e :axis 1)]
    (+ e hs)))
(defn lm [tokens] (head (repeat 2 layer (embed tokens))))"""


@pytest.fixture(scope="module")
def gru_run(tmp_path_factory):
  m = tmp_path_factory.mktemp("gru") / "m.jsonl"
  s = sexpgpu.compile(GRU).run(metrics=f"jsonl:{m}")
  events = [json.loads(line) for line in m.read_text().splitlines()]
  return s, events


def test_the_gru_lm_trains(gru_run):
  s, events = gru_run
  passes = [e for e in events if e["kind"] == "pass"]
  losses = [e["train/loss"] for e in events if e["kind"] == "step"]
  assert s.steps == 40 and [p["step"] for p in passes] == [0, 20, 40]
  first, last = passes[0]["metrics"]["eval/loss"], passes[-1]["metrics"]["eval/loss"]
  assert first == pytest.approx(np.log(16), abs=0.2) and last < 0.6 * first, (first, last)
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def test_the_gru_lm_counts_its_flops_as_xla_does(monkeypatch):
  monkeypatch.setattr(ops_scan, "UNROLL", True)  # XLA's cost analysis counts a loop once
  g = compile_file(GRU).stages[0].graph
  params = {p: jax.ShapeDtypeStruct(prm.full_shape, DTYPES[prm.dtype])
            for p, prm in g.params.items()}
  inputs = {f: jax.ShapeDtypeStruct(n.shape, DTYPES[n.dtype]) for f, n in g.inputs.items()}
  loss = lambda p, x: run_graph(g, p, x, LowerCtx())["out"]  # noqa: E731

  def xla(fn):
    cost = jax.jit(fn).lower(params, inputs).cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]

  forward_xla, step_xla = xla(loss), xla(jax.value_and_grad(loss))
  assert 0.9 <= forward_flops(g) / forward_xla <= 1.1, (forward_flops(g), forward_xla)
  assert 0.9 <= train_flops(g, 1) / step_xla <= 1.1, (train_flops(g, 1), step_xla)


def _perturbed(c):
  return {k: v + 0.05 * jax.random.normal(jax.random.key(i), v.shape)
          for i, (k, v) in enumerate(sorted(init_params(2, c.params).items()))}


@pytest.fixture(scope="module", params=["scan", "associative-scan", "scan-in-repeat"])
def model(request):
  if request.param == "scan":
    c, fn = compile_file(GRU), "gru-lm"
  else:
    c, fn = compile_source(ASSOC if request.param == "associative-scan" else IN_REPEAT,
                           "model.sx"), "lm"
    if request.param == "scan-in-repeat":
      assert c.params["lm/repeat/layer/w"].full_shape == (2, 16, 16)
  return request.param, c, fn, _perturbed(c)


def test_the_plan_names_the_carry(model):
  name, c, fn, _ = model
  text = decode.explain(source.logits_graph(c, fn, W), W)
  role = {"associative-scan": "running combination kept (carry)"}.get(
      name, "scan carry kept (carry)")
  assert text.startswith("decode: incremental") and "carries kept 1" in text
  assert text.count(role) == 1, text


def test_incremental_logits_equal_the_full_forward_at_every_position(model):
  name, c, fn, params = model
  diff, sizes = incremental_against_full(c, fn, params, W, vocab=16, seed=1)
  assert diff < 1e-5, name
  assert all(W not in s for s in sizes), (name, sizes)  # one position's state


def test_greedy_tokens_equal_recomputing_the_window(model):
  name, c, fn, params = model
  host = {k: np.asarray(v) for k, v in params.items()}
  settings = sample.Settings(tokens=W - 3, temperature=0.0)
  fast = sample.generate(c, fn, host, [1, 2, 3], settings)
  slow = sample.generate(c, fn, host, [1, 2, 3], settings, path="recompute")
  assert (fast.path, slow.path) == ("incremental", "recompute"), name
  assert fast.ids == slow.ids and len(fast.ids) == W - 3, name


@pytest.mark.parametrize("lm,why", [
    ("(let [[_ hs] (scan (fn [h x] [(tanh (+ h x)) h]) (zeros [1 16]) (embed tokens) :axis 1"
     " :reverse true)] (head hs))", "runs backwards along positions"),
    ("(let [e (embed tokens) [h _] (scan (fn [h x] [(tanh (+ h x)) h]) (zeros [1 16]) e"
     " :axis 1)] (head (+ e (expand h 1))))", "carry after the last position"),
])
def test_a_scan_that_mixes_positions_recomputes_and_says_why(lm, why):
  c = compile_source(HEAD.replace(":batch 2", ":batch 1") + f"(defn lm [tokens] {lm})",
                     "mix.sx")
  text = decode.explain(source.logits_graph(c, "lm", W), W)
  assert text.startswith("decode: recompute") and why in text.splitlines()[0], text

"""Incremental decoding past attention: a causal conv keeps a window cache, a cumsum and a
linear recurrence along positions keep their carry; logits equal the full forward's at every
position and greedy tokens equal recomputing the window."""

import jax
import numpy as np
import pytest

from sexpgpu.models import decode, sample, source
from sexpgpu.run.compile import compile_source
from decoding import incremental_against_full

HEAD = """(defloader train (markov :vocab 20 :seq 13 :batch 2 :seed 7))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (cross-entropy (lm (slice t 1 0 -1)) (slice t 1 1 nil))))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
(defn embed [tokens] (take (param embed [20 16] :init (normal 0.5)) tokens))
(defn head [h] (matmul (tanh h) (param out [16 20] :init (normal 0.5))))
"""

MODELS = {
    "conv": ("""(defn lm [tokens]
  (let [h (embed tokens)
        h (conv h (param k1 [3 16 16] :init (normal 0.2)) :padding "causal")
        h (conv (tanh h) (param k2 [2 1 16] :init (normal 0.4)) :padding "causal" :groups 16
                :dilation 2)]
    (head h)))""", {"window": 2}),
    "cumsum": ("""(defn lm [tokens]
  (let [h (embed tokens)
        q (relu (matmul h (param wq [16 16] :init (normal 0.3))))
        k (relu (matmul h (param wk [16 16] :init (normal 0.3))))
        v (matmul h (param wv [16 16] :init (normal 0.3)))
        kv (cumsum (* (expand k 3) (expand v 2)) :axis 1)
        z (cumsum k :axis 1 :exclusive true)
        num (sum (* (expand q 3) kv) 2)
        den (+ (sum (* q z) -1 :keep true) 1.0)]
    (head (+ h (/ num den)))))""", {"running": 2}),
    "recurrence": ("""(defn lm [tokens]
  (let [h (embed tokens)
        a (sigmoid (matmul h (param wa [16 16] :init (normal 0.5))))
        x (matmul h (param wx [16 16] :init (normal 0.5)))
        s (linear-recurrence a (* (- 1.0 a) x) :axis 1)
        s2 (cumprod (+ 0.5 (* 0.5 a)) :axis 1)]
    (head (+ h s s2))))""", {"recurrence": 1, "running": 1}),
}
W = 12


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
  text, kinds = MODELS[request.param]
  c = compile_source(HEAD + text, f"{request.param}.sx")
  from sexpgpu.lower.init import init_params
  params = {k: v + 0.05 * jax.random.normal(jax.random.key(i), v.shape)
            for i, (k, v) in enumerate(sorted(init_params(2, c.params).items()))}
  return request.param, c, params, kinds


def test_the_plan_names_each_carry(model):
  name, c, _, kinds = model
  pl = decode.plan(source.logits_graph(c, "lm", W), W)
  found = {}
  for kind in pl.carries.values():
    found[kind] = found.get(kind, 0) + 1
  assert found == kinds and not pl.attention, name
  text = decode.explain(source.logits_graph(c, "lm", W), W)
  assert text.startswith("decode: incremental") and f"carries kept {sum(kinds.values())}" in text
  role = {"window": "window cache", "running": "running total kept",
          "recurrence": "recurrence state kept"}
  for kind in kinds:
    assert role[kind] in text, (name, text)


def test_incremental_logits_equal_the_full_forward_at_every_position(model):
  name, c, params, _ = model
  diff, sizes = incremental_against_full(c, "lm", params, W, vocab=20, seed=0)
  assert diff < 1e-5, name
  # the state kept does not grow with positions
  assert all(W not in s for s in sizes), (name, sizes)


def test_greedy_tokens_equal_recomputing_the_window(model):
  name, c, params, _ = model
  host = {k: np.asarray(v) for k, v in params.items()}
  settings = sample.Settings(tokens=W - 3, temperature=0.0)
  fast = sample.generate(c, "lm", host, [1, 2, 3], settings)
  slow = sample.generate(c, "lm", host, [1, 2, 3], settings, path="recompute")
  assert (fast.path, slow.path) == ("incremental", "recompute"), name
  assert fast.ids == slow.ids and len(fast.ids) == W - 3, name

"""One graph walk: the reference interpreter takes a per-node rule, and incremental decoding
is that walk with rules for only the nodes its plan names (caches, tables, iotas); every
other node is evaluated by the interpreter's own handling and lowering lookup."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sexpgpu.ir.graph import walk
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower import interp
from sexpgpu.models import decode, source

LLAMA = """
(require std/lm)
(require std/llama)
(defloader train (markov :vocab 30 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab 30 :width 16 :layers 2 :heads 2 :kv-heads 1 :hidden 24 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""
W = 8


@pytest.fixture(scope="module")
def model():
  from sexpgpu.lower.init import init_params
  from sexpgpu.run.compile import compile_source
  c = compile_source(LLAMA, "one.sx")
  params = {k: v + 0.05 * jax.random.normal(jax.random.key(i), v.shape)
            for i, (k, v) in enumerate(sorted(init_params(2, c.params).items()))}
  return source.logits_graph(c, "lm", W), params


def test_a_rule_replaces_the_nodes_it_answers_and_the_interpreter_does_the_rest(model):
  graph, params = model
  toks = np.arange(W, dtype=np.int32)[None] % 30
  ctx = LowerCtx("f32")
  asked = []
  path = sorted(p for p in params if "embed" in p)[0]

  def rule(node, env):
    asked.append(node.uid)
    if node.op == "param" and node.attr("path") == path:
      return jnp.zeros_like(params[path])
    return interp.NOT_HANDLED

  got = interp.run_graph(graph, params, {"tokens": toks}, ctx, rule=rule)["out"]
  want = interp.run_graph(graph, {**params, path: jnp.zeros_like(params[path])},
                          {"tokens": toks}, ctx)["out"]
  plain = interp.run_graph(graph, params, {"tokens": toks}, ctx)["out"]
  assert np.array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(got), np.asarray(plain))
  # asked once for each node of the graph outside bodies, in the walk's order
  assert asked == [n.uid for n in graph.nodes()]


def test_decode_walks_with_the_interpreter_and_names_only_its_own_nodes(model, monkeypatch):
  graph, params = model
  pl = decode.plan(graph, W)
  assert len(pl.attention) == 1 and pl.iotas
  seen = []
  real = interp.lowering

  def spy(op, platform):
    seen.append(op)
    return real(op, platform)

  # the interpreter's lowering lookup, which decoding does not name for these nodes
  monkeypatch.setattr(interp, "lowering", spy)
  ctx = LowerCtx("f32")
  cache = decode.empty_cache(pl, params, ctx)
  seen.clear()
  out, _ = jax.eval_shape(lambda p, c: decode.run(pl, p, jnp.zeros((1, 1), jnp.int32), ctx, c,
                                                  jnp.int32(3)), params, cache)
  assert out.shape == (1, 1, 30)
  assert "sdpa" not in seen  # decode's rule: attention over the cache
  # every other node of the walk, outside the repeat and once in each of its two layers,
  # is looked up by the interpreter: one walk, decode naming none of these ops
  mine = ({n.uid for n in pl.attention} | set(pl.tables) | set(pl.iotas) | set(pl.carries))

  def ordinary(nodes, skip=frozenset()):
    return Counter(n.op for n in nodes if n.uid not in mine and n.uid not in skip
                   and n.op not in ("param", "input", "repeat", "part", "carry")
                   and not (n.op in ("reshape", "broadcast") and pl.axes.get(n.uid) is not None))

  outer = graph.nodes()
  (rep,) = [n for n in outer if n.op == "repeat"]
  body = list(walk([rep.attr("body").output]))
  layer = ordinary(body, {n.uid for n in outer})
  want = ordinary(outer) + layer + layer
  assert Counter(seen) == want
  assert layer["matmul"] >= 4 and pl.iotas & {n.uid for n in body}

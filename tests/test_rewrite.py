"""Rewrites: each pattern fires where it should, not on near misses, and changes no result."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sexpgpu.ir.graph import Graph, Node, walk
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.ir.rewrite import Region, rewrite
from sexpgpu.ir.verify import verify
from sexpgpu.lower.interp import run_graph
from sexpgpu.run.compile import compile_file, compile_source


@pytest.fixture(autouse=True)
def _patterns_off_in_the_pipeline(monkeypatch):
  """Graphs come from the pipeline unrewritten, so each test applies `rewrite` itself."""
  monkeypatch.setenv("SEXPGPU_PATTERNS", "off")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=1e-5, atol=1e-5)


def all_ops(graph: Graph) -> list[str]:
  """Every node's op, repeat bodies included."""
  ops, pending = [], [list(graph.outputs.values())]
  while pending:
    for n in walk(pending.pop()):
      ops.append(n.op)
      if n.op == "repeat":
        pending.append([n.attr("body").output])
  return ops


def random_params(graph: Graph, seed: int = 0) -> dict:
  r = np.random.default_rng(seed)
  return {p: jnp.asarray(r.normal(0.0, 0.3, prm.full_shape), jnp.float32)
          for p, prm in graph.params.items()}


def random_inputs(graph: Graph, high: int, seed: int = 1) -> dict:
  r = np.random.default_rng(seed)
  return {f: jnp.asarray(r.integers(0, high, n.shape), jnp.int32) for f, n in graph.inputs.items()}


def assert_same(g0: Graph, g1: Graph, high: int) -> None:
  """Forward values and parameter gradients agree, eagerly and under jit."""
  params, inputs = random_params(g0), random_inputs(g0, high)

  def f(graph):
    return lambda p: run_graph(graph, p, inputs, LowerCtx())["out"]

  for wrap in (lambda fn: fn, jax.jit):
    v0, gr0 = wrap(jax.value_and_grad(f(g0)))(params)
    v1, gr1 = wrap(jax.value_and_grad(f(g1)))(params)
    np.testing.assert_allclose(np.asarray(v1), np.asarray(v0), **TOL)
    for path in params:
      np.testing.assert_allclose(np.asarray(gr1[path]), np.asarray(gr0[path]), **TOL,
                                 err_msg=path)


def rewritten(c, **kw) -> tuple[Graph, Graph, list[Region]]:
  g0 = c.stages[0].graph
  g1, regions = rewrite(g0, **kw)
  verify(g1)
  return g0, g1, regions


# --- attention ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("SEXPGPU_PATTERNS", "off")
    return compile_file(os.path.join(ROOT, "configs/tiny-lm.sx"))


@pytest.mark.slow  # traces std's attention blocks
def test_attention_fires_on_std_attention(tiny):
  g0, g1, regions = rewritten(tiny)
  attn = [r for r in regions if r.kind == "attention"]
  assert len(attn) == 1  # one per repeat body, run `times` times
  assert attn[0].times == 2 and attn[0].nodes == 5
  assert attn[0].detail == "causal, 4 heads, head dim 16"
  assert attn[0].scope.endswith("block/attention")
  ops = all_ops(g1)
  assert ops.count("sdpa") == 1 and "softmax" not in ops and "causal-mask" not in ops
  assert_same(g0, g1, high=32)


def test_std_attention_with_more_layers_is_one_region_per_body():
  c = compile_file(os.path.join(ROOT, "configs/tiny-lm.sx"), sets=[("layers", "3")])
  _, _, regions = rewritten(c)
  assert [(r.kind, r.times) for r in regions] == [("attention", 3)]


def test_patterns_off_keeps_the_graph(tiny):
  g0, g1, regions = rewritten(tiny, patterns=False)
  assert regions == []
  assert all_ops(g1) == all_ops(g0)


def test_rewrite_does_not_change_its_input(tiny):
  before = all_ops(tiny.stages[0].graph)
  rewrite(tiny.stages[0].graph)
  assert all_ops(tiny.stages[0].graph) == before


EXPERIMENT = """
(require std/nn)
(defloader train (markov :vocab {vocab} :seq 17 :batch 3 :seed 7))
(defn mix [x]
  {attn})
(defn loss [batch]
  (let [t (get batch :tokens)
        x (take (param embed [{vocab} 32] :init (normal 0.5)) (slice t -1 0 -1))
        h (+ x (mix x))]
    (cross-entropy (matmul h (param out [32 {vocab}] :init (normal 0.5))) (slice t -1 1 nil)
                   {mask})))
(defrun :loss loss :data train :steps 1 :optimizer (adam :lr 1e-3))
"""

# Other names, other index letters, other layouts, scales written other ways.
HEADS = """(let [[b t d] (shape x)
        qq (transpose (reshape (dense x d :as wq) [b t 4 8]) [0 2 1 3])
        kk (transpose (reshape (dense x d :as wk) [b t 4 8]) [0 2 1 3])
        vv (transpose (reshape (dense x d :as wv) [b t 4 8]) [0 2 1 3])
        w  (softmax (causal-mask {scaled}) -1)]
    (reshape (transpose (einsum "nxij,nxjc->nxic" w vv) [0 2 1 3]) [b t d]))"""
VARIANTS = {
    "heads-divide": HEADS.format(scaled='(/ (einsum "nxia,nxja->nxij" qq kk) 2.8)'),
    "heads-literal-first": HEADS.format(scaled='(* 0.125 (einsum "nxia,nxja->nxij" qq kk))'),
    "heads-unscaled": HEADS.format(scaled='(einsum "nxia,nxja->nxij" qq kk)'),
    "heads-scores-swapped": """(let [[b t d] (shape x)
        qq (transpose (reshape (dense x d :as wq) [b t 4 8]) [0 2 1 3])
        kk (transpose (reshape (dense x d :as wk) [b t 4 8]) [0 2 1 3])
        vv (transpose (reshape (dense x d :as wv) [b t 4 8]) [0 2 1 3])
        w  (softmax (causal-mask (* (einsum "hbqc,hbkc->bhqk" (transpose qq [1 0 2 3])
                                        (transpose kk [1 0 2 3])) 0.3)) 3)]
    (reshape (transpose (einsum "bhqk,bhkd->bhqd" w vv) [0 2 1 3]) [b t d]))""",
    "seq-major": """(let [[b t d] (shape x)
        qq (reshape (dense x d :as wq) [b t 4 8])
        kk (reshape (dense x d :as wk) [b t 4 8])
        vv (reshape (dense x d :as wv) [b t 4 8])
        w  (softmax (causal-mask (* (einsum "zsne,zrne->znsr" qq kk) 0.35)) -1)]
    (reshape (einsum "znsr,zrne->zsne" w vv) [b t d]))""",
    "no-heads": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)
        e (dense x 32 :as third)]
    (einsum "ats,asf->atf" (softmax (causal-mask (* (einsum "atf,asf->ats" a c) 0.2)) -1) e))""",
    "no-heads-not-causal": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)
        e (dense x 32 :as third)]
    (einsum "ats,asf->atf" (softmax (* (einsum "atf,asf->ats" a c) 0.2) 2) e))""",
}
EXPECTED = {
    "heads-divide": "causal, 4 heads, head dim 8",
    "heads-literal-first": "causal, 4 heads, head dim 8",
    "heads-unscaled": "causal, 4 heads, head dim 8",
    "heads-scores-swapped": "causal, 4 heads, head dim 8",
    "seq-major": "causal, 4 heads, head dim 8",
    "no-heads": "causal, no heads axis, head dim 32",
    "no-heads-not-causal": "not causal, no heads axis, head dim 32",
}


def experiment(attn: str, vocab: int = 32, mask: str = ""):
  text = EXPERIMENT.format(attn=attn, vocab=vocab, mask=mask)
  return compile_source(text, "variant.sx", base_dir=ROOT)


@pytest.mark.slow  # traces std's attention blocks
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_attention_fires_on_hand_written_variants(name):
  g0, g1, regions = rewritten(experiment(VARIANTS[name]))
  assert [(r.kind, r.detail) for r in regions] == [("attention", EXPECTED[name])]
  ops = all_ops(g1)
  assert ops.count("sdpa") == 1 and "softmax" not in ops
  assert_same(g0, g1, high=32)


NEAR_MISSES = {
    "softmax-over-queries": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)]
    (einsum "ats,asf->atf" (softmax (causal-mask (* (einsum "atf,asf->ats" a c) 0.2)) 1) c))""",
    "contract-over-queries": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)]
    (einsum "ats,atf->asf" (softmax (causal-mask (* (einsum "atf,asf->ats" a c) 0.2)) -1) c))""",
    "tensor-scale": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)]
    (einsum "ats,asf->atf" (softmax (* (einsum "atf,asf->ats" a c) (sigmoid (mean a -1 :keep true))) -1) c))""",
    "probabilities-read-twice": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)
        p (softmax (einsum "atf,asf->ats" a c) -1)]
    (+ (einsum "ats,asf->atf" p c) (sum p -1 :keep true)))""",
    "mask-before-product": """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)]
    (einsum "ats,asf->atf" (softmax (* (causal-mask (einsum "atf,asf->ats" a c)) 0.2) -1) c))""",
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_attention_does_not_fire_on_near_misses(name):
  g0, g1, regions = rewritten(experiment(NEAR_MISSES[name]))
  assert regions == []
  assert "sdpa" not in all_ops(g1)
  assert_same(g0, g1, high=32)


# --- cross-entropy ------------------------------------------------------------------
def _max_intermediate(fn, params) -> int:
  """The largest value (in elements) fn's jaxpr makes, sub-jaxprs included, parameters' shapes aside."""
  best = 0
  skip = {tuple(v.shape) for v in params.values()} | {tuple(v.shape)[::-1] for v in params.values()}

  def visit(jaxpr):
    nonlocal best
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        shape = tuple(getattr(v.aval, "shape", ()))
        if shape not in skip:
          best = max(best, int(np.prod(shape)))
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            visit(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            visit(sub)

  visit(jax.make_jaxpr(fn)(params).jaxpr)
  return best


@pytest.mark.slow  # traces a large-vocabulary loss
@pytest.mark.parametrize("mask", ["", ":mask (> (slice t -1 1 nil) 3)"])
def test_large_vocab_loss_becomes_chunked(mask):
  c = experiment(VARIANTS["no-heads"], vocab=300, mask=mask)
  g0, g1, regions = rewritten(c, xent_min_vocab=256, xent_chunk=128)
  assert [(r.kind, r.detail) for r in regions] == [
      ("attention", "causal, no heads axis, head dim 32"),
      ("cross-entropy", "vocab 300, 3 chunks of 100")]
  ops = all_ops(g1)
  assert "chunked-cross-entropy" in ops and "cross-entropy" not in ops
  assert_same(g0, g1, high=300)

  params, inputs = random_params(g0), random_inputs(g0, 300)
  rows_by_vocab = 3 * 16 * 300  # rows (48) outnumber the width (32)

  def grad(graph):
    return jax.grad(lambda p: run_graph(graph, p, inputs, LowerCtx())["out"])

  assert _max_intermediate(grad(g0), params) >= rows_by_vocab  # the full logits, unrewritten
  assert _max_intermediate(grad(g1), params) < rows_by_vocab   # never, chunked


def test_small_vocab_loss_is_left_alone():
  _, g1, regions = rewritten(experiment(VARIANTS["no-heads"], vocab=300))
  assert [r.kind for r in regions] == ["attention"]
  assert "cross-entropy" in all_ops(g1)


# --- CSE and dead nodes -------------------------------------------------------------
def test_duplicates_made_by_rewriting_merge_and_dead_nodes_go():
  # Two attentions over the same q, k, v: both become one sdpa node after re-interning.
  twice = """(let [a (dense x 32 :as first)
        c (dense x 32 :as second)
        s1 (* (einsum "atf,asf->ats" a c) 0.2)
        s2 (* (einsum "buf,bvf->buv" a c) 0.2)]
    (+ (einsum "ats,asf->atf" (softmax s1 -1) c) (einsum "buv,bvf->buf" (softmax s2 -1) c)))"""
  g0, g1, regions = rewritten(experiment(twice))
  assert [r.kind for r in regions] == ["attention", "attention"]
  ops = all_ops(g1)
  assert ops.count("sdpa") == 1 and ops.count("einsum") == 0
  assert len(g1.nodes()) < len(g0.nodes())
  assert_same(g0, g1, high=32)


def test_nodes_keep_their_place_and_scope(tiny):
  _, g1, _ = rewritten(tiny)
  body = next(n for n in g1.nodes() if n.op == "repeat").attr("body")
  sdpa = next(n for n in walk([body.output]) if n.op == "sdpa")
  assert sdpa.loc is not None and sdpa.loc.file == "std/nn.sx"
  assert sdpa.scope.endswith("block/attention")
  assert all(isinstance(n, Node) for n in walk([body.output]))

"""Documents packed in a row do not see each other: the segment mask in attention and the loss."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError
from sexpgpu.ir.ops import OPS, LowerCtx

SEQ = 17  # a row: 16 inputs and their targets
VOCAB = 64
ROWS = [[5, 4, 8], [9, 7]]  # document lengths in each packed row (the rest is padding)

SRC = """(require std/nn)
(require std/lm)
(defloader train (arrays "rows.npz" :fields [tokens segments positions] :batch 2))
(defn lm-loss [t s p ls]
  ; the model sees the packing s; the loss counts the targets of ls
  (next-token-loss (transformer-lm (lm-inputs t) :vocab %d :width 16 :layers 2 :heads 2
                                   :segments (lm-inputs s) :positions (lm-inputs p))
                   t :segments ls))
(defn loss [batch]
  (let [s (get batch :segments)]
    (lm-loss (get batch :tokens) s (get batch :positions) s)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01))
""" % VOCAB


def _pack(rows, seq):
  """Rows of documents whose token ids do not overlap: document d uses ids 10·d+1 … 10·d+9."""
  t, s, p = (np.zeros((len(rows), seq), np.int32) for _ in range(3))
  docs = []  # (row, segment, start, length, ids)
  rng = np.random.default_rng(0)
  for r, lengths in enumerate(rows):
    at = 0
    for k, n in enumerate(lengths):
      ids = 10 * len(docs) + 1 + rng.integers(0, 9, n)
      t[r, at:at + n], s[r, at:at + n], p[r, at:at + n] = ids, k + 1, np.arange(n)
      docs.append((r, k + 1, at, n, set(ids.tolist())))
      at += n
  return t, s, p, docs


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
  folder = tmp_path_factory.mktemp("masks")
  t, s, p, _ = _pack(ROWS, SEQ)
  np.savez(folder / "rows.npz", tokens=t, segments=s, positions=p)
  e = sexpgpu.compile_text(SRC, "masks.sx", base_dir=str(folder))
  params = dict(e.init(seed=3).params)
  for k, v in params.items():  # the unembedding starts at zero, which would hide every gradient
    if k.endswith("unembed"):
      params[k] = jax.random.normal(jax.random.key(1), v.shape, v.dtype)
  # Traced once per shape under an outer jit (the API's call builds its graph on each call).
  loss = jax.jit(lambda prm, t, s, p, ls: e.call("lm-loss", prm, t, s, p, ls))
  return e, params, loss, jax.jit(jax.grad(loss))


def _only(s, row, seg):
  """Loss segments that keep one document and make everything else padding."""
  out = np.zeros_like(s)
  out[row] = np.where(s[row] == seg, s[row], 0)
  return out


def _embed(params):
  return next(k for k in params if k.endswith("transformer-lm/embed"))


def test_one_documents_loss_has_zero_gradient_for_every_other_document(exp):
  _, params, _, grad = exp
  t, s, p, docs = _pack(ROWS, SEQ)
  embed = _embed(params)
  for row, seg, _, _, ids in docs:
    g = np.asarray(grad(params, t, s, p, _only(s, row, seg))[embed])
    assert np.abs(g[sorted(ids)]).sum() > 0  # the document's own tokens matter
    others = sorted(set(range(1, VOCAB)) - ids)
    assert (g[others] == 0).all(), f"document {seg} of row {row} sees another document"


def test_without_the_mask_later_documents_see_earlier_ones(exp):
  _, params, _, grad = exp
  t, s, p, docs = _pack(ROWS, SEQ)
  one = np.where(s > 0, 1, 0).astype(np.int32)  # the model sees each row as one document
  row, seg, _, _, ids = docs[1]
  g = np.asarray(grad(params, t, one, p, _only(s, row, seg))[_embed(params)])
  assert np.abs(g[sorted(docs[0][4])]).sum() > 0


def test_packed_loss_equals_the_documents_one_at_a_time(exp):
  _, params, loss, _ = exp
  t, s, p, docs = _pack(ROWS, SEQ)
  packed = float(loss(params, t, s, p, s))
  alone, inside, weights = [], [], []
  for row, seg, start, n, _ in docs:
    ta, sa, pa = (np.zeros((1, SEQ), np.int32) for _ in range(3))
    ta[0, :n], sa[0, :n], pa[0, :n] = t[row, start:start + n], 1, np.arange(n)
    alone.append(float(loss(params, ta, sa, pa, sa)))
    inside.append(float(loss(params, t, s, p, _only(s, row, seg))))
    weights.append(n - 1)  # a document of n tokens has n-1 targets
  np.testing.assert_allclose(inside, alone, rtol=0, atol=1e-5)
  np.testing.assert_allclose(packed, np.average(alone, weights=weights), rtol=0, atol=1e-5)


def test_rewritten_sdpa_carries_the_segments_and_matches_the_unrewritten_graph(exp, tmp_path,
                                                                             monkeypatch):
  e, params, loss, _ = exp
  assert "segment-mask" not in e.ir
  assert any(" sdpa[" in line and line.count("%") == 5 for line in e.ir.splitlines())
  t, s, p, _ = _pack(ROWS, SEQ)
  np.savez(tmp_path / "rows.npz", tokens=t, segments=s, positions=p)
  monkeypatch.setenv("SEXPGPU_PATTERNS", "off")
  plain = sexpgpu.compile_text(SRC, "masks.sx", base_dir=str(tmp_path))
  assert "segment-mask" in plain.ir and "sdpa" not in plain.ir
  np.testing.assert_allclose(float(plain.call("lm-loss", params, t, s, p, s)),
                             float(loss(params, t, s, p, s)), rtol=0, atol=1e-6)


def test_sdpa_lowering_names_what_serves_the_mask_on_the_cpu():
  from sexpgpu.lower.attention import sdpa_any
  ctx = LowerCtx(platform="cpu")
  q = jnp.ones((2, 2, 4, 8))
  seg = jnp.array([[1, 1, 2, 0], [1, 2, 2, 2]], jnp.int32)
  out = sdpa_any(ctx, q, q, q, seg, causal=True, scale=0.3)
  assert ctx.notes[-1]["impl"] == "xla" and ctx.notes[-1]["mask"] == "segments"
  assert "segment mask by XLA" in ctx.notes[-1]["why"]
  ref = OPS["sdpa"].lower(LowerCtx(), q, q, q, seg, causal=True, scale=0.3)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  assert np.isfinite(np.asarray(out)).all()  # padding attends to padding: no empty softmax


def test_segment_mask_of_the_wrong_shape_is_e_shape_001(tmp_path):
  src = """(require std/nn)
(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 1))
(defn loss [batch]
  (let [x (take (param emb [8 16] :init (normal 0.02)) (get batch :tokens))]
    (mean (attention x :heads 2 :segments (get batch :tokens)))))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01))
"""
  sexpgpu.compile_text(src, "ok.sx")  # [b t] segments fit
  bad = src.replace(":segments (get batch :tokens)", ":segments (slice (get batch :tokens) -1 0 3)")
  with pytest.raises(SxError) as err:
    sexpgpu.compile_text(bad, "bad.sx")
  assert err.value.code == "E-SHAPE-001" and "segment-mask" in str(err.value)

"""The recipe's blocks (issue 38): next-token-loss's :z-loss (PaLM's log-partition penalty,
tapped as a metric), :qk-norm in std's gpt2, llama and transformer-lm (a learned [dh] scale on
each head's queries and keys, role norm, off by default), and relu2 as an activation."""

import json

import jax
import numpy as np
import pytest

from sexpgpu.errors import SxError
from sexpgpu.ir.opdef import LowerCtx
from sexpgpu.ir.printer import print_graph
from sexpgpu.ir.roles import roles
from sexpgpu.lower.init import init_params
from sexpgpu.lower.interp import run_graph
from sexpgpu.run.compile import compile_source

V = 12
HEAD = f"""
(require std/lm)
(require std/gpt2)
(require std/llama)
(defloader train (markov :vocab {V} :seq 9 :batch 3 :seed 7))
(defn loss [batch] (let [t (get batch :tokens)] LOSS))
(defrun :loss loss :data train :steps 1 :precision f32 :seed 1 :optimizer (adamw :lr 0.01))
"""
# logits are a table's rows: any logits the test chooses
TABLE = "(take (param emb [12 12] :init (normal 1.0)) (lm-inputs t))"


def _loss_and_inputs(loss: str):
  c = compile_source(HEAD.replace("LOSS", loss), "blocks.sx")
  params = init_params(0, c.params)
  batch = c.loaders["train"].batch(0)
  out = run_graph(c.stages[0].graph, params, batch, LowerCtx())["out"]
  return float(out), {k: np.asarray(v) for k, v in params.items()}, np.asarray(batch["tokens"])


def _np_loss(logits, targets, z, mask=None):
  lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  m = np.ones_like(nll) if mask is None else mask
  return ((nll * m).sum() + z * (lse ** 2 * m).sum()) / m.sum()


def test_z_loss_adds_the_mean_squared_log_partition():
  got, params, t = _loss_and_inputs(f"(next-token-loss {TABLE} t :z-loss 1e-2)")
  logits = params["emb"][t[:, :-1]]
  assert abs(_np_loss(logits, t[:, 1:], 0.0) - got) > 1e-3  # the penalty is not negligible
  np.testing.assert_allclose(got, _np_loss(logits, t[:, 1:], 1e-2), rtol=1e-6)


def test_z_loss_over_the_positions_segments_count():
  seg = "(cast (< t 5) i32)"
  got, params, t = _loss_and_inputs(f"(next-token-loss {TABLE} t :segments {seg} :z-loss 0.5)")
  s = (t < 5).astype(np.int32)
  mask = ((s[:, :-1] == s[:, 1:]) & (s[:, 1:] != 0)).astype(np.float64)
  assert 0 < mask.sum() < mask.size
  np.testing.assert_allclose(got, _np_loss(params["emb"][t[:, :-1]], t[:, 1:], 0.5, mask),
                             rtol=1e-6)


def test_without_z_loss_the_graph_is_as_it_was():
  plain = compile_source(HEAD.replace("LOSS", f"(next-token-loss {TABLE} t)"), "b.sx")
  nil = compile_source(HEAD.replace("LOSS", f"(next-token-loss {TABLE} t :z-loss nil)"), "b.sx")
  assert print_graph(plain.stages[0].graph) == print_graph(nil.stages[0].graph)
  assert "logsumexp" not in print_graph(plain.stages[0].graph)


def test_relu2_is_relu_squared():
  got, _, t = _loss_and_inputs("(sum (relu2 (- (cast t f32) 5.0)))")
  np.testing.assert_allclose(got, (np.maximum(t - 5.0, 0.0) ** 2).sum(), rtol=1e-6)


MODELS = {
    "gpt2": ("gpt2 (lm-inputs t) :vocab 12 :width 16 :layers 2 :heads 2 :context 16",
             "gpt2/h/gpt2-block/attn/"),
    "llama": ("llama (lm-inputs t) :vocab 12 :width 16 :layers 2 :heads 2 :kv-heads 1 "
              ":hidden 32 :context 16", "llama/layers/llama-block/self_attn/"),
    "transformer-lm": ("transformer-lm (lm-inputs t) :vocab 12 :width 16 :layers 2 :heads 2",
                       "transformer-lm/repeat/block/attention/"),
}


def _model(name, extra=""):
  call = MODELS[name][0]
  return compile_source(HEAD.replace("LOSS", f"(next-token-loss ({call} {extra}) t)"), "m.sx")


@pytest.mark.parametrize("name", list(MODELS))
def test_the_defaults_are_the_model_as_it_was(name):
  plain, spelled = _model(name), _model(name, ":qk-norm false")
  assert print_graph(plain.stages[0].graph) == print_graph(spelled.stages[0].graph)


@pytest.mark.parametrize("name", list(MODELS))
def test_qk_norm_adds_a_dh_scale_to_queries_and_keys_with_role_norm(name):
  plain, normed = _model(name), _model(name, ":qk-norm true")
  added = sorted(set(normed.params) - set(plain.params))
  prefix = MODELS[name][1]
  assert added == [prefix + "k_norm/scale", prefix + "q_norm/scale"]
  assert set(plain.params) <= set(normed.params)
  found = roles(normed.stages[0].graph)
  for path in added:
    assert normed.params[path].full_shape == (2, 8)  # [layers, dh = 16 / 2 heads]
    assert found[path].role == "norm" and found[path].stack == (2,)
  # and it is used: the loss moves when a scale does (random weights: an unembedding that
  # starts at zeros would hide it)
  rng = np.random.default_rng(0)
  params = {k: jax.numpy.asarray(rng.normal(0, 0.5, v.shape).astype(np.float32))
            for k, v in init_params(0, normed.params).items()}
  batch = normed.loaders["train"].batch(0)
  g = normed.stages[0].graph
  before = run_graph(g, params, batch, LowerCtx())["out"]
  after = run_graph(g, {**params, added[0]: params[added[0]] * 3.0}, batch, LowerCtx())["out"]
  assert abs(float(before) - float(after)) > 1e-6


@pytest.mark.parametrize("name", ["gpt2", "transformer-lm", "llama"])
def test_an_activation_is_a_keyword_and_relu2_one_of_them(name):
  plain, relu2 = _model(name), _model(name, ":act relu2")
  text = print_graph(relu2.stages[0].graph)
  assert "relu" in text and "relu" not in print_graph(plain.stages[0].graph)
  assert set(plain.params) == set(relu2.params)


@pytest.mark.parametrize("extra, code, message, fix", [
    (":act relu3", "E-NAME-001", "`relu3` is not defined", "did you mean `relu` or `relu2`"),
    (":qk-nrom true", "E-FORM-002", "gpt2 has no keyword :qk-nrom", "known keywords: "),
])
def test_a_misspelt_keyword_or_activation_names_the_nearest(extra, code, message, fix):
  with pytest.raises(SxError) as e:
    _model("gpt2", extra)
  assert (e.value.code, e.value.message) == (code, message)
  assert e.value.fix.startswith(fix) and e.value.location.file == "m.sx"


@pytest.mark.parametrize("loss, code, message", [
    (f"(next-token-loss {TABLE} t :z-los 1e-4)", "E-FORM-002",
     "next-token-loss has no keyword :z-los"),
    (f'(next-token-loss {TABLE} t :z-loss "big")', "E-ARG-001",  # std's assert, at the call
     ":z-loss is a number ≥ 0 (the penalty's weight), or nil for none"),
])
def test_a_bad_z_loss_keyword_is_an_error(loss, code, message):
  with pytest.raises(SxError) as e:
    compile_source(HEAD.replace("LOSS", loss), "z.sx")
  assert (e.value.code, e.value.message) == (code, message)


RECIPE = """
(require std/lm)
(defloader train (markov :vocab 12 :seq 17 :batch 8 :seed 7))
(defn loss [batch] (let [t (get batch :tokens)]
  (next-token-loss (transformer-lm (lm-inputs t) :vocab 12 :width 32 :layers 2 :heads 4
                                   :qk-norm true :act relu2) t :z-loss 1e-2)))
(defdiagnostic z-loss :every 1 :of (tap lm/z-loss) :reduce mean)
(defrun :loss loss :data train :steps 16 :precision f32 :seed 1
        :optimizer (adamw :lr 0.01))
"""


@pytest.mark.slow  # a run with every recipe keyword
def test_qk_norm_relu2_and_z_loss_train_and_the_z_loss_is_a_metric(tmp_path, capsys):
  from sexpgpu.cli.main import main
  sx, m = tmp_path / "recipe.sx", tmp_path / "m.jsonl"
  sx.write_text(RECIPE)
  code = main(["run", str(sx), "--diagnostics", "z-loss", "--metrics", f"jsonl:{m}"])
  err = capsys.readouterr().err
  assert code == 0, err
  events = [json.loads(line) for line in open(m)]
  losses = [e["train/loss"] for e in events if e["kind"] == "step"]
  z = [e["value"] for e in events if e["kind"] == "diagnostic" and e["name"] == "z-loss"]
  assert len(losses) == 16 and losses[-1] < losses[0] - 0.2, losses
  assert len(z) == 16
  # at the start the logits are 0 (unembed :init zeros): logsumexp = log 12 at every position
  np.testing.assert_allclose(z[0], 1e-2 * np.log(12) ** 2, rtol=1e-5)

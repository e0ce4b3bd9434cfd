"""μP (issue 38): `:parametrization mup :base-width N` on defrun, its factors read from each
parameter's role and the width ratio (ir/mup.py: Tensor Programs V's Table 3 in its
output-multiplier form), the learning-rate factors in the optax chain (lower/optim.py), the
attention warning, `check --print params` and the E-codes."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sexpgpu.errors import SxError
from sexpgpu.ir import mup
from sexpgpu.ir.verify import verify
from sexpgpu.lower.init import init_params
from sexpgpu.lower.interp import run_graph
from sexpgpu.lower.optim import lr_factors, make_optimizer
from sexpgpu.run.check import params_text
from sexpgpu.run.compile import compile_source

HEAD = """
(require std/lm)
(require MODULE)
(defknob base 32 "the base width")
(defknob param mup "the parametrization")
(defloader train (markov :vocab 40 :seq 9 :batch 2 :seed 7))
(defn lm [tokens] (MODEL))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 2 :precision f32 :seed 1
        :optimizer OPTIMIZER RUN)
"""
GPT2 = ("std/gpt2", "gpt2 tokens :vocab 40 :width 64 :layers 2 :heads 4 :context 16")
LM = ("std/nn", "transformer-lm tokens :vocab 40 :width 64 :layers 1 :heads 4")
MUP = ":parametrization mup :base-width 32"


def source(model=LM, run=MUP, optimizer="(adamw :lr 0.01)"):
  text = HEAD.replace("MODULE", model[0]).replace("MODEL", model[1])
  return text.replace("OPTIMIZER", optimizer).replace("RUN", run)


def _compile(model=LM, run=MUP, optimizer="(adamw :lr 0.01)"):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", mup.MupWarning)
    return compile_source(source(model, run, optimizer), "mup.sx")


@pytest.fixture(scope="module")
def gpt2():
  return _compile(GPT2)


@pytest.fixture(scope="module")
def lm():
  return _compile(LM)


@pytest.fixture(scope="module")
def lm_standard():
  return _compile(LM, "")


def _plan(c):
  return mup.plan(c.stages[0].graph, 32)


def test_gpt2_factors_by_role(gpt2):
  p = _plan(gpt2)
  assert p.width == 64 and p.ratio == 2.0
  r = p.rules
  wte = r["lm/gpt2/wte"]  # tied: the embedding's rules, the readout's output multiplier
  assert (wte.role, wte.init, wte.adam, wte.sgd, wte.output) == (
      "embedding+readout (tied)", 1.0, 1.0, 2.0, 0.5)
  attn = r["lm/gpt2/h/gpt2-block/attn/c_attn/w"]  # written (normal 0.02): × 1/√m
  assert (attn.role, attn.adam, attn.sgd, attn.output) == ("hidden", 0.5, 1.0, 1.0)
  assert attn.init == pytest.approx(1 / math.sqrt(2), rel=1e-12)
  for path in ("lm/gpt2/ln_f/scale", "lm/gpt2/h/gpt2-block/ln_1/scale"):
    assert (r[path].role, r[path].init, r[path].adam, r[path].sgd) == ("norm", 1.0, 1.0, 2.0)
  bias = r["lm/gpt2/h/gpt2-block/attn/c_attn/b"]
  assert (bias.role, bias.adam, bias.sgd) == ("bias", 1.0, 2.0)
  assert sum(x.output != 1 for x in r.values()) == 1
  # the initializers themselves: the hidden matrices' std scaled, the rest as written
  assert gpt2.params["lm/gpt2/h/gpt2-block/attn/c_attn/w"].init.value == pytest.approx(
      0.02 / math.sqrt(2), rel=1e-12)
  assert gpt2.params["lm/gpt2/wte"].init.value == 0.02


def test_transformer_lm_factors_by_role(lm):
  r = _plan(lm).rules
  un = r["lm/transformer-lm/unembed"]
  assert (un.role, un.init, un.adam, un.sgd, un.output) == ("readout", 1.0, 1.0, 2.0, 0.5)
  up = r["lm/transformer-lm/repeat/block/mlp/up/w"]  # (fan-in 1): already 1/fan_in
  assert (up.role, up.init, up.adam, up.sgd) == ("hidden", 1.0, 0.5, 1.0)
  assert r["lm/transformer-lm/embed"].sgd == 2.0 and r["lm/transformer-lm/pos"].adam == 1.0


def test_init_std_per_role(gpt2):
  """Initialized as lower/init.py draws them: a hidden matrix's std 0.02/√m, the tied
  embedding's 0.02, the norm scales ones."""
  values = init_params(1, gpt2.params)
  w = np.asarray(values["lm/gpt2/h/gpt2-block/mlp/c_fc/w"])
  assert abs(w.std() - 0.02 / math.sqrt(2)) < 0.0005
  assert abs(np.asarray(values["lm/gpt2/wte"]).std() - 0.02) < 0.001
  assert np.all(np.asarray(values["lm/gpt2/ln_f/scale"]) == 1.0)


def test_an_untied_fan_in_readout_is_made_constant():
  """A readout written (fan-in 1) has std 1/√width; under μP it is made the base width's
  (× √m), as `mup`'s MuReadout rescales it, so that with the 1/m multiplier it is Table 3's
  1/fan_in² variance."""
  prm = next(iter(_compile().stages[0].graph.params.values()))
  role = mup.roles_mod.Role("x", "readout", contracted=(0,), free=(1,))
  fan_in = mup.dataclasses.replace(prm, shape=(64, 40), init=mup.Init("fan-in", 1.0))
  assert mup.rule(role, fan_in, 4.0).init == 2.0
  zeros = mup.dataclasses.replace(fan_in, init=mup.Init("zeros"))
  assert mup.rule(role, zeros, 4.0).init == 1.0


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_output_multiplier_numerics(lm, lm_standard):
  """The μP loss with a readout W is the standard loss with W / m: the `*` by 1/m is on
  the readout's product and nowhere else."""
  params = init_params(3, lm_standard.params)
  params["lm/transformer-lm/unembed"] = jax.random.normal(jax.random.key(0), (64, 40))
  batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 9)), jnp.int32)}
  from sexpgpu.ir.opdef import LowerCtx
  ctx = LowerCtx(training=False)

  def loss(c, p):
    return float(run_graph(c.stages[0].graph, p, batch, ctx)["out"])

  halved = dict(params, **{"lm/transformer-lm/unembed": params["lm/transformer-lm/unembed"] / 2})
  assert loss(lm, params) == pytest.approx(loss(lm_standard, halved), abs=1e-6)
  assert loss(lm, params) != pytest.approx(loss(lm_standard, params), abs=1e-3)
  verify(lm.stages[0].graph)
  products = [n for n in lm.stages[0].graph.nodes() if n.op == "*" and 0.5 in n.inputs]
  assert len(products) == 1 and products[0].inputs[0].op == "matmul"


def test_output_multiplier_on_a_fused_readout(lm_standard):
  """Where rewrite.py fused the readout into chunked-cross-entropy, the 1/m goes on its
  hidden input: the same loss as the standard model's with W / m."""
  from sexpgpu.ir.opdef import LowerCtx
  from sexpgpu.ir.rewrite import rewrite
  graph = lm_standard.stages[0].graph
  fused = rewrite(graph, xent_min_vocab=1)[0]
  assert [n.op for n in fused.nodes()].count("chunked-cross-entropy") == 1
  g = mup.apply(fused, mup.plan(graph, 32), warn=False)
  params = init_params(3, lm_standard.params)
  w = jax.random.normal(jax.random.key(0), (64, 40))
  batch = {"tokens": jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 9)), jnp.int32)}
  ctx = LowerCtx(training=False)
  got = run_graph(g, dict(params, **{"lm/transformer-lm/unembed": w}), batch, ctx)["out"]
  want = run_graph(graph, dict(params, **{"lm/transformer-lm/unembed": w / 2}), batch, ctx)["out"]
  assert float(got) == pytest.approx(float(want), abs=1e-5)


def _update(c, optimizer_spec=None):
  spec = optimizer_spec or c.exp.optimizer
  opt, _ = make_optimizer(spec, 2, c.stages[0].graph)
  params = {k: jnp.ones(p.full_shape) for k, p in c.params.items()}
  grads = {k: jnp.full(v.shape, 0.5) for k, v in params.items()}
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  return {k: np.asarray(v) for k, v in updates.items()}


@pytest.mark.parametrize("name,hidden,embed", [("adamw", 0.5, 1.0), ("sgd", 1.0, 2.0)])
def test_learning_rate_factors_in_the_step(lm, name, hidden, embed):
  """One step's update under μP is the standard one times the Adam or SGD factor."""
  import dataclasses
  spec = dataclasses.replace(lm.exp.optimizer, name=name)
  plain = dataclasses.replace(spec, args=tuple(a for a in spec.args if a[0] != mup.BASE_ARG))
  under, std = _update(lm, spec), _update(lm, plain)
  factors = lr_factors(spec, lm.stages[0].graph)
  assert factors["lm/transformer-lm/repeat/block/attention/q/w"] == hidden
  assert factors["lm/transformer-lm/embed"] == embed
  assert lr_factors(plain, lm.stages[0].graph) == {}
  for path, f in factors.items():
    np.testing.assert_allclose(under[path], f * std[path], rtol=1e-6, err_msg=path)


def test_at_the_base_width_mup_is_the_file_as_written(lm_standard):
  same = _compile(LM, ":parametrization mup :base-width 64")
  assert same.fingerprint == lm_standard.fingerprint
  assert set(lr_factors(same.exp.optimizer, same.stages[0].graph).values()) == {1.0}


def test_attention_scaled_by_one_over_root_d_warns_and_changes_nothing(lm_standard):
  with pytest.warns(mup.MupWarning, match=r"1/√d \(d = 16\).*\(/ 1.0 dh\)"):
    c = compile_source(source(), "mup.sx")
  scales = [n for n in mup.roles_mod.all_nodes(c.stages[0].graph)
            if (n.op == "*" and 0.25 in n.inputs) or n.attr("scale") == 0.25]
  assert len(scales) == 1  # the 1/√16 is still there (sdpa's, inside the repeat's body)
  assert len(mup.attention_warnings(lm_standard.stages[0].graph)) == 1
  text = params_text(c)
  assert "init×" in text and "out×" in text and "warning: attention at std/nn.sx" in text


def test_check_prints_each_multiplier(gpt2):
  lines = params_text(gpt2).splitlines()
  head = lines[0].split()
  assert head[-3:] == ["init×", "lr×", "out×"]
  row = {ln.split()[0]: ln.split() for ln in lines[1:]}
  assert row["lm/gpt2/wte"][-3:] == ["1", "1", "0.5"]
  assert row["lm/gpt2/h/gpt2-block/attn/c_attn/w"][-3:] == ["0.7071", "0.5", "-"]
  assert any(ln.startswith("mup: width 64") and "m 2" in ln for ln in lines)
  assert "init×" not in params_text(_compile(LM, ""))


def test_knob_references():
  c = _compile(LM, ":parametrization param :base-width base")
  assert c.exp.run["parametrization"] == "mup" and c.exp.run["base-width"] == 32
  assert mup.base_width(c.exp.optimizer) == 32


@pytest.mark.parametrize("run,code,fix", [
    (":parametrization mupp :base-width 32", "E-MUP-001", "`mup`"),
    (":parametrization standart", "E-MUP-001", "`standard`"),
    (":parametrization 3 :base-width 32", "E-MUP-001", ":parametrization mup"),
    (":parametrization mup", "E-MUP-002", ":base-width 64"),
    (":parametrization mup :base-width 0", "E-MUP-002", ":base-width 64"),
    (":parametrization mup :base-width -8", "E-MUP-002", ":base-width 64"),
    (":parametrization mup :base-width 32.0", "E-MUP-002", ":base-width 64"),
    (":parametrization mup :base-width \"32\"", "E-MUP-002", ":base-width 64"),
    (":base-width 0", "E-MUP-002", ":base-width 64"),
])
def test_bad_settings(run, code, fix):
  with pytest.raises(SxError) as e:
    compile_source(source(LM, run), "mup.sx")
  assert e.value.code == code and fix in e.value.fix
  assert e.value.location is not None and e.value.location.end_line == 10


def test_no_width_to_read():
  text = """
(defloader train (markov :vocab 40 :seq 9 :batch 2 :seed 7))
(defn loss [batch] (mean (* (cast (get batch :tokens) f32) (param w [9] :init ones))))
(defrun :loss loss :data train :steps 2 :optimizer (sgd :lr 0.1)
        :parametrization mup :base-width 8)
"""
  with pytest.raises(SxError) as e:
    compile_source(text, "mup.sx")
  assert e.value.code == "E-MUP-003" and ":role readout" in e.value.fix
  assert e.value.location.line == 4


def test_sample_and_eval_logits_carry_the_output_multiplier(lm, lm_standard):
  """`sample` and `eval` build the model's logits graph anew: under μP it has the 1/m too."""
  from sexpgpu.models.source import logits_graph
  scaled = [n for n in logits_graph(lm, "lm", 8).nodes() if n.op == "*" and 0.5 in n.inputs]
  assert len(scaled) == 1 and scaled[0].inputs[0].op == "matmul"
  assert not [n for n in logits_graph(lm_standard, "lm", 8).nodes()
              if n.op == "*" and 0.5 in n.inputs]

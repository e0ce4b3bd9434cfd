"""Weight decay by role (issue 38): a zero-gradient step of a stacked gpt2 leaves every norm
scale, bias and embedding bitwise as it was and moves every hidden matrix by exactly
lr × wd × w, as optax's adamw decouples it; `:decay` and `:no-decay` patterns win."""

import jax
import numpy as np
import optax
import pytest

from sexpgpu.errors import SxError
from sexpgpu.lower.optim import decay_mask, make_optimizer
from sexpgpu.lower.step import init_state
from sexpgpu.run.compile import compile_source

LR, WD = 0.01, 0.1

GPT2 = """
(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
(defn lm [tokens] (gpt2 tokens :vocab 40 :width 32 :layers 2 :heads 4 :context 48))
(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 3 :precision f32 :seed 1
        :optimizer OPTIMIZER)
"""


def _compile(optimizer=f"(adamw :lr {LR} :weight-decay {WD})", text=GPT2):
  return compile_source(text.replace("OPTIMIZER", optimizer), "decay.sx")


@pytest.fixture(scope="module")
def gpt2():
  return _compile()


def _params(c):
  """Every parameter at its full (stacked) shape, random, none zero: a bias starts at 0 and
  0 decays to 0, so initial values would not show what decay reaches."""
  rng = np.random.default_rng(0)
  return {k: jax.numpy.asarray(rng.normal(1.0, 0.5, p.full_shape).astype(np.float32))
          for k, p in sorted(c.params.items())}


def _zero_grad_step(c, jit=True):
  """One step of the run's optimizer, built from its loss graph, on zero gradients, jitted
  as the train step runs it or op by op: the parameters before and after."""
  opt, _ = make_optimizer(c.exp.optimizer, 3, c.stages[0].graph)
  params = _params(c)
  state = init_state(params, opt)

  def step(params, opt_state):
    zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, params)
    updates, _ = opt.update(zeros, opt_state, params)
    return optax.apply_updates(params, updates)

  after = (jax.jit(step) if jit else step)(params, state["opt"])
  return ({k: np.asarray(v) for k, v in params.items()},
          {k: np.asarray(v) for k, v in after.items()})


def _decayed(w: np.ndarray) -> np.ndarray:
  """What optax's adamw makes of w on a zero gradient, in its own order of f32 operations:
  the Adam direction 0 / (√0 + eps) = 0, plus wd·w (add_decayed_weights), times -lr
  (scale_by_learning_rate), added to w (apply_updates)."""
  f = np.float32
  return w + f(-LR) * (f(0.0) + f(WD) * w)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_zero_gradient_step_decays_only_the_matrices_bitwise(gpt2, jit):
  # (jitted, the sum is exact as written: tests/conftest.py compiles at XLA's backend
  # optimization level 0, where LLVM contracts no multiply-add into one rounding)
  before, after = _zero_grad_step(gpt2, jit)
  spared = [p for p in before if p.endswith(("/scale", "/bias", "/b", "/wte", "/wpe"))]
  matrices = [p for p in before if p.endswith("/w")]
  # ln_1, ln_2, ln_f (scale, bias); 4 linear biases; wte, wpe
  assert len(spared) == 12 and len(matrices) == 4
  assert "lm/gpt2/h/gpt2-block/ln_1/scale" in spared and "lm/gpt2/ln_f/scale" in spared
  for p in spared:  # a stacked [layers, width] norm as well as ln_f
    assert before[p].tobytes() == after[p].tobytes(), p
  for p in matrices:
    assert after[p].dtype == np.float32
    assert after[p].tobytes() == _decayed(before[p]).tobytes(), p
    assert not np.array_equal(after[p], before[p])


def test_the_mask_follows_roles_not_rank(gpt2):
  mask = decay_mask(gpt2.exp.optimizer, gpt2.stages[0].graph)
  assert mask["lm/gpt2/h/gpt2-block/ln_1/scale"] is False  # [2, 32]: rank 2, a norm
  assert mask["lm/gpt2/h/gpt2-block/attn/c_attn/b"] is False
  assert mask["lm/gpt2/wte"] is False and mask["lm/gpt2/wpe"] is False
  assert mask["lm/gpt2/h/gpt2-block/mlp/c_fc/w"] is True
  assert sum(mask.values()) == 4


def test_patterns_override_the_roles():
  c = _compile(f'(adamw :lr {LR} :weight-decay {WD} :no-decay ["*/c_attn/w"] '
               f':decay ["*/wpe" "*/ln_f/*"])')
  before, after = _zero_grad_step(c)
  assert after["lm/gpt2/h/gpt2-block/attn/c_attn/w"].tobytes() == \
      before["lm/gpt2/h/gpt2-block/attn/c_attn/w"].tobytes()
  for p in ("lm/gpt2/wpe", "lm/gpt2/ln_f/scale", "lm/gpt2/ln_f/bias",
            "lm/gpt2/h/gpt2-block/mlp/c_proj/w"):
    assert after[p].tobytes() == _decayed(before[p]).tobytes(), p
  assert after["lm/gpt2/wte"].tobytes() == before["lm/gpt2/wte"].tobytes()


def test_without_a_graph_the_mask_is_by_rank_as_before(gpt2):
  """Callers that give no graph keep the old rule (rank ≥ 2, a stacked norm included)."""
  opt, _ = make_optimizer(gpt2.exp.optimizer, 3)
  params = _params(gpt2)
  zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, params)
  updates, _ = opt.update(zeros, opt.init(params), params)
  moved = {k for k, u in updates.items() if np.any(np.asarray(u) != 0)}
  assert "lm/gpt2/h/gpt2-block/ln_1/scale" in moved and "lm/gpt2/ln_f/scale" not in moved


@pytest.mark.parametrize("optimizer, message", [
    (f'(adamw :lr {LR} :weight-decay {WD} :no-decay ["*/ln_3/*"])',
     ':no-decay pattern "*/ln_3/*" matches no parameter'),
    (f'(adamw :lr {LR} :weight-decay {WD} :decay ["*/wpe"] :no-decay ["*/wp*"])',
     "parameter lm/gpt2/wpe matches both :decay and :no-decay"),
])
def test_a_pattern_that_misses_or_clashes_is_e_run_002(optimizer, message):
  c = _compile(optimizer)
  with pytest.raises(SxError) as e:
    make_optimizer(c.exp.optimizer, 3, c.stages[0].graph)
  assert e.value.code == "E-RUN-002" and e.value.message == message
  assert e.value.location.file == "decay.sx" and e.value.location.line == 8


@pytest.mark.parametrize("value, shown", [('"*/wpe"', 'the string "*/wpe"'),
                                          ('["*/wpe" 3]', "a vector of 2")])
def test_a_pattern_list_that_is_not_strings_is_e_run_002_at_it(value, shown):
  with pytest.raises(SxError) as e:
    _compile(f"(adamw :lr {LR} :no-decay {value})")
  assert e.value.code == "E-RUN-002"
  assert e.value.message == (f"adamw :no-decay is {shown}; it is a vector of glob patterns "
                             "over parameter paths")
  assert (e.value.location.line, e.value.location.col) == (8, 46)


# --- the table of optimizers builds what the if-chain built ----------------------------------
def _by_rank(params):
  return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


# each optimizer as the lowering wrote it before its table (front/optimizers.py), by hand
BEFORE = {
    "sgd": (dict(nesterov=True, clip=0.5, **{"weight-decay": 0.01}), lambda lr: optax.chain(
        optax.clip_by_global_norm(0.5), optax.add_decayed_weights(0.01, mask=_by_rank),
        optax.sgd(lr, nesterov=True))),
    "momentum": ({"momentum": 0.8}, lambda lr: optax.chain(optax.sgd(lr, momentum=0.8,
                                                                     nesterov=False))),
    "adam": ({"b2": 0.95, "weight-decay": 0.1}, lambda lr: optax.chain(
        optax.add_decayed_weights(0.1, mask=_by_rank), optax.adam(lr, b1=0.9, b2=0.95,
                                                                  eps=1e-8))),
    "adamw": ({"b1": 0.8, "eps": 1e-6, "weight-decay": 0.1, "clip": 1.0}, lambda lr: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.8, b2=0.999, eps=1e-6,
                                                    weight_decay=0.1, mask=_by_rank))),
    "lion": ({"weight-decay": 0.2}, lambda lr: optax.chain(
        optax.lion(lr, b1=0.9, b2=0.99, weight_decay=0.2, mask=_by_rank))),
    "adafactor": ({"min-dim-size-to-factor": 2, "weight-decay": 0.1}, lambda lr: optax.chain(
        optax.add_decayed_weights(0.1, mask=_by_rank),
        optax.adafactor(lr, decay_rate=0.8, min_dim_size_to_factor=2))),
}


def _three_steps(opt):
  rng = np.random.default_rng(3)
  params = {k: jax.numpy.asarray(rng.normal(size=s).astype(np.float32))
            for k, s in (("w", (4, 3)), ("s", (2, 3)), ("b", (3,)))}
  state = opt.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(3):
    grads = {k: jax.numpy.asarray(rng.normal(size=v.shape).astype(np.float32))
             for k, v in params.items()}
    params, state = step(params, state, grads)
  return {k: np.asarray(v).tobytes() for k, v in params.items()}


@pytest.mark.parametrize("name", list(BEFORE))
def test_each_optimizer_is_bitwise_the_chain_it_was(name):
  from sexpgpu.front.values import Spec
  kw, before = BEFORE[name]
  spec = Spec("optimizer", name, tuple(sorted({"lr": 0.01, **kw}.items())))
  opt, sched = make_optimizer(spec, 10)
  assert _three_steps(opt) == _three_steps(before(0.01))
  assert sched(5) == 0.01


def test_each_schedule_is_the_one_it_was():
  from sexpgpu.front.values import Spec
  from sexpgpu.lower.optim import schedule
  cos = schedule(Spec("schedule", "warmup-cosine", (("floor", 0.1), ("peak", 0.01),
                                                    ("warmup", 4))), 20, None)
  lin = schedule(Spec("schedule", "warmup-linear", (("floor", 0.1), ("peak", 0.01),
                                                    ("steps", 12), ("warmup", 4))), 20, None)
  rs = schedule(Spec("schedule", "rsqrt", (("peak", 0.01), ("warmup", 4))), 20, None)
  old_cos = optax.warmup_cosine_decay_schedule(0.0, 0.01, 4, 20, end_value=0.01 * 0.1)
  old_lin = optax.join_schedules([optax.linear_schedule(0.0, 0.01, 4),
                                  optax.linear_schedule(0.01, 0.01 * 0.1, 8)], [4])
  steps = jax.numpy.arange(25)
  assert np.asarray(cos(steps)).tobytes() == np.asarray(old_cos(steps)).tobytes()
  assert np.asarray(lin(steps)).tobytes() == np.asarray(old_lin(steps)).tobytes()
  old_rs = 0.01 * np.minimum((np.arange(25) + 1) / 4, 1.0) / np.sqrt(
      np.maximum(np.arange(25) + 1.0, 4.0) / 4)
  np.testing.assert_allclose(np.asarray(rs(steps)), old_rs, rtol=1e-6)


@pytest.mark.parametrize("optimizer, message, fix", [
    ('(adamw :lr 0.01 :no-decy ["*/wpe"])', "adamw has no keyword :no-decy",
     "did you mean `:no-decay` or `:decay` or `:weight-decay`? adamw takes :lr :b1 :b2 :eps "
     ":clip :weight-decay :decay :no-decay"),
    ("(lion :lr (warmup-linear :peak 0.1 :flor 0.1))", "warmup-linear has no keyword :flor",
     "did you mean `:floor` or `:min-lr`? warmup-linear takes :peak :warmup :floor :min-lr "
     ":steps"),
])
def test_an_unknown_optimizer_keyword_is_e_form_002_with_the_nearest(optimizer, message, fix):
  with pytest.raises(SxError) as e:
    _compile(optimizer)
  assert (e.value.code, e.value.message, e.value.fix) == ("E-FORM-002", message, fix)
  assert e.value.location.line == 8


def test_the_run_builds_its_optimizer_with_the_roles(gpt2):
  """The optimizer a run trains with (Training.optimizer) spares the stacked norms too: its
  zero-gradient step is the one above, bitwise."""
  from sexpgpu.run.training import Training
  opt, _ = Training(gpt2).optimizer()
  params = _params(gpt2)
  zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, params)
  updates, _ = jax.jit(opt.update)(zeros, init_state(params, opt)["opt"], params)
  after = jax.jit(optax.apply_updates)(params, updates)
  _, expected = _zero_grad_step(gpt2)
  norm = "lm/gpt2/h/gpt2-block/ln_1/scale"
  assert np.asarray(after[norm]).tobytes() == np.asarray(params[norm]).tobytes()
  for k in expected:
    assert np.asarray(after[k]).tobytes() == expected[k].tobytes(), k

"""The four standard models against transformers' PyTorch twins (torch's CPU build, tiny
random weights, nothing downloaded): GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM
and MambaForCausalLM.

For each: a twin built and saved by transformers imports with logits within 1e-5 of its own;
exporting that import and importing it again gives the parameters back bit for bit; a model
trained here and exported loads in transformers with logits within 1e-4, and greedy decoding
of 32 tokens here equals `generate(do_sample=False)` there. Mixtral's auxiliary loss equals
transformers' `load_balancing_loss_func` on the same router logits; Mamba decodes one position
a step with a state that does not grow, its logits those of the full forward.
"""

import importlib
import os

import numpy as np
import pytest

import sexpgpu
from sexpgpu.cli.main import main
from sexpgpu.models import forward, sample
from sexpgpu.models.source import checkpoint_params
from sexpgpu.run.compile import compile_file

pytestmark = pytest.mark.slow  # PyTorch parity: transformers' twins on torch's CPU build


class _OnFirstUse:
  """A module imported at its first attribute, not at collection: torch and transformers
  take 4 to 7 s of each xdist worker's start, and the not-slow tier runs none of this."""

  def __init__(self, name):
    self._name = name

  def __getattr__(self, attr):
    return getattr(importlib.import_module(self._name), attr)


torch, transformers = _OnFirstUse("torch"), _OnFirstUse("transformers")

HEAD = """(require std/lm)
(require std/{kind})
(defloader train (markov :vocab 40 :seq 17 :batch 4 :seed 7))
"""
TAIL = """(defn loss [batch] (let [t (get batch :tokens)] (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 40 :optimizer (adamw :lr 0.01 :weight-decay 0.0)
        :precision f32 :seed 1)
"""
MODELS = {
    "gpt2": "(defn lm [tokens] (gpt2 tokens :vocab 40 :width 32 :layers 2 :heads 4 :context 48))\n"
            + TAIL,
    "llama": """(defn lm [tokens]
  (llama tokens :vocab 40 :width 32 :layers 2 :heads 4 :kv-heads 2 :hidden 64 :context 48))
""" + TAIL,
    # the loss adds the router's load-balancing loss, as MixtralForCausalLM's does
    "mixtral": """(defn lm [tokens :aux false]
  (mixtral tokens :vocab 40 :width 32 :layers 2 :heads 4 :kv-heads 2 :hidden 48 :experts 4
           :top-k 2 :context 48 :router-aux 0.02 :aux aux))
(defn loss [batch]
  (let [t (get batch :tokens)
        [logits aux] (lm (lm-inputs t) :aux true)]
    (+ (next-token-loss logits t) aux)))
(defrun :loss loss :data train :steps 40 :optimizer (adamw :lr 0.01 :weight-decay 0.0)
        :precision f32 :seed 1)
""",
    "mamba": """(defn lm [tokens]
  (mamba tokens :vocab 40 :width 32 :layers 2 :state 8 :conv 4 :expand 2 :dt-rank 4))
""" + TAIL,
}


def _twin_config(kind: str):
  t = transformers
  return {
      "gpt2": lambda: t.GPT2Config(vocab_size=40, n_positions=48, n_embd=32, n_layer=2,
                                   n_head=4),
      "llama": lambda: t.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=48),
      "mixtral": lambda: t.MixtralConfig(vocab_size=40, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=48,
                                         router_aux_loss_coef=0.02),
      "mamba": lambda: t.MambaConfig(vocab_size=40, hidden_size=32, state_size=8,
                                     num_hidden_layers=2, conv_kernel=4, expand=2,
                                     time_step_rank=4),
  }[kind]()


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
           "mixtral": "MixtralForCausalLM", "mamba": "MambaForCausalLM"}
TOKENS = np.random.RandomState(0).randint(0, 40, (2, 16)).astype(np.int32)
PROMPT = [3, 1, 4, 1]


class Kind:
  """One model kind's experiment, compiled once, and its files."""

  def __init__(self, kind: str, tmp: str):
    self.kind, self.tmp = kind, tmp
    self.path = os.path.join(tmp, f"{kind}.sx")
    with open(self.path, "w") as f:
      f.write(HEAD.format(kind=kind) + MODELS[kind])
    self.c = compile_file(self.path)
    self.cls = getattr(transformers, CLASSES[kind])
    self._forward = forward.forward(self.c, "lm", TOKENS.shape[1], TOKENS.shape[0])

  def logits(self, params: dict) -> np.ndarray:
    return np.asarray(self._forward(forward.device_params(self.c, params), TOKENS))

  def imported(self, hf: str, name: str) -> dict:
    ck = os.path.join(self.tmp, name)
    assert main(["import", hf, "-o", ck, self.path]) == 0
    params, meta = checkpoint_params(os.path.join(ck, self.kind, "0"))
    assert meta["step"] == 0
    return params


@pytest.fixture(scope="module", params=sorted(MODELS))
def kind(request, tmp_path_factory):
  return Kind(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def twin_import(kind):
  """A random-weight twin built and saved by transformers, and its import here."""
  torch.manual_seed(0)
  twin = kind.cls(_twin_config(kind.kind)).eval()
  hf = os.path.join(kind.tmp, "saved-by-transformers")
  twin.save_pretrained(hf)
  return twin, kind.imported(hf, "imported")


def test_a_twin_saved_by_transformers_imports_with_equal_logits(kind, twin_import):
  twin, params = twin_import
  with torch.no_grad():
    theirs = twin(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  assert np.abs(kind.logits(params) - theirs).max() < 1e-5, kind.kind


def test_export_then_import_gives_the_parameters_back_bit_for_bit(kind, twin_import):
  _, params = twin_import
  step0 = os.path.join(kind.tmp, "imported", kind.kind, "0")
  out = os.path.join(kind.tmp, "exported-import")
  assert main(["export", kind.path, "--resume", step0, "-o", out, "--format", "hf"]) == 0
  again = kind.imported(out, "imported-again")
  assert sorted(again) == sorted(params) == sorted(kind.c.params)
  for k in params:
    assert again[k].dtype == params[k].dtype and again[k].shape == params[k].shape, k
    np.testing.assert_array_equal(again[k], params[k], err_msg=k)


def test_a_model_trained_here_loads_in_transformers_with_equal_logits_and_greedy_text(kind):
  ck = os.path.join(kind.tmp, "ck")
  # 40 steps: enough that greedy decoding follows the chain, not one repeated token (as a
  # random tied head does), so that equal tokens say something
  sexpgpu.compile(kind.path).run(steps=40, checkpoint_dir=ck)
  step_dir = os.path.join(ck, kind.kind, "40")
  out = os.path.join(kind.tmp, "exported")
  assert main(["export", kind.path, "--resume", step_dir, "-o", out, "--format", "hf"]) == 0
  twin = kind.cls.from_pretrained(out).eval()
  assert type(twin).__name__ == CLASSES[kind.kind]
  params, _ = checkpoint_params(step_dir)
  with torch.no_grad():
    theirs = twin(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    gen = twin.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=32,
                        eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
  assert np.abs(kind.logits(params) - theirs).max() < 1e-4, kind.kind
  got = sample.generate(kind.c, "lm", params, PROMPT,
                        sample.Settings(tokens=32, temperature=0.0))
  assert got.path == "incremental", (kind.kind, got.reason)
  assert got.ids == gen and len(gen) == 32 and len(set(gen)) > 2, (kind.kind, gen)


def _mixtral(tmp_path_factory) -> Kind:
  return Kind("mixtral", str(tmp_path_factory.mktemp("mixtral-aux")))


def test_mixtral_aux_loss_and_a_training_step_equal_the_twins(tmp_path_factory):
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
  from sexpgpu.ir.ops import LowerCtx
  from sexpgpu.lower.interp import run_graph
  from sexpgpu.reader.read import read_text
  k = _mixtral(tmp_path_factory)
  torch.manual_seed(1)
  twin = k.cls(_twin_config("mixtral")).eval()
  hf = os.path.join(k.tmp, "hf")
  twin.save_pretrained(hf)
  params = k.imported(hf, "ck")
  with torch.no_grad():
    out = twin(torch.tensor(TOKENS, dtype=torch.long), output_router_logits=True)
    theirs = 0.02 * float(load_balancing_loss_func(out.router_logits, 4, 2))
  # (lm tokens :aux true) → [logits aux], built as the loss builds it
  b = k.c.exp.builder()
  b.params = dict(k.c.params)
  (form,) = read_text("(fn [batch] (get (lm (get batch :tokens) :aux true) 1))", "<aux>")
  g, _ = b.build("aux", b.eval(form, k.c.exp.env), {"tokens": ("i32", TOKENS.shape)},
                 allow_new_params=False)
  ours = float(run_graph(g, forward.device_params(k.c, params), {"tokens": TOKENS},
                         LowerCtx("f32", None, False, [], None))["out"])
  assert abs(ours - theirs) < 1e-6 and abs(ours - 0.02 * float(out.aux_loss)) < 1e-6
  assert theirs > 0.02 * 2 * 0.9  # top-2 of 4 experts: about 2 when balanced, never 0
  # a training step's loss and gradients: the loss here (next-token cross-entropy plus the
  # weighted aux loss) is the twin's on the same window, and so is every gradient
  import jax
  from sexpgpu.models import twin as twins
  batch = np.random.RandomState(3).randint(0, 40, (4, 17)).astype(np.int32)  # the loader's
  g = k.c.stages[0].graph
  ctx = LowerCtx("f32", None, False, [], None)
  loss, grads = jax.value_and_grad(
      lambda p: run_graph(g, p, {"tokens": batch}, ctx)["out"])(
          forward.device_params(k.c, params))
  x = torch.tensor(batch, dtype=torch.long)
  out = twin(x[:, :-1], output_router_logits=True)
  want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 40), x[:, 1:].reshape(-1))
  want = want + 0.02 * out.aux_loss
  want.backward()
  assert abs(float(loss) - float(want.detach())) < 1e-6
  theirs = {n: p.grad.numpy() for n, p in twin.named_parameters()}
  mine = twins.to_twin(twins.find(k.c.params, g, "test"),
                       {n: np.asarray(v) for n, v in grads.items()})
  assert sorted(mine) == sorted(theirs)
  for n in theirs:
    np.testing.assert_allclose(mine[n], theirs[n], atol=2e-6, rtol=1e-4, err_msg=n)


def _decode_plan(c, w):
  from sexpgpu.models import decode, source
  return decode.plan(source.logits_graph(c, "lm", w), w)


def test_mamba_decodes_one_position_a_step_with_a_state_that_does_not_grow(tmp_path_factory):
  import jax
  import jax.numpy as jnp
  from sexpgpu.ir.ops import LowerCtx
  from sexpgpu.models import decode
  k = Kind("mamba", str(tmp_path_factory.mktemp("mamba-decode")))
  torch.manual_seed(2)
  twin = k.cls(_twin_config("mamba")).eval()
  hf = os.path.join(k.tmp, "hf")
  twin.save_pretrained(hf)
  params = forward.device_params(k.c, k.imported(hf, "ck"))
  w = TOKENS.shape[1]
  pl = _decode_plan(k.c, w)
  assert sorted(pl.carries.values()) == ["recurrence", "window"]  # in the layers' body
  assert not pl.attention
  full = k.logits({n: np.asarray(v) for n, v in params.items()})[:1]
  ctx = LowerCtx("f32")
  n0 = 5
  buf = np.zeros((1, 8), np.int32)  # the prompt padded past its end, as sample pads it
  buf[0, :n0] = TOKENS[0, :n0]
  logits, cache = jax.jit(lambda p, t, c: decode.run(pl, p, t, ctx, c, jnp.int32(0), n0))(
      params, buf, decode.empty_cache(pl, params, ctx))
  got = [np.asarray(logits)[0, i] for i in range(n0)]
  step = jax.jit(lambda p, t, cache, o: decode.run(pl, p, t, ctx, cache, o))
  for i in range(n0, w):
    logits, cache = step(params, TOKENS[:1, i:i + 1], cache, jnp.int32(i))
    got.append(np.asarray(logits)[0, 0])
  assert np.abs(np.stack(got) - full[0]).max() < 1e-5
  # the state kept is the same at a window of 16 and of 4096 positions: for each of the 2
  # layers the conv's last 3 inputs [b 3 e] and the scan's state [b 1 e state], nothing as
  # long as the window
  def shapes(p):
    return sorted(tuple(a.shape) for a in jax.tree_util.tree_leaves(
        decode.empty_cache(p, params, ctx)))
  assert sorted(tuple(a.shape) for a in jax.tree_util.tree_leaves(cache)) == shapes(pl)
  assert shapes(pl) == shapes(_decode_plan(k.c, 4096)) == [(1, 1, 64, 8)] * 2 + [(1, 3, 64)] * 2


def test_check_print_decode_names_the_conv_window_and_the_recurrence_carry(tmp_path, capsys):
  path = tmp_path / "mamba.sx"
  path.write_text(HEAD.format(kind="mamba") + MODELS["mamba"])
  assert main(["check", str(path), "--print", "decode"]) == 0
  out = capsys.readouterr().out
  head = out.splitlines()[0]
  assert head.startswith("decode: incremental") and "carries kept 2" in head
  assert "sdpa regions keeping keys and values 0" in head
  lines = out.splitlines()
  conv = [ln for ln in lines if "window cache of the last (kernel-1)×dilation inputs" in ln]
  scan = [ln for ln in lines if "recurrence state kept (carry)" in ln]
  assert len(conv) == 1 and "= conv[" in conv[0] and "groups=64, padding=causal" in conv[0]
  assert len(scan) == 1 and "= linear-recurrence[axis=1" in scan[0]


def test_import_names_every_difference_of_a_mixtral_or_mamba_folder(tmp_path, capsys):
  configs = {"mixtral": dict(num_local_experts=3, rope_theta=1e4),
             "mamba": dict(state_size=4, conv_kernel=3)}
  for kind, changes in configs.items():
    k = Kind(kind, str(tmp_path))
    cfg = _twin_config(kind)
    for key, value in changes.items():
      setattr(cfg, key, value)
    hf = str(tmp_path / f"{kind}-other")
    k.cls(cfg).save_pretrained(hf)
    assert main(["import", hf, "-o", str(tmp_path / f"ck-{kind}"), k.path]) == 1
    err = capsys.readouterr().err
    assert "E-INIT-001" in err and "Traceback" not in err, err
    if kind == "mixtral":
      assert "num_local_experts 3 there, 4 here" in err
      assert "rope_theta 10000.0 there, 1000000.0 here" in err
      assert "block_sparse_moe.gate.weight: float32[3, 32] there, [4, 32] here" in err
      assert "model.layers.0.block_sparse_moe.experts.3.w1.weight: missing there" in err
    else:
      assert "state_size 4 there, 8 here" in err and "conv_kernel 3 there, 4 here" in err
      assert "backbone.layers.0.mixer.A_log: float32[64, 4] there, [64, 8] here" in err
      assert "backbone.layers.1.mixer.conv1d.weight: float32[64, 1, 3] there, [64, 1, 4] here" in err


def test_a_warm_start_from_the_twins_folder_equals_its_import(kind, twin_import):
  from sexpgpu.models import warm
  _, want = twin_import
  hf = os.path.join(kind.tmp, "saved-by-transformers")
  got, what = warm.load(kind.c, f"hf:{hf}")  # what a run with :init-from "hf:DIR" starts from
  assert warm.check(kind.c, got, what, partial=False) == [] and what == f"hf:{hf}"
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)

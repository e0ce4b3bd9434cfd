"""DPO: the `pairs` loader, `sequence-logps` and `dpo-loss` against PyTorch (a run against
its reference learning a preference: test_dpo_reference.py)."""

import json

import jax
import numpy as np
import pytest

import sexpgpu
from sexpgpu.data import make_loader
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.errors import SxError

VOCAB, N, SEQ = 12, 4, 9  # a prompt of N tokens from 2..11, the separator 1, a continuation

SRC = """(require std/nn)
(require std/lm)
(defloader train (pairs "pairs.jsonl" :seq %d :batch 8 :vocab %d))
(defn lm [tokens] (transformer-lm tokens :vocab %d :width 32 :layers 1 :heads 2))
(defn logps [logits tokens mask] (sequence-logps logits tokens mask))
(defn dpo [lc lr c r cm rm rc rr] (dpo-loss (logps lc c cm) (logps lr r rm) rc rr :beta 0.5))
(defn ipo [lc lr c r cm rm rc rr]
  (dpo-loss (sequence-logps lc c cm :mean true) (sequence-logps lr r rm :mean true) rc rr
            :beta 0.5 :ipo true))
(defn loss [batch]
  (let [c (get batch :chosen)] (next-token-loss (lm (lm-inputs c)) c)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32)
""" % (SEQ, VOCAB, VOCAB)


def _pairs(count, seed):
  """Prompts of N distinct tokens; chosen: sorted, rejected: another order of them."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    x = rng.choice(np.arange(2, VOCAB), N, replace=False)
    wrong = rng.permutation(x)
    while (wrong == np.sort(x)).all():
      wrong = rng.permutation(x)
    out.append({"prompt": x.tolist() + [1], "chosen": sorted(x.tolist()),
                "rejected": wrong.tolist()})
  return out


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
  folder = tmp_path_factory.mktemp("dpo")
  with open(folder / "pairs.jsonl", "w") as f:
    for p in _pairs(256, 0):
      f.write(json.dumps(p) + "\n")
  e = sexpgpu.compile_text(SRC, "dpo.sx", base_dir=str(folder))
  params = dict(e.init(seed=1).params)
  for k, v in params.items():  # the unembedding starts at zero: every sequence equally likely
    if k.endswith("unembed"):
      params[k] = 0.3 * jax.random.normal(jax.random.key(2), v.shape, v.dtype)
  ld = make_loader(LoaderSpec("train", "pairs", {"path": "pairs.jsonl", "seq": SEQ, "batch": 8,
                                                 "vocab": VOCAB}, base_dir=str(folder)))
  lm = jax.jit(lambda p, t: e.call("lm", p, t))
  return e, params, ld, lm


def test_the_loader_lays_prompt_and_continuation_with_masks(exp):
  _, _, ld, _ = exp
  b = ld.batch(0)
  assert set(b) == {"chosen", "rejected", "chosen-mask", "rejected-mask"}
  for key in ("chosen", "rejected"):
    assert b[key].shape == (8, SEQ)
    assert (b[key + "-mask"][:, :N + 1] == 0).all() and (b[key + "-mask"][:, N + 1:] == 1).all()
  assert (b["chosen"][:, :N + 1] == b["rejected"][:, :N + 1]).all()
  assert (np.diff(b["chosen"][:, N + 1:], axis=1) > 0).all()
  assert (np.sort(b["chosen"][:, :N], 1) == b["chosen"][:, N + 1:]).all()


def _torch_dpo(pc, pr, rc, rr, beta, ipo):
  import torch
  d = (pc - pr) - (rc - rr)
  if ipo:
    return ((d - 1 / (2 * beta)) ** 2).mean()
  return -torch.nn.functional.logsigmoid(beta * d).mean()


def _torch_logps(logits, tokens, mask, mean):
  import torch
  lp = torch.log_softmax(logits, -1)
  picked = torch.gather(lp, -1, tokens[:, 1:, None].long())[..., 0]
  m = (mask[:, 1:] != 0).to(lp.dtype)
  total = (picked * m).sum(-1)
  return total / m.sum(-1) if mean else total


@pytest.mark.parametrize("fn,ipo", [("dpo", False), ("ipo", True)])
def test_loss_and_gradient_equal_pytorch(exp, fn, ipo):
  import torch
  e, params, ld, lm = exp
  b = ld.batch(1)
  c, r, cm, rm = b["chosen"], b["rejected"], b["chosen-mask"], b["rejected-mask"]
  ref = {k: v for k, v in params.items()}
  policy = {k: v + 0.05 * jax.random.normal(jax.random.key(7), v.shape, v.dtype)
            for k, v in params.items()}  # the policy has moved away from the reference
  ref_lc, ref_lr = lm(ref, c[:, :-1]), lm(ref, r[:, :-1])
  rc = e.call("logps", {}, ref_lc, c, cm)
  rr = e.call("logps", {}, ref_lr, r, rm)
  if ipo:
    rc, rr = (_torch_logps(torch.tensor(np.asarray(x), dtype=torch.float64),
                           torch.tensor(t), torch.tensor(m), True).numpy().astype(np.float32)
              for x, t, m in ((ref_lc, c, cm), (ref_lr, r, rm)))
  lc, lr = lm(policy, c[:, :-1]), lm(policy, r[:, :-1])
  f = jax.jit(lambda a, b_: e.call(fn, {}, a, b_, c, r, cm, rm, rc, rr))
  loss, (g_c, g_r) = jax.value_and_grad(f, argnums=(0, 1))(lc, lr)
  tc = torch.tensor(np.asarray(lc), dtype=torch.float64, requires_grad=True)
  tr = torch.tensor(np.asarray(lr), dtype=torch.float64, requires_grad=True)
  want = _torch_dpo(_torch_logps(tc, torch.tensor(c), torch.tensor(cm), ipo),
                    _torch_logps(tr, torch.tensor(r), torch.tensor(rm), ipo),
                    torch.tensor(np.asarray(rc), dtype=torch.float64),
                    torch.tensor(np.asarray(rr), dtype=torch.float64), 0.5, ipo)
  want.backward()
  assert abs(float(loss) - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
  assert float(loss) != pytest.approx(np.log(2.0), abs=1e-3) or ipo  # the policy moved
  np.testing.assert_allclose(np.asarray(g_c), tc.grad.numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g_r), tr.grad.numpy(), atol=1e-5, rtol=1e-5)
  assert np.abs(tc.grad.numpy()).max() > 1e-4


def _load(tmp_path, lines, **args):
  (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
  return make_loader(LoaderSpec("train", "pairs", {"path": "p.jsonl", "seq": 8, "batch": 1,
                                                   **args}, base_dir=str(tmp_path)))


GOOD = json.dumps({"prompt": [2, 3], "chosen": [4], "rejected": [5]})


@pytest.mark.parametrize("line,found", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"prompt": [2], "chosen": [4]}', '"rejected" is missing'),
    ('{"prompt": [2], "chosen": [4], "rejected": 5}', '"rejected" is int'),
    ('{"prompt": [2], "chosen": [4], "rejected": []}', '"rejected" is empty'),
    ('{"prompt": [2], "chosen": [4, "x"], "rejected": [5]}', "other than token ids"),
    ('{"prompt": [2], "chosen": [40], "rejected": [5]}', "below :vocab 12"),
    ('{"prompt": "text", "chosen": [4], "rejected": [5]}', "no :tokenizer"),
])
def test_a_bad_pair_is_an_error_at_its_file_and_line(tmp_path, line, found):
  with pytest.raises(SxError) as e:
    _load(tmp_path, [GOOD, line], vocab=12)
  assert e.value.code == "E-CHAT-001" and "p.jsonl:2:" in str(e.value)
  assert found in str(e.value) and '"prompt"' in str(e.value)


def test_text_pairs_with_a_tokenizer_end_with_its_eos(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(["the sky is blue", "the sky is green"] * 5, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<eos>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  ld = _load(tmp_path, [json.dumps({"prompt": "the sky is", "chosen": " blue",
                                    "rejected": " green"})], seq=16, tokenizer="tokenizer.json")
  b = ld.batch(0)
  prompt = tok.encode("the sky is").ids
  chosen = prompt + tok.encode(" blue").ids + [tok.token_to_id("<eos>")]
  assert b["chosen"][0, :len(chosen)].tolist() == chosen
  assert b["chosen-mask"][0].tolist() == [0] * len(prompt) + [1] * (len(chosen) - len(prompt)) \
      + [0] * (16 - len(chosen))
  with pytest.raises(SxError) as e:
    _load(tmp_path, [GOOD] * 3, batch=4)
  assert e.value.code == "E-LOAD-002" and "3 pairs" in str(e.value)


RUN = """(require std/nn)
(require std/lm)
(defloader train (pairs "pairs.jsonl" :seq %d :batch 8 :vocab %d :shuffle false))
(defn lm [tokens] (transformer-lm tokens :vocab %d :width 16 :layers 1 :heads 2))
(defn logps [tokens mask] (sequence-logps (lm (lm-inputs tokens)) tokens mask))
(defn loss [batch]
  ; one model for both: a second call of logps would open logps.1, a model of its own
  (let [lp (logps (concat [(get batch :chosen) (get batch :rejected)] 0)
                  (concat [(get batch :chosen-mask) (get batch :rejected-mask)] 0))
        [c r] (split lp 2 0)]
    (dpo-loss c r 0.0 0.0 :beta 0.5)))
(defdiagnostic rewards/chosen :every 1 :of (tap rewards/chosen) :reduce mean)
(defdiagnostic rewards/accuracy :every 1 :of (tap rewards/accuracy) :reduce mean)
(defrun :loss loss :data train :steps 4 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
""" % (SEQ, VOCAB, VOCAB)


def _events(path):
  steps, diags = {}, {}
  for e in map(json.loads, open(path)):
    if e["kind"] == "step" and "train/loss" in e:
      steps[e["step"]] = e["train/loss"]
    elif e["kind"] == "diagnostic":
      diags[(e["step"], e["name"])] = e["value"]
  return steps, diags


@pytest.mark.slow  # three short runs: about 25 s
def test_a_dpo_run_reports_the_rewards_and_resumes_bitwise(tmp_path):
  path = tmp_path / "dpo.sx"
  path.write_text(RUN)
  (tmp_path / "pairs.jsonl").write_text(
      "".join(json.dumps(p) + "\n" for p in _pairs(64, 1)))
  whole = sexpgpu.compile(str(path), diagnostics="all").run(
      steps=4, metrics=f"jsonl:{tmp_path / 'a.jsonl'}")
  sexpgpu.compile(str(path), diagnostics="all").run(
      steps=2, checkpoint_dir=str(tmp_path / "ck"), metrics=f"jsonl:{tmp_path / 'b.jsonl'}")
  resumed = sexpgpu.compile(str(path), diagnostics="all").run(
      steps=4, checkpoint_dir=str(tmp_path / "ck"), resume="latest",
      metrics=f"jsonl:{tmp_path / 'c.jsonl'}")
  (a, da), (b, db), (c, dc) = (_events(tmp_path / f"{x}.jsonl") for x in "abc")
  assert sorted(a) == [1, 2, 3, 4] and {**b, **c} == a and {**db, **dc} == da
  for k, v in whole.params.items():
    assert np.array_equal(np.asarray(v), np.asarray(resumed.params[k])), k
  # step 1 trains the initial model, whose unembedding is zero: every token has
  # probability 1/V, so each reward (reference-free) is β · N continuation tokens · −log V
  assert da[(1, "rewards/chosen")] == pytest.approx(0.5 * N * -np.log(VOCAB), rel=1e-5)
  assert da[(1, "rewards/accuracy")] == 0.0


@pytest.mark.parametrize("written,message", [(":beta 0", ":beta is a number > 0"),
                                             (":beta -1", ":beta is a number > 0"),
                                             (":ipo 1", ":ipo is true or false"),
                                             (":mean 1", ":mean is true or false")])
def test_dpo_loss_keywords_are_checked_at_the_users_call(tmp_path, written, message):
  (tmp_path / "pairs.jsonl").write_text(GOOD + "\n")
  text = RUN.replace(":batch 8", ":batch 1")
  if written == ":mean 1":
    text = text.replace("(lm-inputs tokens)) tokens mask))",
                        "(lm-inputs tokens)) tokens mask :mean 1))")
    assert ":mean 1" in text
  else:
    text = text.replace(":beta 0.5", written)
  with pytest.raises(SxError) as e:
    sexpgpu.compile_text(text, "dpo.sx", base_dir=str(tmp_path))
  assert e.value.code == "E-ARG-001" and e.value.message.startswith(message)
  assert str(e.value.location).startswith("dpo.sx:11:" if "mean" not in written else "dpo.sx:5:")


def test_a_conversation_pair_is_rendered_with_the_chat_template(tmp_path):
  """The chosen sequence equals the chat loader's rendering of the conversation with the
  chosen answer as its last turn, masked on that turn alone."""
  from sexpgpu.data.chattemplate import ChatTemplate
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["the sky is blue", "user assistant"] * 5, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  messages = [{"role": "user", "content": "What color is the sky?"}]
  line = {"messages": messages, "chosen": "blue", "rejected": "green"}
  ld = _load(tmp_path, [json.dumps(line)], seq=40, tokenizer="tokenizer.json")
  b = ld.batch(0)
  t = ChatTemplate(str(tmp_path / "tokenizer.json"), ld.spec)
  assert t.source == "ChatML"
  for key in ("chosen", "rejected"):
    text, spans = t.assistant_spans(messages + [{"role": "assistant", "content": line[key]}])
    ids, mask = t.encode(text, spans, False)
    assert b[key][0, :len(ids)].tolist() == ids.tolist()
    assert b[key + "-mask"][0].tolist() == mask.tolist() + [0] * (40 - len(ids))
    assert tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == \
        line[key] + "<|im_end|>\n"
  for bad, found in (({"messages": messages, "chosen": "blue"}, '"rejected" is missing'),
                     ({"messages": messages, "chosen": "", "rejected": "x"}, '"chosen" is empty'),
                     ({"messages": [{"role": "robot", "content": "x"}], "chosen": "a",
                       "rejected": "b"}, 'role "robot"')):
    with pytest.raises(SxError) as e:
      _load(tmp_path, [json.dumps(line), json.dumps(bad)], seq=40, tokenizer="tokenizer.json")
    assert e.value.code == "E-CHAT-001" and "p.jsonl:2:" in str(e.value)
    assert found in str(e.value) and '"messages"' in str(e.value)
  with pytest.raises(SxError) as e:
    _load(tmp_path, [json.dumps(line)], seq=40)
  assert e.value.code == "E-CHAT-001" and "no :tokenizer" in str(e.value)

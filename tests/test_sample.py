"""`sexpgpu sample`: the window recomputed per token, against a plain loop of full forwards;
the same continuation for a seed; which function maps tokens to logits."""

import json
import os

import numpy as np
import pytest

from sexpgpu.cli.main import main
from sexpgpu.errors import SxError

SX = """
(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 24 :seq 9 :batch 2 :seed 7))
(defn lm [tokens]
  (gpt2 tokens :vocab 24 :width 16 :layers 1 :heads 2 :context 8))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  from sexpgpu.lower.init import init_params
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  tmp = tmp_path_factory.mktemp("sample")
  path = str(tmp / "s.sx")
  with open(path, "w") as f:
    f.write(SX)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(5, c.params).items()}
  return path, c, params, write_step0(c, params, str(tmp / "ck"))


def test_greedy_equals_a_loop_of_full_forwards_past_the_window(model):
  from sexpgpu.models import forward, sample
  path, c, params, _ = model
  prompt, n = [3, 1, 4], 9  # 3 + 9 tokens > the 8 positions: the window slides
  got = sample.generate(c, "lm", params, prompt, sample.Settings(tokens=n, temperature=0.0),
                        path="recompute")  # past the table: E-SAMPLE-002 without it
  assert got.path == "recompute"
  seq = list(prompt)
  p = forward.device_params(c, params)
  for _ in range(n):
    window = seq[-8:]
    f = forward.forward(c, "lm", len(window))  # no padding: exactly the tokens so far
    logits = np.asarray(f(p, np.asarray([window], np.int32)))[0, -1]
    seq.append(int(np.argmax(logits)))
  assert got.ids == seq[len(prompt):]


def test_top_k_1_is_greedy_and_choose_keeps_the_top_p_mass():
  import jax
  import jax.numpy as jnp
  from sexpgpu.models.sample import Settings, choose
  logits = jnp.asarray([0.0, 3.0, 1.0, 2.9], jnp.float32)
  key = jax.random.key(0)
  assert int(choose(logits, key, Settings(temperature=1.0, top_k=1))) == 1
  # top-p 0.5: only token 1 and 3 hold the first half of the mass
  seen = {int(choose(logits, jax.random.key(i), Settings(temperature=1.0, top_p=0.5)))
          for i in range(40)}
  assert seen <= {1, 3} and len(seen) == 2


def test_sample_with_a_seed_prints_the_same_continuation_twice(model, capsys):
  path, _, _, step_dir = model
  args = ["sample", path, "--resume", step_dir, "--prompt", "1 2 3", "--tokens", "6",
          "--temperature", "1.0", "--top-k", "10", "--top-p", "0.9", "--json"]
  outs = []
  for seed in ("4", "4", "5"):
    assert main(args + ["--seed", seed]) == 0
    captured = capsys.readouterr()
    outs.append(json.loads(captured.out))
    assert "incremental decoding" in captured.err
  assert outs[0]["ids"] == outs[1]["ids"] and len(outs[0]["ids"]) == 6
  assert outs[0]["text"] == " ".join(map(str, outs[0]["ids"]))
  assert outs[2]["ids"] != outs[0]["ids"]  # another seed, another draw (6 tokens of 10)
  assert outs[0]["tokens_per_s"] > 0


def test_which_function_maps_tokens_to_logits(model, tmp_path, capsys):
  from sexpgpu.models import source
  from sexpgpu.run.compile import compile_source
  path, c, _, step_dir = model
  assert source.candidates(c) == ["lm"]
  # two models trained side by side: either could be meant
  two = SX.replace("(next-token-loss (lm (lm-inputs t)) t)",
                   "(+ (next-token-loss (lm (lm-inputs t)) t) "
                   "(next-token-loss (lm2 (lm-inputs t)) t))")
  two += "(defn lm2 [tokens] (gpt2 tokens :vocab 24 :width 8 :layers 1 :heads 2))\n"
  c2 = compile_source(two)
  with pytest.raises(SxError) as e:
    source.default_fn(c2)
  assert e.value.code == "E-SAMPLE-001" and "candidates lm, lm2" in str(e.value)
  assert "--fn NAME, one of lm, lm2" in str(e.value)
  assert main(["sample", path, "--resume", step_dir, "--prompt", "1", "--fn", "loss"]) == 1
  err = capsys.readouterr().err
  assert "E-SAMPLE-001" in err and "Traceback" not in err
  assert main(["sample", path, "--resume", step_dir, "--prompt", "one two"]) == 1
  assert "E-FORM-001" in capsys.readouterr().err
  assert main(["sample", path, "--resume", step_dir, "--prompt", "99"]) == 1
  assert "outside the model's vocabulary of 24" in capsys.readouterr().err


HAND = """
(defloader train (markov :vocab 20 :seq 13 :batch 2 :seed 7))
(defn lm [tokens]
  (let [[b t] (shape tokens)
        d 16
        x (+ (take (param emb [20 d] :init (normal 0.5)) tokens)
             (take (param pos [32 d] :init (normal 0.5)) (iota t)))
        q (matmul x (param wq [d d] :init (normal 0.3)))
        k (matmul x (param wk [d d] :init (normal 0.3)))
        v (matmul x (param wv [d d] :init (normal 0.3)))
        p (softmax (causal-mask (* (einsum "bqd,bkd->bqk" q k) 0.25)) -1)
        h (+ x (einsum "bqk,bkd->bqd" p v))]
    (matmul (tanh h) (param out [d 20] :init (normal 0.3)))))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (cross-entropy (lm (slice t 1 0 -1)) (slice t 1 1 nil))))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""


LLAMA = """
(require std/lm)
(require std/llama)
(defknob context 12)
(defloader train (markov :vocab 30 :seq 13 :batch 2 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab 30 :width 32 :layers 2 :heads 4 :kv-heads 2 :hidden 48
         :context context))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01) :precision f32 :seed 3)
"""


def _models():
  from sexpgpu.run.compile import compile_file, compile_source
  tiny_lm = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "configs", "tiny-lm.sx")
  return {"gpt2": (compile_source(SX), 8), "transformer-lm": (compile_file(tiny_lm), 16),
          "hand-written": (compile_source(HAND), 12),
          # rope over exactly the window (its iota read as the offset), and a rotary table
          # of more positions than the window (its rows read at the offset)
          "llama": (compile_source(LLAMA), 12),
          "llama-table": (compile_source(LLAMA.replace("(defknob context 12)",
                                                       "(defknob context 40)")), 12)}


def _noisy_params(c):
  import jax
  from sexpgpu.lower.init import init_params
  return {k: v + 0.05 * jax.random.normal(jax.random.key(i), v.shape)  # no zero unembedding
          for i, (k, v) in enumerate(sorted(init_params(2, c.params).items()))}


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_incremental_decode_equals_the_full_forward_and_its_greedy_tokens():
  import jax
  import jax.numpy as jnp
  from sexpgpu.ir.ops import LowerCtx
  from sexpgpu.models import decode, forward, sample, source
  for name, (c, w) in _models().items():
    params = _noisy_params(c)
    pl = decode.plan(source.logits_graph(c, "lm", w), w)
    assert len(pl.attention) == 1 and (pl.tables or pl.iotas), name
    vocab = pl.graph.outputs["out"].shape[-1]
    toks = np.random.RandomState(0).randint(0, vocab, (1, w)).astype(np.int32)
    full = np.asarray(forward.forward(c, "lm", w)(params, toks))
    ctx = LowerCtx("f32")
    n0 = 3
    buf = np.zeros((1, w), np.int32)
    buf[0, :n0] = toks[0, :n0]
    logits, cache = jax.jit(lambda p, t: decode.run(pl, p, t, ctx, None))(params, buf)
    got = [np.asarray(logits)[0, i] for i in range(n0)]
    step = jax.jit(lambda p, t, cache, o: decode.run(pl, p, t, ctx, cache, o))
    for i in range(n0, w):
      logits, cache = step(params, toks[:, i:i + 1], cache, jnp.int32(i))
      got.append(np.asarray(logits)[0, 0])
    assert np.abs(np.stack(got) - full[0]).max() < 1e-5, name
    if name.startswith("llama"):  # grouped-query: the cache keeps the 2 kv heads, not 4
      assert len(pl.grouped) == 1, name
      assert {a.shape[-3] for a in jax.tree_util.tree_leaves(cache)} == {2}, name
    host = {k: np.asarray(v) for k, v in params.items()}
    settings = sample.Settings(tokens=w - 3, temperature=0.0)
    fast = sample.generate(c, "lm", host, [1, 2, 3], settings)
    slow = sample.generate(c, "lm", host, [1, 2, 3], settings, path="recompute")
    assert (fast.path, slow.path) == ("incremental", "recompute"), name
    assert fast.ids == slow.ids, name


def test_a_position_mixing_op_without_a_rule_falls_back_and_is_named(monkeypatch, tmp_path,
                                                                     capsys):
  from sexpgpu.lower.init import init_params
  from sexpgpu.models import sample
  from sexpgpu.models.export import write_step0
  from sexpgpu.run.compile import compile_file
  monkeypatch.setenv("SEXPGPU_PATTERNS", "off")  # attention stays einsum, causal-mask, einsum
  path = str(tmp_path / "hand.sx")
  with open(path, "w") as f:
    f.write(HAND)
  c = compile_file(path)
  params = {k: np.asarray(v) for k, v in init_params(1, c.params).items()}
  got = sample.generate(c, "lm", params, [1, 2], sample.Settings(tokens=4, temperature=0.0))
  assert got.path == "recompute" and "`einsum` (" in got.reason
  assert "hand.sx:11:" in got.reason and "no incremental rule" in got.reason
  step_dir = write_step0(c, params, str(tmp_path / "ck"))
  assert main(["sample", path, "--resume", step_dir, "--prompt", "1 2", "--tokens", "3"]) == 0
  assert "recompute decoding (`einsum`" in capsys.readouterr().err


def test_check_prints_the_decode_graph(tmp_path, monkeypatch, capsys):
  """`check --print decode`: the path sample takes, each node's time axis and its rule."""
  path = str(tmp_path / "gpt2.sx")
  with open(path, "w") as f:
    f.write(SX)
  assert main(["check", path, "--print", "decode"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("decode: incremental over a window of 8 positions, the prompt "
                        "prefilled, then one position a step")
  assert "sdpa regions keeping keys and values 1, position tables read at the offset 1" in out
  assert any(" = sdpa[" in line and line.endswith("| key/value cache, time axis 2")
             for line in out.splitlines())
  assert any("param[path='lm/gpt2/wte']" in line and "|" not in line  # no positions there
             for line in out.splitlines())
  monkeypatch.setenv("SEXPGPU_PATTERNS", "off")
  hand = str(tmp_path / "hand.sx")
  with open(hand, "w") as f:
    f.write(HAND)
  assert main(["check", hand, "--print", "decode", "--fn", "lm"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("decode: recompute (the window of 13 positions for every token): "
                        "`einsum` (") and "has no incremental rule" in out
  assert main(["check", hand, "--print", "decode", "--fn", "loss"]) == 1
  assert "error[E-SAMPLE-001]" in capsys.readouterr().err


def _losses(path):
  return [e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"]


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_defsample_writes_sample_events_and_leaves_the_losses_bitwise(tmp_path, capsys,
                                                                      monkeypatch):
  monkeypatch.setenv("COLUMNS", "24")  # the continuation is cut to the terminal's width
  plain, with_sample = str(tmp_path / "plain.sx"), str(tmp_path / "story.sx")
  with open(plain, "w") as f:
    f.write(SX.replace(":steps 1", ":steps 12"))
  with open(with_sample, "w") as f:
    f.write(SX.replace(":steps 1", ":steps 12") + '(defsample story :fn lm :prompts '
            '["1 2 3" "4"] :tokens 4 :every 5 :temperature 0)\n')
  for path, m in ((plain, "a.jsonl"), (with_sample, "b.jsonl")):
    assert main(["run", path, "--metrics", f"jsonl:{tmp_path / m}"]) == 0
  err = capsys.readouterr().err
  assert "story: step 5/12 loss " in err and "| story/tokens-per-s " in err
  shown = [x for x in err.splitlines() if x.startswith('story: "')]
  assert [x.split(" →")[0] for x in shown] == ['story: "1 2 3"', 'story: "4"'] * 3
  assert all(len(x) <= 24 for x in shown) and any(x.endswith("…") for x in shown)
  assert _losses(tmp_path / "a.jsonl") == _losses(tmp_path / "b.jsonl")
  assert main(["check", with_sample]) == 0
  assert "story: :fn lm :every 5 :tokens 4 2 prompts, incremental decoding" in \
      capsys.readouterr().out
  events = [e for e in map(json.loads, open(tmp_path / "b.jsonl")) if e["kind"] == "sample"]
  assert [(e["step"], e["prompt"]) for e in events] == [
      (s, p) for s in (5, 10, 12) for p in ("1 2 3", "4")]
  assert all(len(e["ids"]) == 4 and e["text"] == " ".join(map(str, e["ids"]))
             and e["path"] == "incremental" for e in events)


@pytest.mark.parametrize("form,code,text", [
    ('(defsample s :fn lm :prompts ["1 99"] :every 5)', "E-FORM-001",
     "outside the model's vocabulary of 24"),
    ('(defsample s :fn lm :prompts ["once upon"] :every 5)', "E-FORM-001", "not a token id"),
    ('(defsample s :fn 3 :prompts ["1"] :every 5)', "E-TYPE-001", "is not a function"),
    ('(defsample s :fn lm :prompts [] :every 5)', "E-TYPE-001", "vector of non-empty strings"),
    ('(defsample s :fn lm :prompts ["1"])', "E-FORM-001", "needs :every"),
    ('(defsample s :fn lm :prompts ["1"] :every 5 :top-p 2)', "E-TYPE-001", "in 0.0..1.0"),
    ('(defsample s :fn lm :prompts ["1"] :every 5 :tokens 100000)', "E-FORM-001",
     ":tokens is 100000; it takes"),
    ('(defsample s :fn loss :prompts ["1"] :every 5)', "E-SAMPLE-001",
     "does not build on tokens [1 8]: get needs a batch"),
])
def test_a_bad_defsample_stops_before_step_0_at_its_form(tmp_path, capsys, form, code, text):
  path = str(tmp_path / "bad.sx")
  with open(path, "w") as f:
    f.write(SX + form + "\n")
  assert main(["check", path]) == 1  # check refuses what run refuses
  assert f"error[{code}]" in capsys.readouterr().err
  assert main(["run", path]) == 1
  err = capsys.readouterr().err
  assert f"error[{code}]" in err and text in err, err
  assert "bad.sx:11:" in err and "step 0/" not in err and "Traceback" not in err


def test_a_sample_event_is_text_for_tensorboard_and_mlflow():
  from sexpgpu.track.events import scalars, texts
  event = {"kind": "sample", "step": 5, "name": "story", "prompt": "Once", "text": " upon",
           "ids": [7], "path": "incremental", "slug": "s", "time": 0.0}
  assert texts(event) == [("sample/story", "Once →  upon")] and scalars(event) == []


def test_a_sample_line_is_one_line_cut_to_the_width(monkeypatch):
  from sexpgpu.run import output
  line = output.sample_line("story", "Once\nupon", "a time\n\nthere  was a lighthouse", 40)
  assert line == 'story: "Once upon" → a time there was a…' and len(line) == 40
  assert output.sample_line("s", "1", "2 3", 40) == 's: "1" → 2 3'
  monkeypatch.setenv("COLUMNS", "57")
  assert output.width() == 57
  monkeypatch.delenv("COLUMNS")
  assert output.width() == output.LOG_WIDTH  # pytest's stderr is no terminal

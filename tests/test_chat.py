"""The `chat` loader: rendering as transformers does, assistant masks, the masked loss, resume, errors."""

import json

import jax
import numpy as np
import pytest

import sexpgpu
from sexpgpu.data import make_loader
from sexpgpu.data.chattemplate import CHATML, ChatTemplate
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.errors import SxError

# Zephyr's template: eos_token from the config, trim_blocks/lstrip_blocks matter.
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# A template that marks the assistant's text itself, and refuses roles out of turn.
MARKED = """{{ bos_token }}{% for message in messages %}
{% if loop.previtem is defined and loop.previtem['role'] == message['role'] %}
{{ raise_exception('Conversation roles must alternate user/assistant') }}
{% endif %}
{% if message['role'] == 'assistant' %}
{{ '[A] ' }}{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
{% else %}
{{ '[' + message['role'] | upper + '] ' + message['content'] | tojson + '\n' }}
{% endif %}
{% endfor %}"""
# Rewrites earlier turns (keeps only the last assistant turn): not incremental, not marked.
REWRITES = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
            "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2 plus 3?"},
     {"role": "assistant", "content": "2 plus 3 is 5."}],
    [{"role": "user", "content": "Spell kite backwards."},
     {"role": "assistant", "content": "etik"},
     {"role": "user", "content": "And boat? Ünïcode \"quoted\" <b>tag</b>"},
     {"role": "assistant", "content": "  taob  "},
     {"role": "user", "content": "Thanks!"},
     {"role": "assistant", "content": "You are welcome."}],
    [{"role": "user", "content": "Say nothing."},
     {"role": "assistant", "content": ""}],
]
TEMPLATES = {"chatml": None, "zephyr": ZEPHYR, "marked": MARKED}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]


def _train_tokenizer(path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  texts = [m["content"] for c in CONVERSATIONS for m in c] * 3
  texts += ["user assistant system <|user|> [A] [USER] [SYSTEM]"] * 5
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=320, special_tokens=SPECIAL, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """One tokenizer folder per template (the same tokenizer.json in each)."""
  root = tmp_path_factory.mktemp("chat")
  _train_tokenizer(root / "tokenizer.json")
  out = {}
  for name, template in {**TEMPLATES, "rewrites": REWRITES}.items():
    folder = root / name
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "pad_token": "<|endoftext|>"}
    if template is not None:
      config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    out[name] = folder
  return out


@pytest.fixture(scope="module")
def hf(folders):
  from transformers import PreTrainedTokenizerFast
  return {name: PreTrainedTokenizerFast.from_pretrained(str(folders[name])) for name in TEMPLATES}


def _spec(folder, **args):
  return LoaderSpec("train", "chat", {"tokenizer": str(folder / "tokenizer.json"), **args},
                    base_dir=str(folder))


def _ours(folder, conversation, everything=False):
  t = ChatTemplate(str(folder / "tokenizer.json"), _spec(folder))
  text, spans = t.assistant_spans(conversation)
  return t.encode(text, spans, everything)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_token_ids_equal_transformers_apply_chat_template(folders, hf, template):
  for conversation in CONVERSATIONS:
    ids, _ = _ours(folders[template], conversation)
    kwargs = {"chat_template": CHATML} if TEMPLATES[template] is None else {}
    want = hf[template].apply_chat_template(conversation, tokenize=True, **kwargs)
    assert ids.tolist() == list(want), template
  assert len(ids) > 5


def test_the_mask_of_a_marked_template_equals_transformers_assistant_mask(folders, hf):
  for conversation in CONVERSATIONS[:2]:  # transformers marks nothing for an empty generation
    ids, mask = _ours(folders["marked"], conversation)
    want = hf["marked"].apply_chat_template(conversation, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    assert ids.tolist() == want["input_ids"]
    assert mask.tolist() == want["assistant_masks"]
    assert 0 < mask.sum() < len(mask)


@pytest.mark.parametrize("template,end", [("chatml", "<|im_end|>\n"), ("zephyr", "</s>\n")])
def test_the_mask_is_one_exactly_on_the_assistants_tokens(folders, hf, template, end):
  tok = hf[template]
  for conversation in CONVERSATIONS:
    ids, mask = _ours(folders[template], conversation)
    said = [m["content"] for m in conversation if m["role"] == "assistant"]
    assert tok.decode(ids[mask == 1]) == "".join(s + end for s in said)
    # what is left is the rest of the rendered text, in order
    kwargs = {"chat_template": CHATML} if TEMPLATES[template] is None else {}
    text = tok.apply_chat_template(conversation, tokenize=False, **kwargs)
    rest = text
    for s in reversed(said):  # each turn's text removed from the end backwards
      at = rest.rindex(s + end)
      rest = rest[:at] + rest[at + len(s + end):]
    assert tok.decode(ids[mask == 0]) == rest
  _, everything = _ours(folders[template], CONVERSATIONS[1], everything=True)
  assert everything.tolist() == [1] * len(everything)


def _write(folder, name, conversations):
  with open(folder / name, "w") as f:
    for c in conversations:
      f.write(json.dumps({"messages": c}) + "\n")


@pytest.fixture(scope="module")
def data(folders):
  """12 conversations, and the chat loader over them."""
  folder = folders["chatml"]
  convs = [CONVERSATIONS[i % 3] + [{"role": "user", "content": f"Count to {i}."},
                                   {"role": "assistant", "content": " ".join(map(str, range(i)))}]
           for i in range(12)]
  _write(folder, "chat.jsonl", convs)
  return folder, convs


def test_rows_hold_each_conversation_once_with_its_mask(data):
  folder, convs = data
  ld = make_loader(_spec(folder, path="chat.jsonl", seq=48, batch=2), shuffle_default=False)
  rows = ld.take(0, ld.records)
  assert rows["tokens"].shape == (ld.records, 48) and set(rows) == {
      "tokens", "segments", "positions", "mask"}
  pieces = []  # (tokens, mask) of every piece, in row order
  for t, s, p, m in zip(rows["tokens"], rows["segments"], rows["positions"], rows["mask"]):
    assert (m[s == 0] == 0).all() and (t[s == 0] == ld.template.pad_id).all()
    for seg in range(1, s.max() + 1):
      assert p[s == seg].tolist() == list(range((s == seg).sum()))
      pieces.append((t[s == seg], m[s == seg]))
  want = [_ours(folder, c) for c in convs]
  got_t = np.concatenate([p[0] for p in pieces])
  assert sorted(got_t.tolist()) == sorted(np.concatenate([w[0] for w in want]).tolist())
  assert int(rows["mask"].sum()) == sum(int(w[1].sum()) for w in want) == ld.masked
  # a conversation that fits a row is one piece, equal to its own rendering
  whole = {tuple(t.tolist()): tuple(m.tolist()) for t, m in pieces}
  for ids, mask in want:
    if len(ids) <= 48:
      assert whole[tuple(ids.tolist())] == tuple(mask.tolist())
  # the position a run resumes at gives the same batch: batch(i) is pure
  ld2 = make_loader(_spec(folder, path="chat.jsonl", seq=48, batch=2), shuffle_default=True)
  ld2.next()
  ld2.next()
  state = ld2.state()
  third = ld2.next()
  ld3 = make_loader(_spec(folder, path="chat.jsonl", seq=48, batch=2), shuffle_default=True)
  ld3.set_state(state)
  again = ld3.next()
  assert all((again[k] == third[k]).all() for k in third)


SRC = """(require std/nn)
(require std/lm)
(defloader train (chat "chat.jsonl" :tokenizer "tokenizer.json" :seq 33 :batch 2 :vocab 320
                       :train-on %s))
(defn lm [tokens segments positions]
  (transformer-lm tokens :vocab 320 :width 16 :layers 1 :heads 2 :segments segments
                  :positions positions))
(defn masked-loss [logits t s m]
  (next-token-loss logits t :segments s :mask m))
(defn loss [batch]
  (let [t (get batch :tokens)
        s (get batch :segments)]
    (masked-loss (lm (lm-inputs t) (lm-inputs s) (lm-inputs (get batch :positions))) t s
                 (get batch :mask))))
(defrun :loss loss :data train :steps 4 :optimizer (adamw :lr 0.01) :precision f32 :seed 2)
"""


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_the_loss_equals_a_masked_cross_entropy_computed_here(data, train_on):
  folder, _ = data
  e = sexpgpu.compile_text(SRC % train_on, "sft.sx", base_dir=str(folder))
  params = dict(e.init(seed=3).params)
  for k, v in params.items():  # a zero unembedding would make every logit equal
    if k.endswith("unembed"):
      params[k] = jax.random.normal(jax.random.key(1), v.shape, v.dtype)
  ld = make_loader(_spec(folder, path="chat.jsonl", seq=33, batch=2, **{"train-on": train_on}))
  b = ld.batch(0)
  t, s, p, m = b["tokens"], b["segments"], b["positions"], b["mask"]
  logits = e.call("lm", params, t[:, :-1], s[:, :-1], p[:, :-1])
  loss = float(e.call("masked-loss", {}, logits, t, s, m))
  logits = np.asarray(logits, np.float64)
  nll = -np.take_along_axis(_log_softmax(logits), t[:, 1:, None], -1)[..., 0]
  counted = (m[:, 1:] == 1) & (s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0)
  if train_on == "all":
    assert counted.sum() == ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] != 0)).sum() > 0
  else:
    assert 0 < counted.sum() < (s[:, 1:] != 0).sum()
  assert loss == pytest.approx(nll[counted].mean(), rel=1e-5)



def _losses(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path))
          if e["kind"] == "step" and "train/loss" in e}


@pytest.mark.slow  # three short runs: 12 to 25 s
def test_a_resume_in_the_middle_continues_bitwise(data, tmp_path):
  folder, _ = data
  exp = folder / "sft.sx"
  exp.write_text(SRC % "assistant")
  whole = sexpgpu.compile(str(exp)).run(steps=4, metrics=f"jsonl:{tmp_path / 'a.jsonl'}")
  sexpgpu.compile(str(exp)).run(steps=2, checkpoint_dir=str(tmp_path / "ck"),
                                metrics=f"jsonl:{tmp_path / 'b.jsonl'}")
  resumed = sexpgpu.compile(str(exp)).run(steps=4, checkpoint_dir=str(tmp_path / "ck"),
                                          resume="latest",
                                          metrics=f"jsonl:{tmp_path / 'c.jsonl'}")
  a, b, c = (_losses(tmp_path / f"{x}.jsonl") for x in "abc")
  assert sorted(a) == [1, 2, 3, 4] and {**b, **c} == a
  assert all(np.isfinite(v) for v in a.values()) and a[4] < a[1]
  for k, v in whole.params.items():
    assert np.array_equal(np.asarray(v), np.asarray(resumed.params[k])), k


def _load(folder, lines, name="bad.jsonl", **args):
  (folder / name).write_text("\n".join(lines) + "\n")
  return make_loader(_spec(folder, **{"path": name, "seq": 64, "batch": 1, **args}))


GOOD = json.dumps({"messages": CONVERSATIONS[0]})


@pytest.mark.parametrize("line,found", [
    ("{not json", "not JSON"),
    ('["a list"]', "a JSON list, not an object"),
    ('{"text": "no messages"}', '"messages" is missing'),
    ('{"messages": []}', '"messages" is an empty list'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', 'role "robot"'),
    ('{"messages": [{"role": "user", "content": ["a", "b"]}]}', "content is list"),
    ('{"messages": [{"role": "user"}]}', "content is missing"),
    ('{"messages": ["hi"]}', "message 1 is a str"),
])
def test_a_bad_line_is_an_error_at_its_file_and_line_with_the_shape(folders, line, found):
  with pytest.raises(SxError) as e:
    _load(folders["chatml"], [GOOD, "", GOOD, line, GOOD])
  assert e.value.code == "E-CHAT-001"
  assert "bad.jsonl:4:" in str(e.value) and found in str(e.value)
  assert '{"messages": [{"role": "system"|"user"|"assistant"' in str(e.value)


def test_a_conversation_the_template_refuses_is_an_error_at_its_line(folders):
  two_users = json.dumps({"messages": [{"role": "user", "content": "a"},
                                       {"role": "user", "content": "b"}]})
  with pytest.raises(SxError) as e:
    _load(folders["marked"], [GOOD, two_users])
  assert e.value.code == "E-CHAT-001" and "bad.jsonl:2:" in str(e.value)
  assert "roles must alternate" in str(e.value)


def test_a_template_that_rewrites_earlier_turns_needs_generation_marks(folders):
  with pytest.raises(SxError) as e:
    _load(folders["rewrites"], [json.dumps({"messages": CONVERSATIONS[1]})])
  assert e.value.code == "E-CHAT-002" and "bad.jsonl:1:" in str(e.value)
  assert "{% generation %}" in e.value.fix
  # trained on every token, nothing need be located; one assistant turn, last, renders
  # incrementally even here
  every = _load(folders["rewrites"], [json.dumps({"messages": CONVERSATIONS[1]})],
                **{"train-on": "all"})
  assert every.masked == every.tokens
  one = _load(folders["rewrites"], [json.dumps({"messages": CONVERSATIONS[0]})])
  assert 0 < one.masked < one.tokens


def test_a_template_that_does_not_compile_names_its_file(tmp_path, folders):
  folder = tmp_path / "broken"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((folders["chatml"] / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": "{% for m in messages %}{{ m['content'] }"}))
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD])
  assert e.value.code == "E-CHAT-002" and "tokenizer_config.json" in str(e.value)
  assert "does not compile" in str(e.value)
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
  with pytest.raises(SxError, match="chat_template is int") as e:
    _load(folder, [GOOD])
  (folder / "tokenizer_config.json").write_text("[1, 2]")
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD])
  assert e.value.code == "E-CHAT-002"


def test_missing_files_and_bad_keywords(folders, tmp_path):
  folder = folders["chatml"]
  with pytest.raises(SxError) as e:
    make_loader(_spec(folder, path="nowhere.jsonl", seq=64, batch=1))
  assert e.value.code == "E-LOAD-001" and "nowhere.jsonl" in str(e.value)
  with pytest.raises(SxError) as e:
    make_loader(LoaderSpec("train", "chat", {"path": "x.jsonl", "tokenizer": "no/tok.json",
                                             "seq": 8, "batch": 1}, base_dir=str(tmp_path)))
  assert e.value.code == "E-LOAD-001" and "tok.json" in str(e.value)
  (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
  with pytest.raises(SxError) as e:
    make_loader(LoaderSpec("train", "chat", {"path": "x.jsonl", "tokenizer": "tokenizer.json",
                                             "seq": 8, "batch": 1}, base_dir=str(tmp_path)))
  assert e.value.code == "E-TOK-002"
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD], **{"train-on": "users"})
  assert e.value.code == "E-FORM-001" and "assistant, all" in str(e.value)
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD], vocab=100)
  assert e.value.code == "E-LOAD-003" and "320 tokens" in str(e.value)
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD], batch=2)
  assert e.value.code == "E-LOAD-002"
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD, GOOD], split=[0, 0.4])
  assert e.value.code == "E-LOAD-002" and "holds no conversation" in str(e.value)


def test_a_parquet_file_of_messages_gives_the_same_rows(data, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  folder, convs = data
  pq.write_table(pa.table({"messages": convs}), folder / "chat.parquet")
  a = make_loader(_spec(folder, path="chat.jsonl", seq=48, batch=2))
  b = make_loader(_spec(folder, path="chat.parquet", seq=48, batch=2))
  assert a.records == b.records
  for k, v in a.take(0, a.records).items():
    assert np.array_equal(v, b.take(0, b.records)[k]), k
  bad = [convs[0], [{"role": "robot", "content": "x"}]]
  pq.write_table(pa.table({"messages": bad}), folder / "bad.parquet")
  with pytest.raises(SxError) as e:
    make_loader(_spec(folder, path="bad.parquet", seq=48, batch=1))
  assert e.value.code == "E-CHAT-001" and "bad.parquet:2:" in str(e.value)
  (folder / "text.parquet").write_text("not parquet at all")
  with pytest.raises(SxError) as e:
    make_loader(_spec(folder, path="text.parquet", seq=48, batch=1))
  assert e.value.code == "E-CHAT-001" and "not a readable parquet file" in str(e.value)


def test_a_conversation_too_long_to_render_turn_by_turn_is_refused(folders, monkeypatch):
  from sexpgpu.data import chattemplate
  monkeypatch.setattr(chattemplate, "RENDER_BUDGET", 2000)
  turns = [{"role": r, "content": "x" * 40} for _ in range(30) for r in ("user", "assistant")]
  with pytest.raises(SxError) as e:
    _load(folders["chatml"], [GOOD, json.dumps({"messages": turns})])
  assert e.value.code == "E-CHAT-002" and "bad.jsonl:2:" in str(e.value)
  assert "more than the 2000 allowed" in str(e.value)
  _load(folders["marked"], [GOOD, json.dumps({"messages": turns})])  # rendered once


def test_a_template_that_fails_on_a_conversation_is_an_error_at_its_line(tmp_path, folders):
  folder = tmp_path / "fails"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((folders["chatml"] / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": "{% for m in messages %}{{ m['content'] + loop.length }}{% endfor %}"}))
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD])
  assert e.value.code == "E-CHAT-002" and "bad.jsonl:1:" in str(e.value)
  assert "fails on this conversation: TypeError" in str(e.value)


@pytest.mark.parametrize("template,limit", [
    # loops within loops over range: 10^10 steps
    ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
     "more than 100,000 steps"),
    # a macro that calls itself twice: 2^40 calls at a depth of 40
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
     "more than 100,000 steps"),
    # text that doubles on each turn of a loop: 2^60 characters
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "MiB allowed"),
])
def test_a_template_that_would_spin_or_fill_memory_is_stopped(tmp_path, folders, monkeypatch,
                                                              template, limit):
  from sexpgpu.data import chattemplate
  monkeypatch.setattr(chattemplate, "RENDER_MEMORY", 64 * 2**20)  # lower than the defaults
  monkeypatch.setattr(chattemplate, "RENDER_STEPS", 100_000)        # (which are not what is held)
  folder = tmp_path / "hostile"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((folders["chatml"] / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  with pytest.raises(SxError) as e:
    _load(folder, [GOOD])
  assert e.value.code == "E-CHAT-002" and "bad.jsonl:1:" in str(e.value), e.value
  assert "was stopped rendering this conversation" in str(e.value) and limit in str(e.value)

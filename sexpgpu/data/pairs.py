"""The `pairs` loader: preference pairs, a prompt with a chosen and a rejected continuation (DPO)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from sexpgpu.data import base, chat
from sexpgpu.data.spec import LoaderDef, LoaderSpec, key, load_error
from sexpgpu.errors import SxError

# Keeps the pairs loader's shuffle apart from the other loaders' streams.
TAG_PAIRS = 12
_I32 = np.dtype(np.int32)
SHAPE = ('{"prompt": "...", "chosen": "...", "rejected": "..."} (text, with :tokenizer) or '
         'lists of token ids')
KEYS = ("prompt", "chosen", "rejected")
MESSAGES = ('{"messages": [{"role": "user", "content": "..."}, ...], "chosen": "...", '
            '"rejected": "..."}')


class PairsLoader(base.Loader):
  """`(pairs "FILE.jsonl" :seq N :batch B [:tokenizer "tokenizer.json"] ...)`.

  Each line (or row of a .parquet file's three columns) is a preference pair, `{"prompt":
  ..., "chosen": ..., "rejected": ...}`: text (tokenized with `:tokenizer`, without added
  special tokens, each continuation followed by the end-of-sequence token of the
  tokenizer_config.json beside it when it names one, as TRL's DPO trainer does) or lists
  of token ids (taken as they are; the prompt may be empty); or `{"messages": [...],
  "chosen": "...", "rejected": "..."}`, the conversation so far rendered with the
  tokenizer's chat template and its generation prompt, each answer as the assistant's next
  turn (end-of-turn marker included). Each record has `:chosen` and `:rejected`, the
  prompt followed by each continuation, cut to N and padded at the end (the pad or
  end-of-sequence token, else 0), and `:chosen-mask` and `:rejected-mask`, 1 on the
  continuation's tokens, all int32[N]: the sequences start at position 0 and padding
  follows them, so a causal model needs no segments. `:split [a b]` keeps pairs floor(a·P)
  … floor(b·P)−1; `:shuffle` permutes them each epoch by (run seed, `:seed`, stream,
  epoch). `:vocab V` refuses a token id ≥ V.
  """

  kind = "pairs"

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.path = chat.resolve(spec, args["path"], '(pairs "data/pairs.jsonl" :seq 64 '
                             ':batch 8 :tokenizer "tok/tokenizer.json")', "path")
    # every keyword is as PAIRS declares it (bind_args checked ranges and names)
    self.seq, self.batch_size, split = args["seq"], args["batch"], args["split"]
    shuffle = ctx.shuffle_default if args["shuffle"] is None else args["shuffle"]
    stream, own_seed = args["stream"], args["seed"]
    self.tokenizer = args["tokenizer"]
    self.template = None if self.tokenizer is None else chat.open_template(spec, args)
    self.folder = None if self.template is None else self.template.folder
    self.vocab = 0 if self.template is None else self.template.vocab
    if self.template is not None:
      chat.check_vocab(spec, args, self.vocab)
    limit = args["vocab"]
    eos = None
    if self.template is not None and "eos_token" in self.template.variables:
      eos = self.template.tokenizer.token_to_id(self.template.variables["eos_token"])
    self.pad_id = 0 if self.template is None else self.template.pad_id
    pairs = [self._pair(n, line, eos, limit) for n, line in chat.json_lines(spec, self.path,
                                                                           SHAPE)]
    total = len(pairs)
    p0, p1 = int(np.floor(split[0] * total)), int(np.floor(split[1] * total))
    self._pairs = pairs[p0:p1]
    self.records = len(self._pairs)
    if self.records < self.batch_size:
      raise load_error("E-LOAD-002", spec, self.path,
                       f"{self.records} pairs (of the file's {total}, :split {list(split)}) is "
                       f"fewer than one microbatch of {self.batch_size}",
                       "add pairs to the file, widen :split, or lower :batch")
    self.cut = sum(max(len(c[0]), len(r[0])) > self.seq for c, r in self._pairs)
    self.order = chat.Order(TAG_PAIRS, self.records, shuffle, ctx.seed, own_seed, stream)
    shape = (self.batch_size, self.seq)
    self.fields = {k: (shape, _I32) for k in ("chosen", "rejected", "chosen-mask",
                                              "rejected-mask")}

  def _pair(self, number: int, line: dict, eos: int | None, limit: int):
    """A line's chosen and rejected sequences, each (token ids, mask on the continuation).

    Raises:
      SxError: E-CHAT-001 at the file and line for a missing key, a value of another type,
        text without a tokenizer, an empty continuation, or an id outside the vocabulary.
    """
    if "messages" in line:
      return self._conversation(number, line)
    out = []
    for key in KEYS:
      value = line.get(key)
      if isinstance(value, str):
        if self.template is None:
          raise chat.line_error(self.spec, self.path, number, f'"{key}" is text and the '
                                "loader has no :tokenizer", "lists of token ids, or give the "
                                'loader :tokenizer "tokenizer.json" for text: ' + SHAPE)
        ids = self.template.tokenizer.encode(value, add_special_tokens=False).ids
        ids = ids + ([eos] if key != "prompt" and eos is not None else [])
      elif isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                           and 0 <= i < (limit or 2**31) for i in value):
        ids = list(value)
      else:
        found = "missing" if value is None else type(value).__name__
        if isinstance(value, list):
          found = "a list holding something other than token ids" + (
              f" below :vocab {limit}" if limit else "")
        raise chat.line_error(self.spec, self.path, number, f'"{key}" is {found}, expected '
                              "text or a list of token ids", SHAPE)
      if key != "prompt" and not ids:
        raise chat.line_error(self.spec, self.path, number, f'"{key}" is empty: a pair '
                              "compares two continuations", SHAPE)
      out.append(np.asarray(ids, _I32))
    prompt = out[0]
    return tuple((np.concatenate([prompt, c]),
                  np.concatenate([np.zeros(len(prompt), _I32), np.ones(len(c), _I32)]))
                 for c in out[1:])

  def _conversation(self, number: int, line: dict):
    """`{"messages": [...], "chosen": "...", "rejected": "..."}`: the conversation so far
    rendered with the chat template and its generation prompt, each answer as the
    assistant's next turn (its end-of-turn marker included), masked as the chat loader
    masks an assistant turn.

    Raises:
      SxError: E-CHAT-001 for a line of the wrong shape or one the template refuses,
        E-CHAT-002 when the template's rendering of the answer does not extend the prompt's.
    """
    if self.template is None:
      raise chat.line_error(self.spec, self.path, number, '"messages" needs a chat template '
                            "and the loader has no :tokenizer", 'give the loader :tokenizer '
                            '"tokenizer.json" (its tokenizer_config.json gives the template) '
                            "for " + MESSAGES)
    messages = chat.check_messages(self.spec, self.path, number, line.get("messages"),
                                   MESSAGES)
    out = []
    for key in KEYS[1:]:
      answer = line.get(key)
      if not isinstance(answer, str) or not answer:
        found = "missing" if answer is None else "empty" if answer == "" else \
            type(answer).__name__
        raise chat.line_error(self.spec, self.path, number, f'"{key}" is {found}, expected '
                              "the assistant's answer as text", MESSAGES)
      turn = messages + [{"role": "assistant", "content": answer}]
      head, full = chat.guarded(self.spec, self.template, self.path, number, lambda: (
          self.template.render(messages, add_generation_prompt=True),
          self.template.render(turn)))  # pylint: disable=cell-var-from-loop
      if not full.startswith(head):
        raise SxError("E-CHAT-002", f"loader `{self.spec.name}`: {self.path}:{number}: "
                           "the template's rendering of the answer does not extend the "
                           "conversation's with its generation prompt",
                           location=self.spec.location,
                           fix="give the pair as text, {\"prompt\", \"chosen\", "
                           "\"rejected\"}, or a template that renders turns in order")
      out.append(self.template.encode(full, [(len(head), len(full))], False))
    return tuple(out)

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of pairs, a pure function of (file, args, seed, i)."""
    rows = self.order.indices(i * self.batch_size, self.batch_size)
    out = {k: np.zeros((self.batch_size, self.seq), _I32) for k in self.fields}
    out["chosen"].fill(self.pad_id)
    out["rejected"].fill(self.pad_id)
    for j, r in enumerate(rows):
      for key, (ids, mask) in zip(("chosen", "rejected"), self._pairs[int(r)]):
        n = min(len(ids), self.seq)
        out[key][j, :n] = ids[:n]
        out[key + "-mask"][j, :n] = mask[:n]
    return out

  def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
    """The continuations' tokens of a batch (what the loss reads), prompts left out."""
    return int(sum(np.count_nonzero(batch[k + "-mask"]) for k in ("chosen", "rejected")))

  def describe(self) -> dict[str, Any]:
    """Kind, field types, pairs, the file and how many pairs were cut to :seq."""
    source = "token ids" if self.template is None else os.path.basename(self.tokenizer)
    return {**super().describe(), "file": self.path, "cut": self.cut,
            "summary": f"{self.records} pairs, {self.cut} cut to {self.seq} tokens, "
                       f"tokenizer {source}"}


PAIRS = LoaderDef(
    "pairs", "preference pairs, one JSON line each ({\"prompt\", \"chosen\", \"rejected\"}: text "
    "with :tokenizer, or token ids): :chosen and :rejected (the prompt, then the continuation, "
    "padded at the end) and :chosen-mask and :rejected-mask, 1 on the continuation (DPO's "
    "sequence-logps and dpo-loss)",
    (key("path"), key("seq", required=True), key("batch", required=True), key("tokenizer"),
     key("split"), key("shuffle"), key("stream"), key("seed"), key("vocab", default=0, lo=0)),
    PairsLoader)

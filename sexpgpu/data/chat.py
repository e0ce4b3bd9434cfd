"""The `chat` loader: conversations rendered with a chat template, packed, masked on assistant text."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator

import numpy as np

from sexpgpu import bounded
from sexpgpu.data import base, chattemplate
from sexpgpu.data.files import RecordOrder
from sexpgpu.data.spec import LoaderDef, LoaderSpec, form_error, key, load_error
from sexpgpu.data.text import first_fit
from sexpgpu.errors import SxError

# Keeps the chat loader's shuffle apart from the other loaders' streams (base.TAG_*, text's).
TAG_CHAT = 11
_I32 = np.dtype(np.int32)
TRAIN_ON = ("assistant", "all")
FILE_LIMIT = 4 * bounded.GiB
LINE_LIMIT = 16 * bounded.MiB
SHAPE = ('{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}')


class Order(RecordOrder):
  """RecordOrder seeded by (tag, run seed, `:seed`, stream, epoch)."""

  def __init__(self, tag: int, count: int, shuffle: bool, seed: int, own_seed: int,
               stream: int):
    super().__init__(count, shuffle, seed, stream)
    self.tag, self.own_seed = tag, own_seed

  def permutation(self, epoch: int) -> np.ndarray:
    """The order of the rows in one epoch (cached, at most two)."""
    if epoch not in self._perms:
      if len(self._perms) >= 2:
        self._perms.pop(next(iter(self._perms)))
      g = base.rng(self.tag, self.seed, self.own_seed, self.stream, epoch)
      self._perms[epoch] = g.permutation(self.count)
    return self._perms[epoch]


def line_error(spec: LoaderSpec, path: str, number: int, problem: str, shape: str
               ) -> SxError:
  """An E-CHAT-001 naming the file and line of a record of the wrong shape, and the shape."""
  return SxError("E-CHAT-001", f"loader `{spec.name}`: {path}:{number}: {problem}",
                 location=spec.location,
                 fix=f"write one JSON object a line: {shape}")


def json_lines(spec: LoaderSpec, path: str, shape: str) -> Iterator[tuple[int, dict]]:
  """The records of a .jsonl file (JSON objects, blank lines skipped) or of a .parquet
  file (its rows, columns as keys), each with its line or row number from 1.

  Raises:
    SxError: E-LOAD-001 for a missing file, E-CHAT-001 for a line that is not a JSON
      object, a parquet file that cannot be read, or a file past its bounds.
  """
  if not os.path.isfile(path):
    raise load_error("E-LOAD-001", spec, path, "no such file",
                     f"write the path of a .jsonl file of lines {shape} "
                     "(relative to the .sx file)")
  if path.endswith(".parquet"):
    yield from enumerate(_parquet_rows(spec, path, shape), start=1)
    return
  for number, text in bounded.read_lines(path, limit=FILE_LIMIT, line_limit=LINE_LIMIT,
                                         what=f"loader `{spec.name}`: file", code="E-CHAT-001",
                                         fix=f"give UTF-8 JSON lines {shape}"):
    if not text.strip():
      continue
    try:
      value = json.loads(text)
    except (ValueError, RecursionError) as e:
      raise line_error(spec, path, number, f"not JSON ({getattr(e, 'msg', e)})",
                       shape) from None
    if not isinstance(value, dict):
      raise line_error(spec, path, number, f"a JSON {type(value).__name__}, not an object",
                       shape)
    yield number, value


def _parquet_rows(spec: LoaderSpec, path: str, shape: str) -> list[dict]:
  """A parquet file's rows as dicts (a list of structs becomes a list of dicts)."""
  import io  # pylint: disable=import-outside-toplevel

  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  data = bounded.read_bytes(path, limit=FILE_LIMIT, what=f"loader `{spec.name}`: file",
                            code="E-CHAT-001", fix="give a parquet file of at most "
                            f"{bounded.size_text(FILE_LIMIT)}, or split it")
  try:
    return pq.read_table(io.BytesIO(data)).to_pylist()
  except (pa.ArrowException, OSError) as e:
    raise SxError("E-CHAT-001", f"loader `{spec.name}`: {path}: not a readable parquet file "
                  f"({str(e)[:200]})", location=spec.location,
                  fix=f"write it with pyarrow or pandas, a row for each record: {shape}"
                  ) from None


def check_messages(spec: LoaderSpec, path: str, number: int, messages: Any, shape: str,
                   key: str = "messages") -> list[dict[str, str]]:
  """A line's messages, checked: a non-empty list of {role, content} with a known role.

  Raises:
    SxError: E-CHAT-001 at the file and line, saying what is wrong.
  """
  if not isinstance(messages, list) or not messages:
    found = "missing" if messages is None else f"{type(messages).__name__}"
    found = "an empty list" if messages == [] else found
    raise line_error(spec, path, number, f'"{key}" is {found}, expected a list of messages',
                     shape)
  out = []
  for k, m in enumerate(messages):
    if not isinstance(m, dict):
      raise line_error(spec, path, number, f"message {k + 1} is a {type(m).__name__}, "
                       "expected an object", shape)
    role, content = m.get("role"), m.get("content")
    if role not in chattemplate.ROLES:
      raise line_error(spec, path, number, f"message {k + 1} has role {json.dumps(role)[:40]}, "
                       "expected system, user or assistant", shape)
    if not isinstance(content, str):
      raise line_error(spec, path, number, f"message {k + 1}'s content is "
                       f"{'missing' if content is None else type(content).__name__}, "
                       "expected a string", shape)
    out.append({"role": role, "content": content})
  return out


def render(spec: LoaderSpec, tmpl: chattemplate.ChatTemplate, path: str, number: int,
           messages: list[dict[str, str]], everything: bool) -> tuple[np.ndarray, np.ndarray]:
  """One conversation's token ids and mask (1 on assistant tokens, or on all).

  Raises:
    SxError: as `guarded`.
  """
  text, spans = guarded(spec, tmpl, path, number, lambda: (
      (tmpl.render(messages), []) if everything else tmpl.assistant_spans(messages)))
  return tmpl.encode(text, spans, everything)


def guarded(spec: LoaderSpec, tmpl: chattemplate.ChatTemplate, path: str, number: int,
            thunk: Callable[[], Any]) -> Any:
  """`thunk()`, a rendering of line `number`'s conversation, its failures as errors.

  Raises:
    SxError: E-CHAT-001 when the template refuses the conversation (`raise_exception`),
      E-CHAT-002 when it cannot locate the assistant's text or fails on it.
  """
  import jinja2  # pylint: disable=import-outside-toplevel
  try:
    return thunk()
  except jinja2.exceptions.TemplateError as e:
    raise line_error(spec, path, number, f"the chat template refuses the conversation: {e}",
                     "messages in the order the template accepts (often: an optional system "
                     "message, then user and assistant in turn), " + SHAPE) from None
  except chattemplate.NotLocated as e:
    raise SxError("E-CHAT-002", f"loader `{spec.name}`: {path}:{number}: {e}",
                  location=spec.location,
                  fix=f"mark the assistant's text in the template ({tmpl.source}) with "
                  "{% generation %}...{% endgeneration %}, or train on all tokens "
                  "(:train-on all)") from None
  except chattemplate.TooCostly as e:
    raise SxError("E-CHAT-002", f"loader `{spec.name}`: {path}:{number}: the chat template "
                  f"({tmpl.source}) was stopped rendering this conversation: it took {e}",
                  location=spec.location,
                  fix="correct the template: a chat template renders a conversation in "
                  "milliseconds; look for loops over range or text that grows without end") \
        from None
  except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
          RecursionError) as e:
    raise SxError("E-CHAT-002", f"loader `{spec.name}`: {path}:{number}: the chat template "
                  f"({tmpl.source}) fails on this conversation: {type(e).__name__}: "
                  f"{str(e)[:200]}", location=spec.location,
                  fix="correct the template (transformers' apply_chat_template fails on this "
                  "conversation too)") from None


class ChatLoader(base.Loader):
  """`(chat "FILE.jsonl" :tokenizer "tokenizer.json" :seq N :batch B [:train-on assistant|all] ...)`.

  Each line (or, in a .parquet file, each row of its `messages` column) is a conversation,
  `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`, rendered
  with the chat template of the tokenizer_config.json beside the tokenizer (ChatML when it
  has none) as transformers' apply_chat_template renders it, and tokenized. `:split [a b]`
  keeps conversations floor(a·C) … floor(b·C)−1. Conversations are placed into rows of N
  whole, first-fit in file order (a longer one cut into pieces of N, each a segment), the
  rest of a row padding (the pad or end-of-sequence token); `:shuffle` permutes the rows
  each epoch by (run seed, `:seed`, stream, epoch). Each record has `:tokens`, `:segments`
  (1, 2, 3 … per piece, 0 for padding), `:positions` (from 0 in each piece) and `:mask` (1
  on the tokens the assistant wrote, its end-of-turn marker included; on every token of a
  conversation with `:train-on all`), all int32[N]. `:vocab V` checks that the tokenizer
  fits a model of V tokens.
  """

  kind = "chat"

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.path = resolve(spec, args["path"], '(chat "data/chat.jsonl" :tokenizer '
                        '"tok/tokenizer.json" :seq 256 :batch 8)', "path")
    # every keyword is as CHAT declares it (bind_args checked ranges and names)
    self.seq, self.batch_size, self.train_on = args["seq"], args["batch"], str(args["train-on"])
    split = args["split"]
    shuffle = ctx.shuffle_default if args["shuffle"] is None else args["shuffle"]
    stream, own_seed = args["stream"], args["seed"]
    self.template = open_template(spec, args)
    self.folder = self.template.folder  # its tokenizer.json is the one `sample` reads
    self.vocab = self.template.vocab
    check_vocab(spec, args, self.vocab)
    everything = self.train_on == "all"
    convs = [render(spec, self.template, self.path, n, check_messages(
        spec, self.path, n, line.get("messages"), SHAPE), everything)
             for n, line in json_lines(spec, self.path, SHAPE)]
    total = len(convs)
    c0, c1 = int(np.floor(split[0] * total)), int(np.floor(split[1] * total))
    self.conversations = c1 - c0
    if self.conversations == 0:
      raise load_error("E-LOAD-002", spec, self.path, f"the split {list(split)} holds no "
                       f"conversation of the file's {total}",
                       "widen :split, or add conversations to the file")
    kept = convs[c0:c1]
    lengths = np.array([len(ids) for ids, _ in kept], np.int64)
    self._ids = np.concatenate([ids for ids, _ in kept]).astype(_I32)
    self._mask = np.concatenate([m for _, m in kept]).astype(_I32)
    self.tokens = int(lengths.sum())
    self.masked = int(self._mask.sum())
    self._rows = first_fit(lengths, self.seq)
    self.records = len(self._rows[0]) - 1
    if self.records < self.batch_size:
      raise load_error("E-LOAD-002", spec, self.path,
                       f"{self.records} rows of {self.seq} tokens is fewer than one microbatch "
                       f"of {self.batch_size}", "add conversations, or lower :seq or :batch")
    self.order = Order(TAG_CHAT, self.records, shuffle, ctx.seed, own_seed, stream)
    shape = (self.batch_size, self.seq)
    self.fields = {"tokens": (shape, _I32), "segments": (shape, _I32),
                   "positions": (shape, _I32), "mask": (shape, _I32)}

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch of rows, a pure function of (file, tokenizer, args, seed, i)."""
    rows = self.order.indices(i * self.batch_size, self.batch_size)
    out = {k: np.zeros((self.batch_size, self.seq), _I32) for k in self.fields}
    out["tokens"].fill(self.template.pad_id)
    ptr, starts, lens = self._rows
    for j, r in enumerate(rows):
      at = 0
      for seg, q in enumerate(range(ptr[r], ptr[r + 1]), start=1):
        a, n = int(starts[q]), int(lens[q])
        out["tokens"][j, at:at + n] = self._ids[a:a + n]
        out["mask"][j, at:at + n] = self._mask[a:a + n]
        out["segments"][j, at:at + n] = seg
        out["positions"][j, at:at + n] = np.arange(n)
        at += n
    return out

  def count_tokens(self, batch: dict[str, np.ndarray]) -> int:
    """The non-padding tokens of a batch (what `counter tokens` counts)."""
    return int(np.count_nonzero(batch["segments"]))

  def describe(self) -> dict[str, Any]:
    """Kind, field types, rows, the file, its conversations, tokens and trained tokens."""
    pad = 1.0 - self.tokens / (self.records * self.seq)
    return {**super().describe(), "file": self.path, "conversations": self.conversations,
            "tokens": self.tokens, "vocab": self.vocab, "template": self.template.source,
            "summary": f"{self.conversations} conversations, {self.tokens} tokens "
                       f"({self.masked} trained, :train-on {self.train_on}), vocabulary "
                       f"{self.vocab}, padding {100 * pad:.1f}%, template "
                       f"{os.path.basename(self.template.source)}"}


def resolve(spec: LoaderSpec, value: Any, usage: str, key: str) -> str:
  """A file argument as a path: relative ones are the .sx file's.

  Raises:
    SxError: E-FORM-001 when it is no non-empty string.
  """
  if not isinstance(value, str) or not value:
    raise form_error(spec, f"{'the file' if key == 'path' else ':' + key} is {value!r}, "
                     "expected a path", usage)
  return value if os.path.isabs(value) else os.path.join(spec.base_dir, value)


def open_template(spec: LoaderSpec, args: dict[str, Any]) -> chattemplate.ChatTemplate:
  """The `:tokenizer` and its chat template."""
  path = resolve(spec, args["tokenizer"], f'write :tokenizer "tok/tokenizer.json" on the '
                 f'{spec.kind} loader (a tokenizer_config.json beside it gives the template)',
                 "tokenizer")
  return chattemplate.ChatTemplate(path, spec)


def check_vocab(spec: LoaderSpec, args: dict[str, Any], vocab: int) -> None:
  """Refuses a tokenizer larger than `:vocab` (when written).

  Raises:
    SxError: E-LOAD-003 naming both sizes.
  """
  if args["vocab"] and args["vocab"] < vocab:
    raise load_error("E-LOAD-003", spec, str(args["tokenizer"]),
                     f"the tokenizer has {vocab} tokens, more than :vocab {args['vocab']}",
                     f"raise :vocab (and the model's) to at least {vocab}")


CHAT = LoaderDef(
    "chat", "conversations, one JSON line each ({\"messages\": [{\"role\", \"content\"}, ...]}), "
    "rendered with the :tokenizer's chat template as transformers' apply_chat_template renders "
    "it (ChatML when its tokenizer_config.json has none), packed whole into rows (:tokens "
    ":segments :positions) with :mask 1 on the assistant's tokens (its end-of-turn marker "
    "included)",
    (key("path"), key("tokenizer", required=True), key("seq", required=True),
     key("batch", required=True), key("train-on", default="assistant", choices=TRAIN_ON),
     key("split"), key("shuffle"), key("stream"), key("seed"), key("vocab", default=0, lo=0)),
    ChatLoader)

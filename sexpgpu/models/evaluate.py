"""Downstream evaluation: tasks in lm-evaluation-harness's shapes, scored by log-likelihood.

A task is a `.jsonl` file, one document a line, all of one kind:

- multiple choice, `{"context": str, "choices": [str, ...], "gold": int}`: each choice is
  scored by the log-likelihood of " " + choice after the context, as the harness scores
  its `multiple_choice` tasks (the target delimiter " ", trailing spaces of the context
  moved to the continuation, the continuation's tokens those of context + continuation
  past the context's own); `acc` is whether the best choice is the gold one, `acc_norm`
  the same with each log-likelihood divided by its choice's length (the harness's
  `len(choice)`).
- text, `{"text": str}`: every token's log-likelihood, the first after the tokenizer's
  end-of-document token, in windows of the model's length (the harness's rolling
  log-likelihood); `bits_per_byte` is minus their sum over ln 2 and the texts' UTF-8 bytes.

Requests are packed into rows of the model's window, each its own segment with positions
from 0, when the model's function takes `:segments` and `:positions` (so no request
attends to another); otherwise a row holds one request. A request longer than the window
is skipped, and so is the document it belongs to: both are counted and named.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from sexpgpu import bounded
from sexpgpu.errors import Loc, SxError

DELIMITER = " "  # the harness's default target_delimiter


@dataclasses.dataclass(frozen=True)
class Doc:
  line: int
  context: str = ""
  choices: tuple[str, ...] = ()
  gold: int = -1
  text: str = ""


@dataclasses.dataclass(frozen=True)
class Task:
  """One task file: its name (the file's stem), kind ("choice" or "text") and documents."""

  name: str
  path: str
  kind: str
  docs: tuple[Doc, ...]


def _bad(path: str, line: int, what: str, fix: str) -> SxError:
  return SxError("E-EVAL-001", f"{path}:{line}: {what}", location=Loc(path, line, 1), fix=fix)


_SHAPES = ('a multiple-choice line is {"context": "The sky is", "choices": ["blue", "green"],'
           ' "gold": 0}; a text line is {"text": "..."}')


# A task file is read line by line within these bounds (lm-evaluation-harness's largest
# tasks are tens of MiB; a book-length text document is a few MiB).
TASK_BYTES = bounded.GiB
LINE_BYTES = 16 * bounded.MiB


def load_task(path: str, limit: int | None = None) -> Task:
  """The task in the `.jsonl` file `path` (its first `limit` documents, if given).

  The file is read through `sexpgpu.bounded`: a regular UTF-8 file of at most TASK_BYTES,
  each line at most LINE_BYTES, each document JSON nested at most `bounded.DEPTH` levels;
  reading stops after `limit` documents.

  Raises:
    SxError: E-EVAL-001 naming the file (and the line) of a file that cannot be read, is
      not a regular file or passes a bound, or of the first document that is not JSON, not
      one of the two shapes, or of another kind than the first; or an empty file.
  """
  lines = bounded.read_lines(path, limit=TASK_BYTES, line_limit=LINE_BYTES, what="task file",
                             code="E-EVAL-001", where=path, fix="give a .jsonl file of at "
                             f"most {bounded.size_text(TASK_BYTES)}, one document a line of "
                             f"at most {bounded.size_text(LINE_BYTES)}")
  docs, kind = [], None
  for n, raw in lines:
    if limit is not None and len(docs) >= limit:
      break
    if not raw.strip():
      continue
    doc, k = _doc(path, n, _json_line(path, n, raw))
    if kind is not None and k != kind:
      raise _bad(path, n, f"a {k} document in a task whose first document is {kind}",
                 "keep multiple-choice and text documents in two task files")
    kind = k
    docs.append(doc)
  if not docs:
    raise SxError("E-EVAL-001", f"the task file {path} holds no document", where=path,
                  fix=_SHAPES)
  name = os.path.splitext(os.path.basename(path))[0]
  return Task(name, path, kind, tuple(docs))


def _json_line(path: str, n: int, raw: str) -> Any:
  """One line's JSON value, nested at most `bounded.DEPTH` levels (json.loads recurses: a
  line of 100,000 `[` is a RecursionError, caught here)."""
  try:
    obj = json.loads(raw)
  except RecursionError:
    obj = None
  except ValueError as e:  # a JSONDecodeError, or an integer past 4,300 digits
    why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
    raise _bad(path, n, f"not JSON ({why})", _SHAPES) from None
  else:
    if bounded.json_depth(obj) <= bounded.DEPTH:
      return obj
  raise _bad(path, n, f"JSON nested deeper than {bounded.DEPTH} levels (a document is an "
             "object of strings, a list of strings and a number)", '{"context": "...", '
             '"choices": ["...", "..."], "gold": 0}, nested two levels')


def _doc(path: str, n: int, obj: Any) -> tuple[Doc, str]:
  if not isinstance(obj, dict):
    raise _bad(path, n, f"a JSON {type(obj).__name__}, not an object", _SHAPES)
  if "text" in obj and not {"context", "choices", "gold"} & obj.keys():
    if not isinstance(obj["text"], str) or not obj["text"]:
      raise _bad(path, n, '"text" must be a non-empty string', _SHAPES)
    return Doc(n, text=obj["text"]), "text"
  missing = [k for k in ("context", "choices", "gold") if k not in obj]
  if missing:
    found = ", ".join(repr(k)[:40] for k in list(obj)[:8]) + (", ..." if len(obj) > 8 else "")
    raise _bad(path, n, f"no {', '.join(repr(k) for k in missing)} (found "
               f"{found or 'nothing'})", _SHAPES)
  context, choices, gold = obj["context"], obj["choices"], obj["gold"]
  if not isinstance(context, str):
    raise _bad(path, n, '"context" must be a string', _SHAPES)
  if (not isinstance(choices, list) or len(choices) < 2
      or not all(isinstance(c, str) and c for c in choices)):
    raise _bad(path, n, '"choices" must be a list of two or more non-empty strings', _SHAPES)
  if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
    raise _bad(path, n, f'"gold" must be the index of a choice, 0..{len(choices) - 1}; found '
               f"{json.dumps(gold)[:40]}", '"gold": 0 for the first choice')
  return Doc(n, context=context, choices=tuple(choices), gold=gold), "choice"


# --- requests ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Request:
  """One scored sequence: the model reads `tokens[:-1]` and the last `scored` of
  `tokens[1:]` count. `doc` and `choice` say whose it is (choice -1 for a text's window)."""

  doc: int
  choice: int
  tokens: tuple[int, ...]
  scored: int


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """The harness's split of a context and its continuation into tokens."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole = tok.encode(context + continuation).ids
  ctx = tok.encode(context).ids
  return ctx, whole[len(ctx):]


def requests(task: Task, tok, prefix: int, window: int) -> tuple[list[Request], list[int]]:
  """The task's requests that fit `window` positions, and the lines of the documents left
  out because one of theirs does not."""
  out, skipped = [], []
  for i, d in enumerate(task.docs):
    if task.kind == "choice":
      mine = []
      for j, choice in enumerate(d.choices):
        if d.context:
          ctx, cont = encode_pair(tok, d.context, DELIMITER + choice)
        else:  # an empty context: the continuation after the prefix token, as the harness
          ctx, cont = [prefix], tok.encode(DELIMITER + choice).ids
        mine.append(Request(i, j, tuple(ctx + cont), len(cont)))
      if any(len(r.tokens) - 1 > window or r.scored == 0 for r in mine):
        skipped.append(d.line)
        continue
      out += mine
    else:
      ids = tok.encode(d.text).ids
      if not ids:
        skipped.append(d.line)
        continue
      out += [Request(i, -1, w, n) for w, n in rolling_windows(ids, prefix, window)]
  return out, skipped


def rolling_windows(ids: list[int], prefix: int, window: int):
  """The harness's rolling windows over `ids` (its `get_rolling_token_windows` with a
  context of one): each yields (tokens, scored), the predictions disjoint and in order,
  each window reading as many tokens before its predictions as fit."""
  seq = [prefix] + list(ids)
  done = 0
  while done < len(ids):
    n = min(window, len(ids) - done)
    end = done + n  # predicts ids[done:end], i.e. seq[done+1:end+1]
    start = max(0, end - window)
    yield tuple(seq[start:end + 1]), n
    done = end


# --- rows ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Rows:
  """Requests laid out in rows of W: the model's inputs, the targets, and where each
  request's scored targets lie (row, first column, end column)."""

  tokens: np.ndarray
  segments: np.ndarray
  positions: np.ndarray
  targets: np.ndarray
  spans: list[tuple[int, int, int]]


def layout(reqs: list[Request], window: int, packed: bool) -> Rows:
  """Rows of `window` positions: packed first-fit by length, longest first, or one request
  a row. Padding reads token 0 in segment 0, which no request's segment attends to."""
  order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i].tokens))
  fill: list[int] = []  # the positions used in each row
  where = [None] * len(reqs)
  for i in order:
    n = len(reqs[i].tokens) - 1
    row = next((r for r, used in enumerate(fill) if packed and used + n <= window), None)
    if row is None:
      fill.append(0)
      row = len(fill) - 1
    where[i] = (row, fill[row])
    fill[row] += n
  shape = (max(len(fill), 1), window)
  rows = Rows(*(np.zeros(shape, np.int32) for _ in range(4)), spans=[])
  segment = [0] * len(fill)
  for i, r in enumerate(reqs):
    row, at = where[i]
    n = len(r.tokens) - 1
    segment[row] += 1
    rows.tokens[row, at:at + n] = r.tokens[:-1]
    rows.targets[row, at:at + n] = r.tokens[1:]
    rows.segments[row, at:at + n] = segment[row]
    rows.positions[row, at:at + n] = np.arange(n)
    rows.spans.append((row, at + n - r.scored, at + n))
  return rows


# --- scoring -------------------------------------------------------------------------------
@dataclasses.dataclass
class Scored:
  """A task's scores.

  Attributes:
    task: the task's name; kind: "choice" or "text".
    metrics: {"acc", "acc_norm"} or {"bits_per_byte"}.
    loglikelihoods: choice tasks: per document scored, per choice, the summed
      log-likelihood; text tasks: per document scored, its total.
    greedy: choice tasks: per document, per choice, whether every continuation token is
      the model's most likely one.
    docs: the documents scored (their index in the task); skipped: the lines left out.
    requests: the requests scored; rows: the rows they took.
  """

  task: str
  kind: str
  metrics: dict[str, float]
  loglikelihoods: list
  greedy: list
  docs: list[int]
  skipped: list[int]
  requests: int
  rows: int


class Scorer:
  """Scores tasks with the model `fn` of a compiled experiment: one compiled call of
  `batch` rows of its window, reused for every task and every evaluation."""

  def __init__(self, c, fn: str, tok, *, batch: int = 8, packed: bool | None = None,
               window: int | None = None, prefix: int | None = None):
    """Args:
      c: the Compiled experiment; fn: its function of tokens [b t] → logits [b t vocab].
      tok: a `tokenizers.Tokenizer`.
      batch: rows a call; packed: pack requests (default: when fn takes :segments and
        :positions); window: positions a row (default: the longest fn builds on).
      prefix: the token a text starts after (default: the tokenizer's end of document).

    Raises:
      SxError: E-SAMPLE-001 when fn does not map tokens to logits; E-EVAL-002 when packing
        is asked of a function without :segments and :positions, or the tokenizer has no
        end-of-document token and no prefix is given.
    """
    from sexpgpu.models import sample, source
    self.c, self.fn, self.tok, self.batch = c, fn, tok, batch
    takes = source.takes_segments(c, fn)
    if packed and not takes:
      raise SxError("E-EVAL-002", f"`{fn}` takes no :segments and :positions, so requests "
                    "cannot share a row without seeing each other", where=f"--fn {fn}",
                    fix=f"(defn {fn} [tokens :segments nil :positions nil] ...) passing both"
                    " to the model, or score one request a row")
    self.packed = takes if packed is None else packed
    self.window = window or sample.window(c, fn)
    self.prefix = prefix if prefix is not None else end_of_document(tok)
    self._call = None
    self._prepared: dict[str, tuple] = {}
    self.vocab = 0  # the logits' last size, known once the call is built

  def _compiled(self):
    if self._call is None:
      import jax
      import jax.numpy as jnp
      from sexpgpu.ir.ops import LowerCtx
      from sexpgpu.lower.interp import run_graph
      from sexpgpu.models import source
      graph = source.logits_graph(self.c, self.fn, self.window, self.batch,
                                  packed=self.packed)
      self.vocab = graph.outputs["out"].shape[-1]
      check_memory(self.batch, self.window, self.vocab)
      from sexpgpu.lower.fp8 import patterns
      ctx = LowerCtx(str(self.c.exp.run["precision"]), None, False, [], None,
                     fp8_only=patterns(self.c.exp.run))
      packed = self.packed

      def f(params, tokens, segments, positions, targets):
        feeds = {"tokens": tokens}
        if packed:
          feeds.update(segments=segments, positions=positions)
        logits = run_graph(graph, params, feeds, ctx)["out"].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        return picked, jnp.argmax(logits, -1) == targets

      self._call = jax.jit(f)
    return self._call

  def prepare(self, task: Task) -> tuple[list[Request], list[int], Rows]:
    """The task's requests, the lines of the documents skipped, and their rows (kept, so a
    task scored again is not tokenized again).

    Raises:
      SxError: E-EVAL-003 when no document of the task fits the window, or the tokenizer
        writes ids the model has no logits for.
    """
    if task.path in self._prepared:
      return self._prepared[task.path]
    reqs, skipped = requests(task, self.tok, self.prefix, self.window)
    if not reqs:
      raise SxError("E-EVAL-003", f"no document of {task.path} fits the model's window of "
                    f"{self.window} tokens", where=task.path,
                    fix="shorten the task's documents, or evaluate a model with a longer "
                    "window")
    self._compiled()
    top = max(max(r.tokens) for r in reqs)
    if top >= self.vocab:
      raise SxError("E-EVAL-003", f"the tokenizer writes id {top} in {task.path}, past the "
                    f"model's vocabulary of {self.vocab}", where=task.path,
                    fix="evaluate with the tokenizer the model was trained with (:tokenizer)")
    self._prepared[task.path] = reqs, skipped, layout(reqs, self.window, self.packed)
    return self._prepared[task.path]

  def score(self, params: dict, task: Task, host=np.asarray) -> Scored:
    """The task's scores under `params` (path → array, host or device); `host` copies a
    result to numpy (a multi-process run's own shard).

    Raises:
      SxError: as `prepare`.
    """
    reqs, skipped, rows = self.prepare(task)
    call = self._compiled()
    logp = np.zeros(rows.tokens.shape, np.float64)
    best = np.zeros(rows.tokens.shape, bool)
    from sexpgpu.models.forward import device_params
    p = device_params(self.c, params)
    for at in range(0, rows.tokens.shape[0], self.batch):
      part = [_rows_slice(a, at, self.batch) for a in
              (rows.tokens, rows.segments, rows.positions, rows.targets)]
      got, hit = call(p, *part)
      n = min(self.batch, rows.tokens.shape[0] - at)
      logp[at:at + n] = host(got)[:n]
      best[at:at + n] = host(hit)[:n]
    per = [(float(logp[r, a:b].sum()), bool(best[r, a:b].all())) for r, a, b in rows.spans]
    return _metrics(task, reqs, per, skipped, rows.tokens.shape[0])


# The most rows one call scores (`sexpgpu eval --batch`): past it a call is no faster on any
# card, and `check_memory` still holds a smaller batch to the device's memory.
MAX_BATCH = 4096


def call_bytes(batch: int, window: int, vocab: int) -> int:
  """About what one scoring call holds: its logits, their log-softmax and the comparison
  with the targets (f32 each, the rest small), and its four int32 input rows on the host."""
  return batch * window * (3 * 4 * vocab + 4 * 4 + 4 + 1)


def check_memory(batch: int, window: int, vocab: int) -> None:
  """Refuses a batch whose call does not fit the device's free memory, before anything of
  that size is allocated (a device that reports no memory is not checked).

  Raises:
    SxError: E-MEM-001 naming the batch, what it needs, what is free and the batch that fits.
  """
  import jax
  from sexpgpu import env
  from sexpgpu.devices.memory import free_bytes_of, human
  need = call_bytes(batch, window, vocab)
  try:
    free = free_bytes_of(jax.devices()[0], env.get("SEXPGPU_MEMORY"))
  except SxError as e:
    if e.code != "E-MEM-002":
      raise
    return  # a GPU without statistics: the call's own allocation says whether it fits
  if need <= free:
    return
  fits = free // call_bytes(1, window, vocab)
  raise SxError("E-MEM-001", f"a scoring call of {batch} rows of {window} positions and "
                f"{vocab} logits needs about {human(need)}; {human(free)} is free",
                where=f"the evaluation's batch ({batch} rows a call)",
                fix=f"lower --batch (or defeval :batch) to at most {max(fits, 1)} rows"
                if fits else "evaluate on a device with more memory: one row does not fit")


def _rows_slice(a: np.ndarray, at: int, batch: int) -> np.ndarray:
  part = a[at:at + batch]
  if part.shape[0] < batch:  # the last call's rows padded with empty ones
    part = np.concatenate([part, np.zeros((batch - part.shape[0],) + a.shape[1:], a.dtype)])
  return part


def _metrics(task: Task, reqs: list[Request], per, skipped: list[int], rows: int) -> Scored:
  if task.kind == "choice":
    by_doc: dict[int, list] = {}
    for r, (ll, g) in zip(reqs, per):
      by_doc.setdefault(r.doc, [None] * len(task.docs[r.doc].choices))[r.choice] = (ll, g)
    docs = sorted(by_doc)
    lls = [[ll for ll, _ in by_doc[i]] for i in docs]
    greedy = [[g for _, g in by_doc[i]] for i in docs]
    acc, norm = [], []
    for i, ll in zip(docs, lls):
      d = task.docs[i]
      lengths = np.array([float(len(c)) for c in d.choices])
      acc.append(float(np.argmax(ll) == d.gold))
      norm.append(float(np.argmax(np.array(ll) / lengths) == d.gold))
    metrics = {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(norm))}
    return Scored(task.name, task.kind, metrics, lls, greedy, docs, skipped, len(reqs), rows)
  totals: dict[int, float] = {}
  for r, (ll, _) in zip(reqs, per):
    totals[r.doc] = totals.get(r.doc, 0.0) + ll
  docs = sorted(totals)
  nbytes = sum(len(task.docs[i].text.encode("utf-8")) for i in docs)
  bpb = -sum(totals[i] for i in docs) / (nbytes * math.log(2))
  return Scored(task.name, task.kind, {"bits_per_byte": bpb}, [totals[i] for i in docs], [],
                docs, skipped, len(reqs), rows)


def end_of_document(tok) -> int:
  """The tokenizer's end-of-document token (the one `sexpgpu tokenize` puts between
  documents, or a GPT-2 or Llama tokenizer's own).

  Raises:
    SxError: E-EVAL-002 when it has none of the usual ones.
  """
  for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<s>", "<|begin_of_text|>"):
    i = tok.token_to_id(name)
    if i is not None:
      return i
  raise SxError("E-EVAL-002", "the tokenizer has no end-of-document token (<|endoftext|>, "
                "</s>, ...) for a text to start after", where="the tokenizer",
                fix="train it with sexpgpu tokenize --train-bpe, which adds <|endoftext|>")

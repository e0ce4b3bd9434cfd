"""Decoding a function from tokens to logits: the window recomputed for every new token.

The model is written once, for training; decoding calls its graph, built for a window of W
positions, on the last W tokens and reads the logits of the newest one. Padding the window
past the newest token changes nothing for a causal model, so the whole continuation is one
compiled `lax.fori_loop`, with the same numbers on every run for a seed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu import bounded, env
from sexpgpu.errors import SxError
from sexpgpu.models import forward, source


@dataclasses.dataclass(frozen=True)
class Settings:
  """How to choose each next token: temperature 0 is greedy; top-k 0 and top-p 1 keep all."""

  tokens: int = 200
  temperature: float = 0.8
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0


# The most tokens one call writes: several times the longest window of the models sexpgpu
# builds (the continuation's buffer and the decode loop are sized by it, and a recomputed
# window costs a full forward a token).
MAX_TOKENS = 65_536
# The smallest temperature above 0 (greedy): below it the scaled logits pass f32's range.
MIN_TEMPERATURE = 1e-4
# What each setting takes: (field, low, high, the range in words, why); temperature 0
# (greedy) too. jax.lax.top_k takes an int32 k; a seed is 32 bits (2**32 draws as 0 does).
RANGES = (
    ("tokens", 1, MAX_TOKENS, f"1 to {MAX_TOKENS}",
     "the most one call writes; continue from its output for more"),
    ("temperature", MIN_TEMPERATURE, 100.0, f"0, or {MIN_TEMPERATURE:g} to 100",
     "0 is greedy; a smaller one scales the logits past f32"),
    ("top_k", 0, 2**31 - 1, f"0 to {2**31 - 1}", "0 keeps every token, as a k past the "
     "vocabulary does"),
    ("top_p", math.ulp(0.0), 1.0, "more than 0, at most 1",
     "the probability mass kept; 1 keeps every token"),
    ("seed", 0, 2**32 - 1, f"0 to {2**32 - 1}", "a 32-bit seed"),
)


def check_settings(s: Settings, name=lambda field: "--" + field.replace("_", "-")) -> None:
  """Refuses settings outside RANGES, before anything is compiled.

  Args:
    s: the settings.
    name: how the caller spells a field (a flag by default: `--top-k`).

  Raises:
    SxError: E-FORM-001 naming the setting, its value and its range.
  """
  for field, low, high, span, why in RANGES:
    value = getattr(s, field)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and (low <= value <= high or (field == "temperature" and value == 0)):
      continue  # a NaN is in no range
    shown = f"{value:g}" if isinstance(value, float) else str(value)[:40]
    raise SxError("E-FORM-001", f"{name(field)} is {shown}; it takes {span}",
                  where=name(field), fix=f"give {name(field)} {span} ({why})")


@dataclasses.dataclass
class Result:
  """A continuation: its token ids, and how fast they came."""

  ids: list[int]
  seconds: float
  path: str  # "incremental" (a KV cache) or "recompute" (the window every token)
  reason: str  # why recompute, or "" 

  @property
  def tokens_per_s(self) -> float:
    return len(self.ids) / max(self.seconds, 1e-9)


def window(c, fn: str) -> int:
  """The longest token window `fn` builds on: a gpt2's n_positions or a llama's
  max_position_embeddings, else the loss's length (a learned position table of the training
  length), else one less."""
  from sexpgpu.models.twin import find
  try:
    return find(c.params, c.stages[0].graph, "sample").positions
  except SxError:
    pass
  lengths = source.token_lengths(c)
  for t in lengths:
    try:
      source.logits_graph(c, fn, t)
      return t
    except SxError:
      continue
  raise SxError("E-SAMPLE-001", f"`({fn} tokens)` builds on no window of the loaders' "
                f"lengths {lengths}", where=f"--fn {fn}")


def choose(logits, key, s: Settings):
  """The next token from logits [vocab] (f32) under the settings."""
  if s.temperature <= 0:
    return jnp.argmax(logits).astype(jnp.int32)
  logits = logits / s.temperature
  if s.top_k and s.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, s.top_k)[0][-1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if s.top_p < 1.0:
    order = jnp.argsort(-logits)
    probs = jax.nn.softmax(logits[order])
    before = jnp.cumsum(probs) - probs  # the mass of the more likely tokens
    # the first token always stays, even for a top-p that f32 rounds to 0
    drop_sorted = (before >= s.top_p).at[0].set(False)
    drop = jnp.zeros_like(drop_sorted).at[order].set(drop_sorted)
    logits = jnp.where(drop, -jnp.inf, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def recompute_decoder(f, w: int, s: Settings):
  """A jitted `ids = decode(params, buf, n_prompt)`: `s.tokens` new tokens, each from one
  full forward `f` of the last `w` tokens."""

  def decode(params, buf, n):
    key = jax.random.key(s.seed)

    def body(i, carry):
      buf, n, out = carry
      logits = f(params, buf[None, :])[0]
      nxt = choose(logits[jnp.minimum(n, w) - 1], jax.random.fold_in(key, i), s)
      full = n >= w
      shifted = jnp.where(full, jnp.roll(buf, -1), buf)
      buf = shifted.at[jnp.where(full, w - 1, n)].set(nxt)
      return buf, n + 1, out.at[i].set(nxt)

    out = jnp.zeros((s.tokens,), jnp.int32)
    return jax.lax.fori_loop(0, s.tokens, body, (buf, n, out))[2]

  return jax.jit(decode)


def incremental_decoder(pl, ctx, s: Settings):
  """A jitted `ids = decode(params, buf, n_prompt)` from the compiler-derived plan: the
  prompt (padded to `buf`'s length) prefilled into an empty cache, then one step a token,
  each reading and extending the cache."""
  from sexpgpu.models import decode as dec

  def run(params, buf, n):
    key = jax.random.key(s.seed)
    empty = dec.empty_cache(pl, params, ctx)
    logits, cache = dec.run(pl, params, buf[None, :], ctx, empty, jnp.int32(0), n)
    first = choose(logits[0, n - 1].astype(jnp.float32), jax.random.fold_in(key, 0), s)
    out = jnp.zeros((s.tokens,), jnp.int32).at[0].set(first)

    def body(i, carry):
      out, cache = carry
      token = out[i - 1].reshape(1, 1)
      logits, cache = dec.run(pl, params, token, ctx, cache, n + i - 1)
      nxt = choose(logits[0, 0].astype(jnp.float32), jax.random.fold_in(key, i), s)
      return out.at[i].set(nxt), cache

    return jax.lax.fori_loop(1, s.tokens, body, (out, cache))[0]

  return jax.jit(run)


# A cache spans the prompt and continuation rounded up to this many positions (at most the
# window): attention reads the cache's whole length at every step, so a cache of the whole
# window would cost a short continuation as much as the longest one.
SPAN_STEP = 64
# The prefill computes the prompt rounded up to this many positions (at most the cache's).
PREFILL_STEP = 16


def choose_path(c, fn: str, w: int, n_prompt: int, s: Settings, path: str | None = None):
  """("incremental", plan, "") when the compiler derives a decode step for `fn` and the
  continuation fits what bounds it (a plan of carries alone decodes any length), else
  ("recompute", None, why). The plan's window is the span the cache needs, not always the
  model's. `path` "recompute" slides the window past a table or an attention window.

  Raises:
    SxError: E-SAMPLE-002 when the continuation passes a position table or an attention
      window and `path` does not ask for recompute.
  """
  from sexpgpu.models import decode as dec
  if env.parse_choice("SEXPGPU_DECODE", env.get("SEXPGPU_DECODE"), ("recompute",)):
    return "recompute", None, "SEXPGPU_DECODE=recompute"
  need = n_prompt + s.tokens - 1
  span = min(w, -(-need // SPAN_STEP) * SPAN_STEP)
  try:
    try:
      graph = source.logits_graph(c, fn, span)
    except SxError:  # a model that builds on its own lengths only
      span, graph = w, source.logits_graph(c, fn, w)
    pl = dec.plan(graph, span)
  except dec.NoRule as e:
    return "recompute", None, f"{e.describe()} has no incremental rule"
  bounds = dec.limits(pl) if need > span else []
  if not bounds or need <= bounds[0][0]:  # it fits, or carries and computed positions only
    return "incremental", pl, ""
  if path == "recompute":
    return "recompute", None, (f"the prompt and continuation ({n_prompt} + {s.tokens}) pass "
                               f"the window of {w} positions, which a cache cannot slide")
  most = bounds[0][0]
  room = most - n_prompt + 1
  what = "; ".join(b[1] for b in bounds)
  raise SxError("E-SAMPLE-002", f"`{fn}` decodes at most {most} positions: {what}; the "
                f"prompt of {n_prompt} tokens and {s.tokens} new ones would need {need}",
                where="--tokens", fix=f"ask for at most {room} tokens after this prompt "
                f"(--tokens {room}), or pass --window recompute to slide the window, each "
                f"new token recomputed from the last {w} without what came before")


def check_prompt(c, fn: str, prompt: list[int], where: str = "--prompt") -> list[int]:
  """The prompt, its last window's worth, after checking it against the model's vocabulary.

  Raises:
    SxError: E-FORM-001 for an empty prompt or a token outside the vocabulary.
  """
  w = window(c, fn)
  vocab = source.logits_graph(c, fn, w).outputs["out"].shape[-1]
  if not prompt:
    raise SxError("E-FORM-001", "the prompt is empty", where=where,
                  fix='give at least one token: --prompt "text" (or ids: --prompt "3 1 4")')
  bad = [t for t in prompt if not 0 <= t < vocab]
  if bad:
    raise SxError("E-FORM-001", f"prompt tokens {bad[:8]} are outside the model's "
                  f"vocabulary of {vocab}", where=where,
                  fix=f"give ids in 0..{vocab - 1}, or text with its tokenizer")
  return prompt[-w:]


@dataclasses.dataclass
class Decoder:
  """A jitted `ids = decode(params, buf, n_prompt)` for prompts up to a length: `buf` holds
  the prompt in `window` positions (the model's window when recomputing, the prefill's
  length with a cache); one compilation serves every call."""

  window: int
  path: str
  reason: str
  decode: Any

  def args(self, c, params: dict, prompt: list[int]) -> tuple:
    buf = np.zeros((self.window,), np.int32)
    buf[:len(prompt)] = prompt
    return forward.device_params(c, params), jnp.asarray(buf), jnp.int32(len(prompt))


def decoder(c, fn: str, longest_prompt: int, s: Settings, path: str | None = None) -> Decoder:
  """The decoder of `fn` for prompts of up to `longest_prompt` tokens: incremental when the
  compiler derives a decode step (and `path` does not ask for recompute)."""
  w = window(c, fn)
  chosen, pl, why = choose_path(c, fn, w, longest_prompt, s, path)
  if path == "recompute" and chosen == "incremental":
    chosen, pl, why = "recompute", None, "asked for"
  if chosen == "incremental":
    from sexpgpu.ir.ops import LowerCtx
    from sexpgpu.lower.fp8 import patterns
    ctx = LowerCtx(str(c.exp.run["precision"]), None, False, [], None,
                   fp8_only=patterns(c.exp.run))
    prefill = min(pl.window, -(-longest_prompt // PREFILL_STEP) * PREFILL_STEP)
    return Decoder(prefill, chosen, why, incremental_decoder(pl, ctx, s))
  return Decoder(w, chosen, why, recompute_decoder(forward.forward(c, fn, w), w, s))


def generate(c, fn: str, params: dict, prompt: list[int], s: Settings,
             path: str | None = None) -> Result:
  """`s.tokens` tokens after `prompt` from the model `fn` of experiment `c`; `path`
  "recompute" recomputes the window for every token (and slides it past its end).

  Raises:
    SxError: E-FORM-001 for an empty prompt or a token outside the vocabulary; E-SAMPLE-002
      for a continuation past a position table or attention window (without recompute).
  """
  prompt = check_prompt(c, fn, prompt)
  d = decoder(c, fn, len(prompt), s, path)
  args = d.args(c, params, prompt)
  compiled = d.decode.lower(*args).compile()  # tokens/s without compiling
  t0 = time.perf_counter()
  ids = np.asarray(compiled(*args))
  seconds = time.perf_counter() - t0
  return Result([int(i) for i in ids], seconds, d.path, d.reason)


def tokenizer_path(c) -> str | None:
  """The tokenizer.json of a text loader's local token cache, or None."""
  for ld in c.loaders.values():
    folder = getattr(ld, "folder", None)  # relative paths resolved against the .sx file
    if isinstance(folder, str) and os.path.isfile(os.path.join(folder, "tokenizer.json")):
      return os.path.join(folder, "tokenizer.json")
  return None


def tokenizer_of(c, given: str | None):
  """The tokenizer (a `tokenizers.Tokenizer`) from --tokenizer or a text loader's local
  cache (or the one it made of a text file's characters), UTF-8 bytes for a model on a
  `bytes` loader, or None: then prompts and continuations are token ids."""
  from tokenizers import Tokenizer
  path = given if given is not None else tokenizer_path(c)
  if path is None:  # a text loader reading a text file by characters made its own
    made = [ld.tokenizer_json for ld in c.loaders.values()
            if isinstance(getattr(ld, "tokenizer_json", None), str)]
    if made:
      return Tokenizer.from_str(made[0])
    if any(ld.kind == "bytes" for ld in c.loaders.values()):  # a file's bytes: UTF-8
      from sexpgpu.data.textcache import byte_tokenizer
      return byte_tokenizer()
    return None
  text = bounded.read_text(path, limit=TOKENIZER_BYTES, what="tokenizer", code="E-TOK-002",
                           where="--tokenizer", fix="pass a tokenizer.json file (a Llama 3 "
                           "one is 9 MiB)")
  try:
    return Tokenizer.from_str(text)
  except Exception as e:  # pylint: disable=broad-except
    raise SxError("E-TOK-002", f"--tokenizer {path}: not a tokenizer.json ({e})",
                  where="--tokenizer", fix="pass the tokenizer.json file") from e


def echoed(tok, prompt: list[int], ids: list[int]) -> str:
  """The prompt and its continuation as `sample` prints them: decoded together (a
  tokenizer's decoder may join tokens differently at the seam than each part alone), or
  the ids separated by spaces when there is no tokenizer."""
  both = list(prompt) + list(ids)
  return tok.decode(both) if tok is not None else " ".join(map(str, both))


def encode_prompt(tok, text: str) -> list[int]:
  """A text prompt's ids.

  Raises:
    SxError: E-FORM-001 when the tokenizer has no token for a character of the prompt
      (a character-level tokenizer drops it, which would sample from another prompt).
  """
  from sexpgpu.data.textcache import char_unknown
  missing = char_unknown(tok, text)
  if missing:
    raise SxError("E-FORM-001", f"the tokenizer has no token for {len(missing)} character"
                  f"{'s' if len(missing) != 1 else ''} of the prompt: "
                  + " ".join(repr(ch) for ch in missing[:16]), where="--prompt",
                  fix="write the prompt in the characters the model was trained on (a "
                  "character-level tokenizer knows only its text's characters)")
  return tok.encode(text).ids


# The largest tokenizer.json read (GPT-2's is 1.4 MiB, Llama 3's 9 MiB).
TOKENIZER_BYTES = 64 * bounded.MiB
# The largest prompt file read: far more text than any window holds.
PROMPT_BYTES = bounded.MiB


def read_prompt(path: str) -> str:
  """The text of a prompt file (`--prompt-file`): a regular UTF-8 file of at most
  PROMPT_BYTES, read before anything is compiled.

  Raises:
    SxError: E-FORM-001 for a file that is missing, not a regular file (a FIFO,
      /dev/zero), larger than PROMPT_BYTES, or not UTF-8.
  """
  return bounded.read_text(path, limit=PROMPT_BYTES, what="prompt file", code="E-FORM-001",
                           where="--prompt-file", fix="give --prompt-file a UTF-8 text file "
                           f"of at most {bounded.size_text(PROMPT_BYTES)}, or --prompt TEXT")


_ID = re.compile(r"-?[0-9]{1,19}")  # past 19 digits no id is in any vocabulary


def parse_ids(text: str) -> list[int]:
  """`"3 1 4"` → [3, 1, 4].

  Raises:
    SxError: E-FORM-001 when a word is not an integer (and no tokenizer is known).
  """
  out = []
  for word in text.split():
    if not _ID.fullmatch(word):  # ASCII digits: str.isdigit takes "²", which int() refuses
      raise SxError("E-FORM-001", f"the prompt word {word!r} is not a token id, and this "
                    "experiment has no tokenizer", where="--prompt",
                    fix='give ids separated by spaces (--prompt "3 1 4"), or --tokenizer FILE')
    out.append(int(word))
  return out

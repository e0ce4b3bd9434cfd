"""Chat templates: a tokenizer and its `chat_template` rendered as `transformers` renders them.

A conversation is rendered with the Jinja template of the `tokenizer_config.json` beside
the `tokenizer.json` (a `chat_template.jinja` there when the config holds none; the
built-in ChatML template when neither does), in the environment `transformers` builds for
`apply_chat_template`: an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and
the `{% generation %}` block, with the tokenizer's special tokens (`bos_token`,
`eos_token`, …) as variables. The text is then tokenized without added special tokens.

Which characters the assistant wrote: a template that marks them with `{% generation %}`
… `{% endgeneration %}` says so itself (as `return_assistant_tokens_mask` reads it);
otherwise the conversation is rendered incrementally: assistant turn k spans from the end
of the first k messages rendered with `add_generation_prompt` to the end of the first k+1
rendered, so it holds the turn's text and the template's end-of-turn marker (`<|im_end|>`
under ChatML), which is what teaches a model to stop. A template whose renders are not
prefixes of each other (one that rewrites earlier turns) is refused with the fix: add
`{% generation %}` markers.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from typing import Any

import numpy as np

from sexpgpu import bounded
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.errors import SxError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ROLES = ("system", "user", "assistant")
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
           "mask_token")
CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_LIMIT = 256 * bounded.MiB
CONFIG_LIMIT = 16 * bounded.MiB
# Characters the incremental renders of one conversation may make in all (a template with
# {% generation %} renders it once instead).
RENDER_BUDGET = 64 * bounded.MiB
# What one render may do, as a hostile template is stopped rather than left to spin: steps
# (calls, macro calls included, attribute and item reads, operators, and each item of a
# `range`), seconds, and resident memory added. A real template renders a conversation in
# thousands of steps and milliseconds.
RENDER_STEPS = 1_000_000
RENDER_SECONDS = 10.0
RENDER_MEMORY = bounded.GiB


class TooCostly(Exception):
  """A render went past one of its limits (steps, seconds or memory)."""


class Meter:
  """The work a render has done, told at each step the sandbox sees."""

  def __init__(self):
    self.start()

  def start(self) -> None:
    """Begins a render's count."""
    self.steps, self.deadline = 0, time.monotonic() + RENDER_SECONDS
    self.rss, self.looked = _resident(), time.monotonic()

  def step(self, n: int = 1) -> None:
    """Counts n steps; raises TooCostly past a limit."""
    self.steps += n
    if self.steps > RENDER_STEPS:
      raise TooCostly(f"more than {RENDER_STEPS:,} steps (calls, reads, operators and range "
                      "items)")
    now = time.monotonic()
    if now > self.deadline:
      raise TooCostly(f"more than {RENDER_SECONDS:g} s")
    if now - self.looked >= 0.02 and self.rss is not None:
      self.looked = now
      grown = (_resident() or 0) - self.rss
      if grown > RENDER_MEMORY:
        raise TooCostly(f"{grown / bounded.MiB:,.0f} MiB of memory, more than the "
                        f"{RENDER_MEMORY / bounded.MiB:,.0f} MiB allowed")


def _resident() -> int | None:
  """This process's resident bytes (Linux's /proc), or None where it cannot be read."""
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


class NotLocated(Exception):
  """The assistant's text cannot be told in a conversation the template renders."""


def _token_text(value: Any) -> str | None:
  """A special token as the config writes it: a string, or an AddedToken's {"content": …}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _special_tokens(config: dict[str, Any]) -> dict[str, Any]:
  """The template's special-token variables, as `special_tokens_map` gives them."""
  out: dict[str, Any] = {}
  for key in SPECIAL:
    text = _token_text(config.get(key))
    if text is not None:
      out[key] = text
  extra = config.get("additional_special_tokens")
  if isinstance(extra, list) and extra:
    out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
  return out


def _environment(meter: Meter):
  """The Jinja environment `transformers` compiles chat templates in, and its span tracker.

  The environment counts each call, attribute or item read, operator and `range` item on
  `meter`, which stops a render past its limits.
  """
  import jinja2  # pylint: disable=import-outside-toplevel
  import jinja2.ext  # pylint: disable=import-outside-toplevel
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

  class Generation(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: records where the block's text lands."""

    tags = {"generation"}
    blocks: list[str] | None = None
    spans: list[tuple[int, int]] | None = None

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

    def _support(self, caller):
      rv = caller()
      if Generation.blocks is not None:
        start = len("".join(Generation.blocks))
        Generation.spans.append((start, start + len(rv)))
      return rv

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.now().strftime(fmt)

  class Metered(ImmutableSandboxedEnvironment):
    """The sandbox, with every call, read and operator counted."""

    intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])
    intercepted_unops = frozenset(["+", "-"])

    def call(__self, __context, __obj, *args, **kwargs):  # pylint: disable=no-self-argument
      meter.step()
      return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
      meter.step()
      return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
      meter.step()
      return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
      meter.step()
      return super().call_binop(context, operator, left, right)

    def call_unop(self, context, operator, arg):
      meter.step()
      return super().call_unop(context, operator, arg)

  def metered_range(*args):
    items = jinja2.sandbox.safe_range(*args)
    meter.step(len(items))
    return items

  env = Metered(trim_blocks=True, lstrip_blocks=True,
                extensions=[Generation, jinja2.ext.loopcontrols])
  env.globals["range"] = metered_range
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env, Generation


class ChatTemplate:
  """A tokenizer with its chat template: conversations → token ids and assistant masks.

  Attributes:
    tokenizer: the `tokenizers.Tokenizer`.
    folder: the tokenizer.json's folder.
    source: where the template came from (the config, the .jinja file, or "ChatML").
    marked: whether the template marks assistant text with `{% generation %}`.
    pad_id: the id padding takes (the pad token's, else the end-of-sequence token's, else 0).
    vocab: the tokenizer's vocabulary, added tokens included.
  """

  def __init__(self, tokenizer_path: str, spec: LoaderSpec):
    """Reads a tokenizer.json and the chat template beside it.

    Args:
      tokenizer_path: the tokenizer.json.
      spec: the loader that reads it, for errors.

    Raises:
      SxError: E-LOAD-001 for a missing tokenizer, E-TOK-002 for one that is no
        tokenizer.json, E-CHAT-002 for a config or template that cannot be read or compiled.
    """
    from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    def error(message: str, fix: str) -> SxError:
      return SxError("E-CHAT-002", f"loader `{spec.name}`: {message}", location=spec.location,
                     fix=fix)

    if not os.path.isfile(tokenizer_path):
      raise SxError("E-LOAD-001", f"loader `{spec.name}`: {tokenizer_path}: no such "
                    "tokenizer.json", location=spec.location,
                    fix="write :tokenizer with the path of a tokenizer.json (relative to the "
                    ".sx file); its tokenizer_config.json beside it gives the chat template")
    text = bounded.read_text(tokenizer_path, limit=TOKENIZER_LIMIT, what=":tokenizer",
                             code="E-TOK-002", where=":tokenizer",
                             fix="give a tokenizer.json saved by tokenizers or transformers")
    try:
      self.tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # pylint: disable=broad-except  # a Rust error of any kind
      raise SxError("E-TOK-002", f"loader `{spec.name}`: {tokenizer_path}: not a "
                    f"tokenizer.json ({type(e).__name__}: {str(e)[:200]})",
                    location=spec.location,
                    fix="give the tokenizer.json that tokenizers or transformers saved "
                    "(not a vocab.json or a model name)") from None
    folder = os.path.dirname(tokenizer_path)
    self.folder = folder  # where `sample` and `eval` find the tokenizer.json
    config_path = os.path.join(folder, CONFIG)
    config: dict[str, Any] = {}
    if os.path.exists(config_path):
      config = bounded.read_json(config_path, limit=CONFIG_LIMIT, what="tokenizer config",
                                 code="E-CHAT-002", where=":tokenizer",
                                 fix="give the tokenizer_config.json transformers saved, a "
                                 "JSON object with a chat_template string")
    template = config.get("chat_template")
    self.source = config_path
    if isinstance(template, list):  # named templates: transformers takes "default"
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    if template is None and os.path.isfile(os.path.join(folder, TEMPLATE_FILE)):
      self.source = os.path.join(folder, TEMPLATE_FILE)
      template = bounded.read_text(self.source, limit=CONFIG_LIMIT, what="chat template",
                                   code="E-CHAT-002", where=":tokenizer")
    if template is None:
      self.source, template = "ChatML", CHATML
    if not isinstance(template, str):
      raise error(f"{config_path}: chat_template is {type(template).__name__}, expected a "
                  "Jinja string", "write chat_template as one string (or a list of "
                  '{"name": "default", "template": ...})')
    import jinja2  # pylint: disable=import-outside-toplevel
    self._meter = Meter()
    self._env, self._tracker = _environment(self._meter)
    try:
      self._template = self._env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
      raise error(f"{self.source}: the chat template does not compile: {e.message} "
                  f"(template line {e.lineno})",
                  "correct the template's Jinja (transformers' apply_chat_template would "
                  "fail on it too)") from None
    self.marked = "generation" in template and self._has_generation(template)
    self.variables = _special_tokens(config)
    special = [self.variables.get(k) for k in ("pad_token", "eos_token")]
    ids = [self.tokenizer.token_to_id(t) for t in special if t is not None]
    self.pad_id = next((i for i in ids if i is not None), 0)
    self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)

  def _has_generation(self, template: str) -> bool:
    import re  # pylint: disable=import-outside-toplevel
    return re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None

  def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
             spans: list[tuple[int, int]] | None = None) -> str:
    """The template's text for `messages`; with `spans`, the `{% generation %}` spans too.

    Raises:
      jinja2.exceptions.TemplateError: what the template raises (`raise_exception`).
      TooCostly: the render went past RENDER_STEPS, RENDER_SECONDS or RENDER_MEMORY.
    """
    self._meter.start()
    kwargs = dict(self.variables)
    kwargs.update(messages=messages, tools=None, documents=None,
                  add_generation_prompt=add_generation_prompt)
    if spans is None:
      return self._template.render(**kwargs)
    blocks: list[str] = []
    self._tracker.blocks, self._tracker.spans = blocks, spans
    try:
      for block in self._template.generate(**kwargs):
        blocks.append(block)
    finally:
      self._tracker.blocks, self._tracker.spans = None, None
    return "".join(blocks)

  def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    Returns:
      (text, spans): each span [start, end) of `text`.

    Raises:
      jinja2.exceptions.TemplateError: what the template raises.
      NotLocated: the template is not incremental (a render of the first k messages is not
        a prefix of the render of the first k+1) and has no `{% generation %}` marks.
    """
    if self.marked:
      spans: list[tuple[int, int]] = []
      text = self.render(messages, spans=spans)
      return text, spans
    text = self.render(messages)
    spans, rendered = [], 0
    for k, m in enumerate(messages):
      if m["role"] != "assistant":
        continue
      head = self.render(messages[:k], add_generation_prompt=True)
      upto = self.render(messages[:k + 1])
      rendered += len(head) + len(upto)
      if rendered > RENDER_BUDGET:  # the renders grow with the turns: quadratic in them
        raise NotLocated(f"rendering its first {k + 1} turns one by one has already made "
                         f"{rendered} characters, more than the {RENDER_BUDGET} allowed a "
                         "conversation")
      if not (upto.startswith(head) and text.startswith(upto)):
        raise NotLocated(f"rendering the first {k} messages (with the generation prompt) and "
                         f"the first {k + 1} gives texts that are not prefixes of the whole "
                         "conversation's, so assistant turn {k + 1} cannot be located")
      spans.append((len(head), len(upto)))
    return text, spans

  def encode(self, text: str, spans: list[tuple[int, int]], everything: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `text` (no special tokens added) and a mask of the tokens in `spans`.

    A token is masked when its characters meet a span (as transformers' char_to_token of
    the span's first and last character reads it), or every token when `everything`.
    """
    enc = self.tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    if everything:
      return ids, np.ones(len(ids), np.int32)
    mask = np.zeros(len(ids), np.int32)
    for start, end in spans:
      if end <= start:
        continue
      first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
      if first is None:
        continue
      mask[first:(last + 1 if last is not None else len(ids))] = 1
    return ids, mask

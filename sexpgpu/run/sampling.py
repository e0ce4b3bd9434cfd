"""`defsample` during training: continuations of fixed prompts, written as `sample` events.

Everything a sample can get wrong (a prompt outside the vocabulary, ids without a tokenizer, a
function that does not map tokens to logits) is found before step 0, where the decoders are
built; each decoder is compiled once, at its first use, and reads the parameters as they
are, so the training steps and their numbers are the same with or without it.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.models import sample
from sexpgpu.run import output


@dataclasses.dataclass
class _Sampler:
  decl: object  # front.experiment.SampleDecl
  prompts: list[list[int]]
  decoder: sample.Decoder
  compiled: object = None  # the decoder compiled at its first use


class Samplers:
  """The experiment's defsample passes, ready to run."""

  def __init__(self, c):
    self.c = c
    self.items: list[_Sampler] = []
    if not c.exp.samples:
      return
    self.tok = sample.tokenizer_of(c, None)
    for d in c.exp.samples.values():
      try:
        prompts = [sample.check_prompt(c, d.fn, self.tok.encode(p).ids if self.tok is not None
                                       else sample.parse_ids(p)) for p in d.prompts]
        settings = sample.Settings(d.tokens, d.temperature, d.top_k, d.top_p, d.seed)
        sample.check_settings(settings, name=lambda field: ":" + field.replace("_", "-"))
        self.items.append(_Sampler(d, prompts, sample.decoder(
            c, d.fn, max(map(len, prompts)), settings)))
      except SxError as e:
        fix = (e.fix.replace("--prompt", ":prompts").replace("--fn", ":fn")
               .replace("--tokenizer FILE", "a text loader's token cache"))
        raise SxError(e.code, f"defsample {d.name}: {e.message}", location=d.loc,
                      fix=fix) from None

  def due(self, step: int, at_end: bool) -> bool:
    return any(step > 0 and (step % s.decl.every == 0 or at_end) for s in self.items)

  def run(self, ctx, params, step: int, at_end: bool, resumed_at) -> None:
    """Each sample due at `step`: its continuations as events and a progress line.

    Args: ctx: the RunContext (its placement, and where the numbers go); params: the
    parameters as the run keeps them; step, at_end: the step just trained, and whether it
    is the last; resumed_at: the step a resume starts at, or None.
    """
    place, progress = ctx.place, ctx.out.progress
    metrics, log = ctx.out.metrics, ctx.out.log
    for s in self.items:
      d = s.decl
      if step == 0 or step == resumed_at or not (step % d.every == 0 or at_end):
        continue
      progress.set_status("evaluating", step)
      calls = [s.decoder.args(self.c, params, ids) for ids in s.prompts]
      if s.compiled is None:  # once: the tokens a second are the decoding's, not XLA's
        s.compiled = s.decoder.decode.lower(*calls[0]).compile()
      t = time.perf_counter()
      made, lines = 0, []
      for ids, args in zip(s.prompts, calls):
        got = np.asarray(place.host(s.compiled(*args)))
        got = [int(i) for i in got]
        made += len(got)
        prompt, text = self._words(ids), self._words(got)
        metrics.emit("sample", step=step, name=d.name, prompt=prompt, text=text, ids=got,
                     path=s.decoder.path)
        lines.append((prompt, text))
      dt = time.perf_counter() - t
      values = {f"{d.name}/tokens-per-s": made / max(dt, 1e-9)}
      log(output.progress_line(d.name, step, values, progress))
      columns = output.width()
      for prompt, text in lines:
        log(output.sample_line(d.name, prompt, text, columns))

  def _words(self, ids: list[int]) -> str:
    return self.tok.decode(ids) if self.tok is not None else " ".join(map(str, ids))

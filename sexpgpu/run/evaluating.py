"""`defeval` during training: downstream tasks scored by log-likelihood, written as `eval`
events, a progress line each, and the summary's numbers.

Everything an evaluation can get wrong (a task file that does not parse, no tokenizer, a
function that does not map tokens to logits, a task with nothing that fits the window) is
found before step 0, where the tasks are read, tokenized and laid out in rows; the scoring
call is compiled once, and reads the parameters as they are, so the training steps and their
numbers are the same with or without it.
"""

from __future__ import annotations

import dataclasses
import os
import time

from sexpgpu.errors import SxError
from sexpgpu.models import evaluate, sample
from sexpgpu.run import output
from sexpgpu.run.passes import due


@dataclasses.dataclass
class _Evaluator:
  decl: object  # front.experiment.EvalDecl
  scorer: evaluate.Scorer
  tasks: list[evaluate.Task]
  told: set = dataclasses.field(default_factory=set)  # tasks whose skipped lines were logged


class Evaluators:
  """The experiment's defeval passes, their tasks read and laid out."""

  def __init__(self, c):
    self.c = c
    self.items: list[_Evaluator] = []
    for d in c.exp.evals.values():
      try:
        tasks = [_task(path, loc, d.limit) for path, loc in d.tasks]
        tok = sample.tokenizer_of(c, d.tokenizer)
        if tok is None:
          raise SxError("E-EVAL-002", f"defeval {d.name} has no tokenizer: the experiment "
                        "reads no text loader's token cache", location=d.loc,
                        fix=f'(defeval {d.name} ... :tokenizer "cache/tokenizer.json")')
        scorer = evaluate.Scorer(c, d.fn, tok, batch=d.batch)
        for t in tasks:
          scorer.prepare(t)
      except SxError as e:
        if e.location is not None:
          raise
        fix = e.fix.replace("--fn", ":fn").replace("--tokenizer", ":tokenizer")
        raise SxError(e.code, f"defeval {d.name}: {e.message}", location=d.loc,
                      fix=fix) from None
      self.items.append(_Evaluator(d, scorer, tasks))

  def due(self, step: int, at_end: bool) -> bool:
    return any(due(e.decl, step, self.c) or at_end for e in self.items)

  def describe(self) -> list[str]:
    """`check`'s lines: each defeval's tasks, documents, requests and rows."""
    lines = []
    for e in self.items:
      s = e.scorer
      lines.append(f"  {e.decl.name}: :fn {e.decl.fn}, window {s.window}, "
                   + ("packed" if s.packed else "one request a row") + f", {e.decl.batch} "
                   "rows a call")
      for t in e.tasks:
        reqs, skipped, rows = s.prepare(t)
        lines.append(f"    {t.name} ({t.kind}): {len(t.docs)} documents, {len(reqs)} "
                     f"requests in {rows.tokens.shape[0]} rows"
                     + (f", {len(skipped)} skipped (longer than the window)" if skipped else ""))
    return lines

  def run(self, ctx, params, step: int, at_end: bool, resumed_at) -> None:
    """Each defeval due at `step`: its tasks scored, an `eval` event a task, a line.

    Args:
      ctx: the RunContext (its placement, and where the numbers go).
      params: the parameters as the run keeps them.
      step, at_end: the step just trained, and whether it is the last.
      resumed_at: the step a resume starts at (its passes ran before), or None.
    """
    place, progress = ctx.place, ctx.out.progress
    metrics, log = ctx.out.metrics, ctx.out.log
    for e in self.items:
      d = e.decl
      if step == resumed_at or not (due(d, step, self.c) or at_end):
        continue
      progress.set_status("evaluating", step)
      values = {}
      for task in e.tasks:
        t = time.perf_counter()
        res = e.scorer.score(params, task, host=place.host)
        got = {f"{d.name}/{task.name}/{k}": v for k, v in res.metrics.items()}
        values.update(got)
        metrics.emit("eval", step=step, **{
            "eval": d.name, "task": task.name, "metrics": got, "documents": len(res.docs),
            "requests": res.requests, "rows": res.rows, "skipped": len(res.skipped),
            "time/eval": time.perf_counter() - t})
        if res.skipped and task.path not in e.told:  # once a run
          e.told.add(task.path)
          lines = ", ".join(map(str, res.skipped[:8])) + (", ..." if len(res.skipped) > 8 else "")
          log(f"{d.name}: {task.name}: {len(res.skipped)} of {len(task.docs)} documents do "
              f"not fit the window of {e.scorer.window} tokens and are skipped (lines {lines})")
      progress.last_pass.update(values)
      log(output.progress_line(d.name, step, values, progress))


def _task(path: str, loc, limit):
  if not os.path.isfile(path):
    raise SxError("E-EVAL-001", f"no task file {path}", location=loc,
                  fix="give a .jsonl path relative to the .sx file")
  return evaluate.load_task(path, limit)

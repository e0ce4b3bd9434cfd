"""The fixed-format lines of standard error: configuration, progress, timing, done."""

from __future__ import annotations

import os
import statistics
import sys
from typing import TextIO

from sexpgpu.paths import scrub

# The streams found closed (a reader such as `| head -1` that went away): nothing more is
# written to them, and the run goes on.
_CLOSED: set[int] = set()
# The transient line shown on a terminal's standard error while compiling
# (progress.CompileLine), erased before any line is written there; empty off a terminal.
TRANSIENT: list = []


def write(stream: TextIO, text: str) -> bool:
  """Writes and flushes `text`, scrubbed of credentials (paths.scrub: every line of a run,
  an error, `check`'s print-outs and the commands' text pass here); a closed pipe is not
  an error: the run goes on without it.

  Args:
    stream: sys.stdout or sys.stderr.
    text: what to write.

  Returns:
    Whether it was written.
  """
  text = scrub(text)
  fd = _fileno(stream)
  if (fd if fd >= 0 else id(stream)) in _CLOSED:
    return False
  line = TRANSIENT[0] if TRANSIENT else None
  try:
    if line is not None and stream is line.stream:
      with line.lock:  # the transient line erased first, and not drawn over this one
        line.erase()
        stream.write(text)
        stream.flush()
    else:
      stream.write(text)
      stream.flush()
    return True
  except (BrokenPipeError, ValueError, OSError):
    _silence(stream, fd)
    return False


def _fileno(stream: TextIO) -> int:
  try:
    return stream.fileno()
  except (ValueError, OSError, AttributeError):
    return -1


def _silence(stream: TextIO, fd: int) -> None:
  # Later writes, Python's own flush at exit and native libraries' writes go to
  # /dev/null instead of failing on the dead pipe.
  _CLOSED.add(fd if fd >= 0 else id(stream))
  if fd >= 0:
    try:
      null = os.open(os.devnull, os.O_WRONLY)
      os.dup2(null, fd)
      os.close(null)
    except OSError:
      pass


def err(line: str) -> None:
  """Writes one line to standard error and flushes it (a host-visible progress point)."""
  write(sys.stderr, line + "\n")


def config_line(c, o, place, resume: str) -> str:
  """The run's first line, `run: FILE slug S device D steps N ...`.

  Args:
    c: the Compiled experiment (slug, run settings, passes, diagnostics).
    o: the RunOptions (file, device, checkpoint location, status file).
    place: the run's Placement (ranks and nodes, said when more than one).
    resume: the `resume` field (`-`, or what --resume resolved to).
  """
  run, ranks, nodes = c.exp.run, place.ranks, place.nodes
  evals = evals_field({**c.exp.passes, **c.exp.evals}, run.get("eval-every"))
  dev = f"device {o.device}" + (f" ranks {ranks} nodes {nodes}" if ranks > 1 or nodes > 1
                                else "")
  return (f"run: {o.file} slug {c.slug} {dev} steps {int(run['steps'])} microbatches "
          f"{int(run['microbatches'])} evals {evals} diagnostics "
          f"{','.join(c.diagnostics) or '-'} precision {run['precision']} seed {run['seed']} "
          f"checkpoints {o.checkpoint_dir or '-'} resume {resume} status {o.status or '-'}")


def evals_field(passes: dict, every_override) -> str:
  """The configuration line's `evals`: each defpass and defeval, `eval@10,bench@500`, or `-`."""
  if not passes:
    return "-"
  out = []
  for name, p in passes.items():
    every = p.every if every_override is None else every_override
    out.append(f"{name}@{every}" if every else f"{name}@end")
  return ",".join(out)


def progress_line(pass_name: str, step: int, metrics: dict[str, float], progress) -> str:
  """`step 10/20 loss 2.90611 | eval/loss 3.01543 | 80 records | 0.1s`: a pass's line
  (prefixed `NAME: ` but for `eval`), with the run's steps, its last training loss (none at
  step 0), records and seconds since the first step from `progress` (run.progress.Progress)."""
  prefix = "" if pass_name == "eval" else f"{pass_name}: "
  loss = None if step == 0 else progress.train_loss
  loss_s = "-" if loss is None else f"{loss:.5f}"
  parts = " | ".join(f"{k} {v:.5f}" for k, v in metrics.items())
  return (f"{prefix}step {step}/{progress.steps} loss {loss_s} | {parts} | "
          f"{progress.counters['records']} records | {progress.since_first_step():.1f}s")


# The width a sample's line is cut to when standard error is no terminal and COLUMNS is unset.
LOG_WIDTH = 100


def width() -> int:
  """The columns of standard error's terminal (COLUMNS wins), else LOG_WIDTH."""
  try:
    return max(20, int(os.environ["COLUMNS"]))
  except (KeyError, ValueError):
    pass
  try:
    return max(20, os.get_terminal_size(sys.stderr.fileno()).columns)
  except (OSError, ValueError, AttributeError):
    return LOG_WIDTH


def sample_line(name: str, prompt: str, text: str, columns: int) -> str:
  """A defsample's continuation on one line: `story: "Once upon" → a time there…`, its
  whitespace runs as one space, cut to `columns` (the whole text is in the metrics)."""
  line = f'{name}: "{" ".join(prompt.split())}" → {" ".join(text.split())}'
  return line if len(line) <= columns else line[:columns - 1] + "…"


def _med_p90(xs: list[float]) -> tuple[float, float]:
  ys = sorted(xs)
  p90 = ys[min(len(ys) - 1, int(round(0.9 * (len(ys) - 1))))]
  return statistics.median(ys), p90


def timing_lines(progress, kernels: tuple[int, float, int], seconds: dict[str, float],
                 span: tuple[int, int]) -> list[str]:
  """The `timing` block.

  Args:
    progress: the run's Progress (run.progress): its step times, and each pass's first time
      and later times.
    kernels: (kernels compiled, seconds compiling, cache hits).
    seconds: `graph` (building the graph), `open` (the devices), `step0`, `total`.
    span: the first step of this session minus one, and the last step trained.
  """
  compiled, compile_s, hits = kernels
  first, last = span
  lines = [f"timing graph {seconds['graph']:.3f}s device-open {seconds['open']:.3f}s",
           f"timing kernels {compiled} compiled in {compile_s:.3f}s, {hits} cache hits"]
  zero = " ".join(f"{p}-0 {t:.3f}s" for p, t in progress.first_pass.items())
  lines.append(f"timing step-0 {seconds['step0']:.3f}s" + (f" {zero}" if zero else ""))
  if progress.step_times:
    med, p90 = _med_p90(progress.step_times)
    lines.append(f"timing steps {first + 1}..{last} median {med:.4f}s p90 {p90:.4f}s")
  else:
    lines.append("timing steps - median - p90 -")
  for p, ts in progress.pass_times.items():
    if ts:
      med, p90 = _med_p90(ts)
      lines.append(f"timing {p} {len(ts)} passes median {med:.4f}s p90 {p90:.4f}s")
    else:
      lines.append(f"timing {p} 0 passes median - p90 -")
  lines.append(f"timing total {seconds['total']:.3f}s over {last - first} steps")
  return lines


def done_lines(steps: int, train_loss: float | None, evals: dict[str, float],
               counters: dict[str, int]) -> list[str]:
  loss = "-" if train_loss is None else f"{train_loss:.4f}"
  lines = [f"done: {steps} steps, train/loss {loss}"]
  lines += [f"  {k} {v:.4f}" for k, v in evals.items()]
  lines += [f"  counter {k} {v}" for k, v in counters.items()]
  return lines

"""`sexpgpu watch`: a live progress bar (rich) read from a run's status file.

When standard output is no terminal (a file, a pipe, a CI log), it writes one plain line an
update instead, flushed as it is written: `step 120/400 loss 2.31 eval/loss 2.4000 eta 1m20s`.

Exit status, from the run's final state: done 0, failed 1, stopped 2 (the signal's 128 + n
is not in the status file; a stopped run can be resumed, which is why it is not a failure).
A file that does not exist yet is waited for.
"""

from __future__ import annotations

import os
import sys
import time

from sexpgpu.track.status import read_status

EXIT = {"done": 0, "failed": 1, "stopped": 2}


def _read(path: str) -> dict | None:
  try:
    return read_status(path)
  except (OSError, ValueError):
    return None  # not written yet


def _fmt(v, digits: int = 4) -> str:
  return "-" if v is None else f"{v:.{digits}f}"


def _eta(seconds) -> str:
  if seconds is None:
    return "eta -"
  s = int(round(seconds))
  return f"eta {s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _short_eta(seconds) -> str:
  """`1h02m`, `1m20s`, `45s`, or `-` when unknown."""
  if seconds is None:
    return "-"
  s = int(round(seconds))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def plain_line(status: dict) -> str:
  """One update as a plain line: `step 120/400 loss 2.31 eval/loss 2.4000 eta 1m20s`."""
  loss = status.get("train_loss")
  parts = [f"step {status.get('step') or 0}/{status.get('steps', '?')}",
           f"loss {'-' if loss is None else f'{loss:.4g}'}"]
  parts += [f"{k} {_fmt(v)}" for k, v in sorted((status.get("last_pass") or {}).items())]
  parts.append(f"eta {_short_eta(status.get('eta_seconds'))}")
  if status.get("state") not in (None, "running"):
    parts.append(str(status["state"]))
  return " ".join(parts)


def describe(status: dict) -> dict[str, str]:
  """The status as the bar's text fields: rate, eta and info (loss, passes, stage, state)."""
  sps = status.get("steps_per_second")
  parts = [f"loss {_fmt(status.get('train_loss'))}"]
  parts += [f"{k} {_fmt(v)}" for k, v in sorted((status.get("last_pass") or {}).items())]
  parts += [f"stage {status.get('stage', 0)}", str(status.get("state", "?"))]
  return {"rate": "- steps/s" if sps is None else f"{sps:.1f} steps/s",
          "eta": _eta(status.get("eta_seconds")), "info": " | ".join(parts),
          "steps": f"step {status.get('step') or 0}/{status.get('steps', '?')}"}


def final_line(status: dict) -> str:
  """The line printed when the run has ended."""
  state = status.get("state")
  line = f"{state}: {status.get('slug', '?')} step {status.get('step')}/{status.get('steps')}"
  line += f", train/loss {_fmt(status.get('train_loss'))}"
  line += "".join(f", {k} {_fmt(v)}" for k, v in sorted((status.get("last_pass") or {}).items()))
  err = status.get("error")
  if state == "failed" and err:
    line += f"\nerror[{err.get('code')}]: {err.get('message')}"
  ck = status.get("checkpoint")
  if state == "stopped" and ck:
    line += f"\ncheckpoint at step {ck.get('step')}: {ck.get('location')} (resume with --resume latest)"
  return line


# Seconds a status file may take to appear (a run started just before watch writes it
# within its first second).
APPEAR_SECONDS = 30.0


def watch(path: str, interval: float = 0.5, console=None, timeout: float | None = None,
          appear: float = APPEAR_SECONDS) -> int:
  """Shows the run's progress until its status says done, stopped or failed.

  Args:
    path: the status file (`--status` of the run).
    interval: seconds between reads.
    console: a rich Console (default: standard output).
    timeout: give up after this many seconds (None: never), returning 3.
    appear: seconds to wait for a readable status file before it is an error.

  Returns:
    0 done, 1 failed, 2 stopped, 3 timed out.

  Raises:
    SxError: E-METRICS-001 when no readable status file appears within `appear` seconds.
  """
  from sexpgpu.errors import SxError
  if os.path.isdir(path):
    raise SxError("E-METRICS-001", f"{path} is a directory, not a status file", where=path,
                  fix="give the file the run writes with --status PATH")
  if _read(path) is None:
    sys.stderr.write(f"watch: waiting up to {appear:g}s for {path} (a run writes it with "
                     "--status)\n")
    sys.stderr.flush()
    give_up = time.monotonic() + appear
    while _read(path) is None:
      if time.monotonic() > give_up:
        what = "is not a status file" if os.path.exists(path) else "does not exist"
        raise SxError("E-METRICS-001", f"{path} {what} (waited {appear:g}s)", where=path,
                      fix="start the run with --status PATH (or SEXPGPU_STATUS) and watch "
                      "that PATH")
      time.sleep(min(interval, 0.2))
  from rich.console import Console
  console = console or Console()
  deadline = None if timeout is None else time.monotonic() + timeout
  if not console.is_terminal:
    status = _follow_plain(path, interval, console, deadline)
  else:
    status = _follow_bar(path, interval, console, deadline)
  if status is None or status.get("state") not in EXIT:
    console.print(f"watch: gave up after {timeout}s; last state "
                  f"{status.get('state') if status else 'none (no status file)'}")
    return 3
  console.print(final_line(status), soft_wrap=True, markup=False, highlight=False)
  return EXIT[status["state"]]


def _follow_plain(path: str, interval: float, console, deadline: float | None) -> dict | None:
  """A plain line whenever the step, loss, a pass or the state changes; returns the last status."""
  status, last = None, None
  while True:
    st = _read(path)
    if st is not None:
      status = st
      line = plain_line(st)
      if line != last:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
        console.file.flush()  # a pipe is block-buffered: a reader sees each line as it comes
        last = line
      if st.get("state") in EXIT:
        return status
    if deadline is not None and time.monotonic() > deadline:
      return status
    time.sleep(interval)


def _follow_bar(path: str, interval: float, console, deadline: float | None) -> dict | None:
  """A live rich bar with `step N/M` until the run ends; the last status."""
  from rich.progress import BarColumn, Progress, TextColumn
  progress = Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.fields[steps]}"),
                      TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"),
                      TextColumn("{task.fields[info]}"), console=console,
                      refresh_per_second=max(1.0, 1.0 / max(interval, 1e-3)))
  status = None
  with progress:
    task = progress.add_task(f"waiting for {path}", total=None, rate="", eta="", info="",
                             steps="")
    while True:
      st = _read(path)
      if st is not None:
        status = st
        progress.update(task, description=str(st.get("slug", path)), total=st.get("steps"),
                        completed=st.get("step") or 0, **describe(st))
        if st.get("state") in EXIT:
          break
      if deadline is not None and time.monotonic() > deadline:
        break
      time.sleep(interval)
    progress.refresh()
  return status

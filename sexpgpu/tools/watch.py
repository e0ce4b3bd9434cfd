"""`sexpgpu watch`: a live progress bar (rich) read from a run's status file.

When standard output is no terminal (a file, a pipe, a CI log), it writes one plain line an
update instead, flushed as it is written: `step 120/400 loss 2.31 eval/loss 2.4000 eta 1m20s`.

Exit status, from the run's final state: done 0, failed 1, stopped 2 (the signal's 128 + n
is not in the status file; a stopped run can be resumed, which is why it is not a failure).
A file that does not exist yet is waited for (`--wait`), and so is one that is no status
object yet; a folder, a FIFO or a device is refused at once. The file is read through
`sexpgpu.bounded` (at most STATUS_BYTES, a JSON object whose fields have the types a run
writes).
"""

from __future__ import annotations

import math
import os
import sys
import time

from sexpgpu import bounded
from sexpgpu.errors import SxError

EXIT = {"done": 0, "failed": 1, "stopped": 2}
# A status object is a few KiB; a file past this is no status file.
STATUS_BYTES = bounded.MiB
# The flags' ranges: seconds between reads, and seconds to wait for the file to appear.
INTERVAL = (0.01, 3600.0)
MAX_WAIT = 7 * 24 * 3600.0

_NUMBER = (int, float)
# What each field the run writes (sexpgpu.track.status.StatusFile) holds, when present.
FIELDS = {"slug": (str,), "state": (str,), "step": (int, type(None)),
          "steps": (int, type(None)), "stage": (int,), "train_loss": _NUMBER + (type(None),),
          "last_pass": (dict, type(None)), "steps_per_second": _NUMBER + (type(None),),
          "eta_seconds": _NUMBER + (type(None),), "checkpoint": (dict, type(None)),
          "error": (dict, type(None))}


def load(path: str) -> dict:
  """The status file's object, its fields of the types the run writes.

  Raises:
    SxError: E-METRICS-001 for a file that is missing, not a regular file, past
      STATUS_BYTES, not JSON, not an object, nested past `bounded.DEPTH`, or with a field of
      another type (named).
  """
  fix = "give the file the run writes with --status PATH"
  status = bounded.read_json(path, limit=STATUS_BYTES, what="status file",
                             code="E-METRICS-001", kind=dict, where=path, fix=fix)
  for name, types in FIELDS.items():
    value = status.get(name)
    bad = name in status and (isinstance(value, bool) or not isinstance(value, types))
    if not bad and isinstance(value, int) and name in ("step", "steps", "stage"):
      bad = not 0 <= value < 2**53  # a count rich turns into a float
    elif not bad and isinstance(value, int):
      bad = not -2**63 <= value < 2**63  # a number shown as a float
    if not bad and name == "last_pass" and value:
      bad = not all(isinstance(v, _NUMBER + (type(None),)) and not isinstance(v, bool)
                    and (not isinstance(v, int) or -2**63 <= v < 2**63)
                    for v in value.values())
    if bad:
      raise SxError("E-METRICS-001", f"status file {path}: the field {name!r} holds "
                    f"{str(value)[:40]!r}, not what a run writes there", where=path,
                    fix="watch the file a run writes with --status PATH; do not edit it")
  return status


class _Source:
  """Reads the status file; a refusal is waited out for `grace` seconds (a file not written
  yet, or replaced by another writer than the run), then raised. A path that is there but
  can never be a status file (a folder, a FIFO, a device) is refused at once."""

  def __init__(self, path: str, grace: float):
    self.path, self.grace, self.since = path, grace, None

  def read(self) -> dict | None:
    try:
      status = load(self.path)
    except SxError as e:
      if os.path.exists(self.path) and not os.path.isfile(self.path):
        raise
      now = time.monotonic()
      self.since = now if self.since is None else self.since
      if now - self.since <= self.grace:
        return None
      if not os.path.exists(self.path):
        raise SxError("E-METRICS-001", f"{self.path} does not exist (waited "
                      f"{self.grace:g}s)", where=self.path,
                      fix="start the run with --status PATH (or SEXPGPU_STATUS) and watch "
                      "that PATH") from None
      raise e.with_note("waited", f"{self.grace:g}s for it to become a status file")
    self.since = None
    return status


def _pause(interval: float, deadline: float | None) -> None:
  """Sleeps `interval` seconds, or until the deadline when that comes first."""
  if deadline is not None:
    interval = min(interval, max(0.0, deadline - time.monotonic()))
  time.sleep(interval)


def _fmt(v, digits: int = 4) -> str:
  return "-" if v is None else f"{v:.{digits}f}"


def _eta(seconds) -> str:
  if seconds is None or not math.isfinite(seconds):
    return "eta -"
  s = int(round(seconds))
  return f"eta {s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _short_eta(seconds) -> str:
  """`1h02m`, `1m20s`, `45s`, or `-` when unknown."""
  if seconds is None or not math.isfinite(seconds):
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
    SxError: E-METRICS-001 when no status file appears within `appear` seconds, or the
      file stays no status file (of `load`'s kinds) that long; at once for a folder, a FIFO
      or a device. E-FORM-001 for an interval, timeout or wait outside its range.
  """
  _check_times(interval, timeout, appear)
  source = _Source(path, appear)
  if source.read() is None:
    sys.stderr.write(f"watch: waiting up to {appear:g}s for {path} (a run writes it with "
                     "--status)\n")
    sys.stderr.flush()
    while source.read() is None:
      time.sleep(min(interval, 0.2))
  from rich.console import Console
  console = console or Console()
  deadline = None if timeout is None else time.monotonic() + timeout
  if not console.is_terminal:
    status = _follow_plain(source, interval, console, deadline)
  else:
    status = _follow_bar(source, interval, console, deadline)
  if status is None or status.get("state") not in EXIT:
    console.print(f"watch: gave up after {timeout}s; last state "
                  f"{status.get('state') if status else 'none (no status file)'}")
    return 3
  console.print(final_line(status), soft_wrap=True, markup=False, highlight=False)
  return EXIT[status["state"]]


def _check_times(interval: float, timeout: float | None, appear: float) -> None:
  """Refuses --interval, --timeout and --wait outside their ranges (NaN included)."""
  low, high = INTERVAL
  if not low <= interval <= high:
    raise SxError("E-FORM-001", f"--interval is {interval:g} seconds; it takes {low:g} to "
                  f"{high:g}", where="--interval",
                  fix=f"give --interval {low:g} to {high:g} seconds between reads (0.5 by "
                  "default)")
  if timeout is not None and not 0 < timeout < math.inf:
    raise SxError("E-FORM-001", f"--timeout is {timeout:g} seconds; it takes a number above "
                  "0", where="--timeout", fix="give --timeout the seconds to watch before "
                  "giving up (exit 3), above 0, or leave it out to watch to the end")
  if not 0 <= appear <= MAX_WAIT:
    raise SxError("E-FORM-001", f"--wait is {appear:g} seconds; it takes 0 to {MAX_WAIT:g}",
                  where="--wait", fix=f"give --wait 0 to {MAX_WAIT:g} seconds (a week) for "
                  "the status file to appear")


def _follow_plain(source: _Source, interval: float, console, deadline: float | None
                  ) -> dict | None:
  """A plain line whenever the step, loss, a pass or the state changes; returns the last status."""
  status, last = None, None
  while True:
    st = source.read()
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
    _pause(interval, deadline)


def _follow_bar(source: _Source, interval: float, console, deadline: float | None
                ) -> dict | None:
  """A live rich bar with `step N/M` until the run ends; the last status."""
  from rich.progress import BarColumn, Progress, TextColumn
  progress = Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.fields[steps]}"),
                      TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"),
                      TextColumn("{task.fields[info]}"), console=console,
                      refresh_per_second=max(1.0, 1.0 / max(interval, 1e-3)))
  status = None
  with progress:
    task = progress.add_task(f"waiting for {source.path}", total=None, rate="", eta="",
                             info="", steps="")
    while True:
      st = source.read()
      if st is not None:
        status = st
        progress.update(task, description=str(st.get("slug", source.path)),
                        total=st.get("steps"),
                        completed=st.get("step") or 0, **describe(st))
        if st.get("state") in EXIT:
          break
      if deadline is not None and time.monotonic() > deadline:
        break
      _pause(interval, deadline)
    progress.refresh()
  return status

"""Retries with backoff for a run's remote operations, bounded by SEXPGPU_REMOTE_TIMEOUT.

An object store drops connections every day: a checkpoint upload, its commit
marker or a loader's fetch that fails for a reason that may pass (a refused or
cut connection, a timeout, a 5xx) is tried again with growing pauses until it
succeeds or the deadline passes. The first failure and the final success each
give one line on standard error and one event to the listeners (the run turns
them into annotations). A failure that cannot pass (no such object or bucket,
access refused) is raised at once.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

# (name, text) → None; the run adds one that emits an annotation
_LISTENERS: list[Callable[[str, str], None]] = []
_LOCK = threading.Lock()
_REACHED: set[str] = set()  # stores that answered in this process
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 10.0


def listen(fn: Callable[[str, str], None]) -> Callable[[], None]:
  """Calls fn(name, text) on each retry line; returns a function that stops it."""
  with _LOCK:
    _LISTENERS.append(fn)

  def stop() -> None:
    with _LOCK:
      if fn in _LISTENERS:
        _LISTENERS.remove(fn)
  return stop


def _say(name: str, text: str) -> None:
  print(text, file=sys.stderr, flush=True)
  with _LOCK:
    listeners = list(_LISTENERS)
  for fn in listeners:
    try:
      fn(name, text)
    except Exception:  # pylint: disable=broad-except
      pass  # a listener's failure must not fail the operation it reports


def permanent(e: BaseException) -> bool:
  """Whether an error of a remote call cannot pass by waiting (missing, refused access)."""
  if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                    KeyboardInterrupt, SystemExit)):
    return True
  text = f"{type(e).__name__} {e}"
  return any(w in text for w in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                                 "SignatureDoesNotMatch", "NoSuchKey", "Forbidden"))


def deadline_s() -> float:
  """SEXPGPU_REMOTE_TIMEOUT (parsed by its one parser), default 300 s."""
  from sexpgpu.env import remote_timeout  # pylint: disable=import-outside-toplevel
  return remote_timeout()


def call(what: str, fn: Callable[..., Any], *args, timeout_s: float | None = None,
         prefix: str = "checkpoint", describe: Callable[[BaseException], str] | None = None,
         store: str | None = None, **kwargs) -> Any:
  """fn(*args, **kwargs), tried again with backoff while it fails for a passing reason.

  Args:
    what: the operation as the lines name it ("upload of step 60 to s3://b/run/60").
    fn: the remote call.
    timeout_s: seconds from the first failure after which the last error is raised
      (default: SEXPGPU_REMOTE_TIMEOUT).
    prefix: the lines' first word (`checkpoint`, `data`).
    describe: a credential-free account of an error (default: its type and text).
    store: the store's name (its endpoint): when given, a store that has not answered
      yet in this process is not retried, so a wrong endpoint or a dead server at the
      start of a run is reported at once rather than after the deadline.

  Returns:
    What fn returns.

  Raises:
    The last error of fn, when it cannot pass or the deadline is reached.
  """
  describe = describe or (lambda e: f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
  limit = deadline_s() if timeout_s is None else timeout_s
  first = None
  tries = 0
  pause = FIRST_PAUSE_S
  while True:
    tries += 1
    try:
      out = fn(*args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-except
      if permanent(e) or (store is not None and store not in _REACHED):
        raise
      now = time.monotonic()
      if first is None:
        first = now
        _say("retry", f"{prefix}: {what} failed ({describe(e)}); retrying for up to "
                      f"{limit:g}s")
      left = first + limit - now
      if left <= 0:
        _say("retry-failed", f"{prefix}: {what} still failing after {tries} tries in "
                             f"{now - first:.1f}s; giving up")
        raise
      time.sleep(min(pause, left))
      pause = min(pause * 2, MAX_PAUSE_S)
      continue
    if store is not None:
      _REACHED.add(store)
    if first is not None:
      _say("retry-succeeded", f"{prefix}: {what} succeeded after {tries} tries in "
                              f"{time.monotonic() - first:.1f}s")
    return out


def bounded(what: str, fn: Callable[..., Any], *args, seconds: float | None = None,
            **kwargs) -> Any:
  """fn(*args, **kwargs), given up after `seconds` (default SEXPGPU_REMOTE_TIMEOUT).

  For a remote look-up (a listing, a marker's existence, a small file) whose library
  retries on its own: gcsfs tries a request six times with doubling pauses, so without a
  network one look-up would take about a minute whatever the run's deadline. Data
  transfers are not bounded so: a large upload may rightly take longer.

  Raises:
    TimeoutError: naming `what` and the seconds, when fn has not returned by then (it is
      left to finish in a daemon thread, whose result is dropped).
    Whatever fn raises.
  """
  limit = deadline_s() if seconds is None else seconds
  box: dict[str, Any] = {}

  def work() -> None:
    try:
      box["value"] = fn(*args, **kwargs)
    except BaseException as e:  # pylint: disable=broad-except  # raised in the caller
      box["error"] = e

  worker = threading.Thread(target=work, name="sexpgpu-remote-lookup", daemon=True)
  worker.start()
  worker.join(limit)
  if worker.is_alive():
    raise TimeoutError(f"{what} had no answer within {limit:g} s (SEXPGPU_REMOTE_TIMEOUT)")
  if "error" in box:
    raise box["error"]
  return box.get("value")

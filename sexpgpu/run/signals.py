"""The stop signals (SIGTERM, SIGINT, SIGHUP): which arrived first, from the first instruction.

The CLI installs the handlers before it imports anything slow (`install()`). Until the
training loop takes over, a signal stops start-up at once: the handler raises `Stopped`,
which the CLI turns into status `stopped` and exit 128 + n. While the loop runs
(`deferred()`), a signal only sets `FLAG.received`, which the loop reads at step
boundaries, so the step in flight and the checkpoint finish first.

Nothing here imports more than the standard library: it runs before everything else.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

# The signals that stop a run, and their names in the summary's `stopped_by`.
SIGNALS: dict[int, str] = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT",
                           signal.SIGHUP: "SIGHUP"}


class Stopped(BaseException):
  """A stop signal arrived during start-up (a BaseException: no `except Exception` eats it)."""

  def __init__(self, signum: int):
    super().__init__(f"stopped by {SIGNALS.get(signum, signum)}")
    self.signum = signum

  @property
  def exit_code(self) -> int:
    return 128 + self.signum


class Flag:
  """Which stop signal arrived first, and the handlers that record it.

  Attributes:
    received: the first stop signal's number, or None.
    raising: while True a signal raises Stopped (start-up); else it is only recorded.
  """

  def __init__(self):
    self.received: int | None = None
    self.raising = False
    self._old: dict[int, object] = {}

  @property
  def name(self) -> str | None:
    """The first signal's name (SIGTERM, ...), or None."""
    return None if self.received is None else SIGNALS.get(self.received, str(self.received))

  @property
  def installed(self) -> bool:
    return bool(self._old)

  def _handle(self, signum, frame) -> None:
    first = self.received is None
    if first:
      self.received = signum
    if self.raising and first:
      self._stop_when_safe(frame)

  def _stop_when_safe(self, frame) -> None:
    # An exception raised while a module is being imported can leave a native extension
    # half-initialised and crash the interpreter (SIGSEGV); the stop then waits for the
    # import to finish, polling with a short timer.
    if _importing(frame):
      signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
      return
    self.raising = False  # a second signal while start-up unwinds is only recorded
    raise Stopped(self.received)

  def _retry(self, signum, frame) -> None:
    if self.raising and self.received is not None:
      self._stop_when_safe(frame)

  def install(self, raising: bool = True) -> bool:
    """Installs the handlers (main thread only) and unblocks the signals.

    A signal ignored when the process started (`nohup`) stays ignored. A signal blocked
    by the parent and already pending is delivered here, to these handlers.

    Args:
      raising: a signal raises Stopped (start-up) rather than only being recorded.

    Returns:
      Whether the handlers were installed now (False off the main thread or when they
      already are).
    """
    if self.installed or threading.current_thread() is not threading.main_thread():
      return False
    self.received = None
    self.raising = raising
    for s in SIGNALS:
      old = signal.getsignal(s)
      self._old[s] = old
      if old is not signal.SIG_IGN:
        signal.signal(s, self._handle)
    self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._retry)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, list(SIGNALS))
    return True

  def restore(self) -> None:
    """Puts back the handlers that were there before install()."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old.clear()
    self.raising = False

  def check(self) -> None:
    """Raises Stopped when a signal has arrived (for start-up code that records only)."""
    if self.received is not None:
      raise Stopped(self.received)


# How often a stop that arrived during an import checks whether the import has finished.
RETRY_SECONDS = 0.02


def _importing(frame) -> bool:
  while frame is not None:
    if frame.f_code.co_filename.startswith("<frozen importlib"):
      return True
    frame = frame.f_back
  return False


FLAG = Flag()


def install() -> Flag:
  """The CLI's first act, at import: handlers that record a signal. Returns FLAG.

  The CLI's main() then arms them (`arm()`), once it can write a `stopped` status.
  """
  FLAG.install(raising=False)
  return FLAG


def arm() -> None:
  """From now until the loop takes over, a stop signal raises Stopped; one that arrived
  before (while the CLI was still importing) raises it here.

  Raises:
    Stopped: a signal has already arrived.
  """
  FLAG.raising = True
  if FLAG.received is not None:
    FLAG.raising = False
    raise Stopped(FLAG.received)


@contextlib.contextmanager
def deferred() -> Iterator[Flag]:
  """The training loop's block: a signal only sets FLAG.received, read at step boundaries.

  Installs the handlers when nobody has (the Python API), and restores them after;
  when the CLI installed them, they stay installed and recording after the block, so a
  signal after the run has ended does not turn a finished run into a stopped one.

  Yields:
    FLAG; `FLAG.received` is the first stop signal (a number) or None.
  """
  mine = FLAG.install(raising=False)
  FLAG.raising = False
  try:
    yield FLAG
  finally:
    if mine:
      FLAG.restore()

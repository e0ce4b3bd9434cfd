"""The stop signals (SIGTERM, SIGINT, SIGHUP): which arrived first, from the first instruction.

The CLI installs the handlers before it imports anything slow (`install()`). Until the
training loop takes its first step (`loop_started()`), a signal stops start-up at once: the
handler raises `Stopped`, which the CLI turns into status `stopped` and exit 128 + n. While
the loop runs, a signal only sets `FLAG.received`, which the loop reads at step boundaries,
so the step in flight and the checkpoint finish first.

A Python handler runs only when the main thread runs Python: an XLA compile of 40 s would
hold it back for 40 s. So the CLI also has a watchdog (`watch()`): a thread woken by the
signal itself (through `signal.set_wakeup_fd`) that, when start-up has not taken the stop
within GRACE_SECONDS, abandons the compile: it writes what the CLI writes and ends the
process. Start-up has written nothing a stop could leave half done.

Nothing here imports more than the standard library, and little of it before install(): it
runs before everything else. Before the interpreter reaches this module (its own start-up,
about 0.1 s), a Ctrl-C is Python's.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
from collections.abc import Callable, Iterator

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
    self.taken = threading.Event()  # set when start-up has raised Stopped
    self._old: dict[int, object] = {}
    self._old_hook = None

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
    # half-initialised and crash the interpreter (SIGSEGV), and one raised in a garbage
    # collector's callback (jax keeps one) or a finalizer is printed and dropped, the run
    # going on as if no stop had come; the stop then waits for it to finish, polling with
    # a short timer.
    if _not_here(frame):
      signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
      return
    self.raising = False  # a second signal while start-up unwinds is only recorded
    self.taken.set()
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
    self.taken.clear()
    for s in SIGNALS:
      old = signal.getsignal(s)
      self._old[s] = old
      if old is not signal.SIG_IGN:
        signal.signal(s, self._handle)
    self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._retry)
    self._old_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
    signal.pthread_sigmask(signal.SIG_UNBLOCK, list(SIGNALS))
    return True

  def _unraisable(self, unraisable) -> None:
    # A Stopped raised where Python can only print and drop an exception (a weakref callback
    # run by a collection, whose frame looks like any other; a finalizer): the stop is armed
    # again and raised from the next place that can raise it.
    if isinstance(unraisable.exc_value, Stopped) and self.received is not None:
      self.raising = True
      self.taken.clear()
      signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
      return
    (self._old_hook or sys.__unraisablehook__)(unraisable)

  def restore(self) -> None:
    """Puts back the handlers that were there before install()."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old.clear()
    if self._old_hook is not None and sys.unraisablehook == self._unraisable:
      sys.unraisablehook = self._old_hook
    self._old_hook = None
    self.raising = False

  def check(self) -> None:
    """Raises Stopped when a signal has arrived (for start-up code that records only)."""
    if self.received is not None:
      self.taken.set()
      raise Stopped(self.received)


# How often a stop that arrived during an import checks whether the import has finished.
RETRY_SECONDS = 0.02


def _not_here(frame) -> bool:
  """Whether an exception raised at `frame` would crash the interpreter or be dropped: inside
  an import, a garbage collector's callback or a finalizer (`__del__`)."""
  callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    code = frame.f_code
    if (code.co_filename.startswith("<frozen importlib") or code in callbacks
        or code.co_name == "__del__"):
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
    FLAG.taken.set()
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
  mine = FLAG.install(raising=False)  # armed by the CLI, it raises until loop_started()
  try:
    yield FLAG
  finally:
    if mine:
      FLAG.restore()


def loop_started() -> None:
  """The loop is about to take its first step: from now a stop signal is only recorded and
  the loop stops at a step boundary, with a checkpoint (or at once, if one came before)."""
  FLAG.raising = False


def handed_over() -> None:
  """A command that handles the stop signals itself (`sweep` forwards them to its points and
  then prints its table) takes them from here: start-up's handler no longer raises, and the
  watchdog no longer ends the process."""
  FLAG.raising = False


# --- the watchdog: a stop while the main thread is inside a long native call -------------------

# Seconds a stop signal may wait for start-up's own handler before the watchdog ends the run.
GRACE_SECONDS = 0.2


def watch(abandon: Callable[[int], None], grace: float = GRACE_SECONDS) -> bool:
  """Starts the watchdog thread (main thread only, after install()).

  Args:
    abandon: called with the signal's number, from the watchdog thread, when start-up has
      not taken a stop within `grace` seconds of it; it must end the process (os._exit).
    grace: those seconds.

  Returns:
    Whether it started (False off the main thread or when it already runs).
  """
  if _WATCH or threading.current_thread() is not threading.main_thread():
    return False
  import socket  # pylint: disable=import-outside-toplevel  (here, not before install())
  r, w = socket.socketpair()
  r.setblocking(True)
  w.setblocking(False)
  try:
    _WATCH["old_fd"] = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
  except ValueError:
    return False
  _WATCH.update(read=r, write=w)

  def run() -> None:
    while True:
      try:
        data = r.recv(64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum in SIGNALS and FLAG.raising and not FLAG.taken.wait(grace) and FLAG.raising:
          FLAG.raising = False  # the main thread, should it come back, only records it
          abandon(FLAG.received if FLAG.received is not None else signum)
          return

  threading.Thread(target=run, name="sexpgpu-stop-watchdog", daemon=True).start()
  return True


_WATCH: dict = {}


def stop_line(name: str, step: int | None, checkpoint: str | None,
              located: bool | None) -> str:
  """A stop's last line on standard error.

  `stopped: SIGINT at step 12; checkpoint runs/x/12; continue with --resume latest`, or
  `...; no checkpoint location: nothing saved`, or, before the run knew where it would
  save, `stopped: SIGINT during start-up; nothing saved`.

  Args:
    name: the signal's name.
    step: the step the run stopped at (None: start-up, before it was known).
    checkpoint: the newest complete checkpoint, or None.
    located: whether the run had a checkpoint location (None: not known yet).
  """
  if checkpoint is not None:
    from sexpgpu.ckpt.where import scrub  # pylint: disable=import-outside-toplevel
    return (f"stopped: {name} at step {step or 0}; checkpoint {scrub(checkpoint)}; "
            "continue with --resume latest")
  if step is None or located is None:
    return f"stopped: {name} during start-up; nothing saved"
  if not located:
    return f"stopped: {name} at step {step}; no checkpoint location: nothing saved"
  return f"stopped: {name} at step {step}; no checkpoint yet: nothing saved"


# What start-up has learnt that a stop's line says: the step it starts at, the checkpoint it
# resumes from, whether it has a checkpoint location (the loop fills it; see stop_line).
START: dict = {"step": None, "checkpoint": None, "located": None}


def starting(step_dir: str | None, located: bool) -> None:
  """Records what a stop during start-up will say: the step folder a resume starts from
  (its name is its step; None for a fresh run, at step 0) and whether there is a location."""
  name = (step_dir or "").rstrip("/").rsplit("/", 1)[-1]
  START.update(step=int(name) if name.isdigit() else 0, checkpoint=step_dir, located=located)


def startup_line(name: str) -> str:
  """The stop line of a stop during start-up, from what START holds."""
  return stop_line(name, START["step"], START["checkpoint"], START["located"])

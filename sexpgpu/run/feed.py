"""Batches ahead: the next steps' batches drawn and placed on the devices while a step runs."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

# Steps drawn ahead of the one running (the memory plan counts them on the device).
DEPTH = 2


class Feeder:
  """Draws step batches in a background thread into a bounded queue.

  `draw()` advances the loader exactly as the loop would have (so a loader's
  position, and hence resume, is unchanged) and returns (host batches, info),
  where info carries what the loop needs about that step (the loader's state
  after it, records, tokens). `place(host)` puts them on the devices. An error
  in either is raised by the `get()` that would have returned that step, as
  it would have been raised without the thread.

  With `ahead=False` nothing runs in the background: `get()` draws and places.
  """

  def __init__(self, draw: Callable[[], tuple[Any, Any]], place: Callable[[Any], Any],
               limit: int, ahead: bool = True, depth: int = DEPTH):
    """Args: draw, place: as above; limit: steps to draw at most (the run's remaining
    steps); ahead: draw in the background; depth: steps drawn ahead at most."""
    self._draw = draw
    self._left = limit
    self._place = place
    self.ahead = ahead
    self.waited = 0.0  # seconds get() spent waiting for a batch
    self.lock = threading.Lock()  # held while the loader is used; passes take it too
    self._q: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = None
    if ahead:
      self._thread = threading.Thread(target=self._work, name="sexpgpu-feed", daemon=True)
      self._thread.start()

  def _one(self):
    with self.lock:
      host, info = self._draw()
    return self._place(host), info

  def _work(self) -> None:
    while not self._stop.is_set() and self._left > 0:
      self._left -= 1
      try:
        item = ("ok", self._one())
      except BaseException as e:  # pylint: disable=broad-except
        item = ("error", e)
      while not self._stop.is_set():
        try:
          self._q.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[0] == "error":
        return

  def ready(self) -> bool:
    """Whether get() would return without waiting on the loader."""
    return not self.ahead or not self._q.empty()

  def get(self) -> tuple[Any, Any]:
    """The next step's (placed batches, info); waits when the loader is behind."""
    t = time.perf_counter()
    try:
      if not self.ahead:
        return self._one()
      kind, value = self._q.get()
      if kind == "error":
        raise value
      return value
    finally:
      self.waited += time.perf_counter() - t

  def close(self) -> None:
    """Stops the thread; batches drawn ahead are dropped (the caller rewinds the loader)."""
    if self._thread is None:
      return
    self._stop.set()
    while self._thread.is_alive():
      try:
        while True:
          self._q.get_nowait()
      except queue.Empty:
        pass
      self._thread.join(timeout=0.05)
    self._thread = None

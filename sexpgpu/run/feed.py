"""Batches ahead: the next steps' batches drawn and placed on the devices while a step runs."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import numpy as np

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
               limit: int, ahead: bool = True, depth: int = DEPTH,
               lock: threading.Lock | None = None):
    """Args: draw, place: as above; limit: steps to draw at most (the run's remaining
    steps); ahead: draw in the background; depth: steps drawn ahead at most; lock: the
    lock held while the loader is used (default a new one)."""
    self._draw = draw
    self._left = limit
    self._place = place
    self.ahead = ahead
    self.waited = 0.0  # seconds get() spent waiting for a batch
    self.lock = lock or threading.Lock()  # held while the loader is used; passes take it too
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


class Feed:
  """The loop's batches: the stage's loader drawn ahead by a Feeder, and every loader's
  state as of the last step trained on (what a checkpoint records, and where a loader goes
  back to when batches drawn ahead are dropped).
  """

  def __init__(self, c, place, k: int, steps: int, ahead: bool):
    """Args: c: the Compiled experiment; place: the run's Placement; k: microbatches a
    step; steps: the run's last step; ahead: draw in a background thread."""
    self.c, self.place, self.k, self.steps, self.ahead = c, place, k, steps, ahead
    self.states = {n: ld.state() for n, ld in c.loaders.items()}
    self._feeder: Feeder | None = None
    self.lock = threading.Lock()  # held while a loader is used; a pass takes it too

  def start(self, stage: int, step: int) -> None:
    """Draws the stage's batches for the steps after `step`."""
    name = self.c.stages[stage].data
    loader = self.c.loaders[name]
    self._feeder = Feeder(lambda: draw(loader, name, self.k, self.place),
                          lambda host: self.place.shard(host, self.k), self.steps - step,
                          ahead=self.ahead, lock=self.lock)

  def ready(self) -> bool:
    """Whether get() would return without waiting on the loader."""
    return self._feeder.ready()

  def get(self) -> tuple[Any, dict]:
    """The next step's placed batches and what the loop needs about them (with `wait`, the
    seconds this step's batches kept the loop waiting)."""
    waited = self._feeder.waited
    batches, info = self._feeder.get()
    info["wait"] = self._feeder.waited - waited
    return batches, info

  def trained(self, info: dict) -> None:
    """A step drawn from `info["loader"]` has been trained on: its state is the loader's."""
    self.states[info["loader"]] = info["state"]

  def close(self) -> None:
    """Stops drawing; batches drawn ahead are dropped (rewind() draws them again)."""
    if self._feeder is not None:
      self._feeder.close()

  def rewind(self) -> None:
    """Stops drawing and puts the loaders back to the states of the steps trained on."""
    self.close()
    for n, st in self.states.items():
      self.c.loaders[n].set_state(st)

  def restart(self, stage: int, step: int) -> None:
    """From a new curriculum stage on: its loader, from the steps after `step`."""
    self.rewind()
    self.start(stage, step)


def draw(loader, name: str, k: int, place) -> tuple[dict, dict]:
  """One step's microbatches from the loader, stacked on the host, and what the loop needs."""
  if not place.multiprocess:
    mbs = [loader.next() for _ in range(k)]
  else:  # this process's share; every node's loader moves past the whole step
    base = loader.position
    mbs = [loader.batch(base + j) for j in place.local_share(k)]
    st = loader.state()
    st["position"] = base + k
    loader.set_state(st)
  host = {f: np.stack([b[f] for b in mbs]) for f in mbs[0]}
  tokens = None
  if hasattr(loader, "count_tokens"):  # a packed loader: padding is not a token
    # (several nodes: this process's share, scaled to the step)
    tokens = sum(loader.count_tokens(b) for b in mbs) * k // len(mbs)
  elif "tokens" in mbs[0]:
    tokens = k * int(mbs[0]["tokens"].size)
  return host, {"loader": name, "state": loader.state(), "records": k * loader.batch_size,
                "tokens": tokens}

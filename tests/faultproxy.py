"""A TCP proxy on 127.0.0.1 in front of moto whose connection can be cut for a while.

`OutageProxy(upstream_port)` forwards every connection. `cut(seconds)` closes the open
connections and refuses new ones (accepted, then closed at once) until the time has
passed; `cut_at(request, nth, seconds)` does the same the nth time a request line matches,
before that request reaches the server, so a test can cut at a known save.
"""

from __future__ import annotations

import re
import socket
import threading
import time


class OutageProxy:
  """A forwarder to 127.0.0.1:upstream with outages on demand."""

  def __init__(self, upstream_port: int):
    self.upstream = upstream_port
    self.sock = socket.create_server(("127.0.0.1", 0))
    self.port = self.sock.getsockname()[1]
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self._lock = threading.Lock()
    self._conns: list[socket.socket] = []
    self._down_until = 0.0
    self._trigger: tuple[re.Pattern, int, float] | None = None
    self._seen = 0
    self.cuts: list[tuple[float, float]] = []  # (start, seconds) of each outage
    self.refused = 0
    threading.Thread(target=self._accept, daemon=True).start()

  @property
  def down(self) -> bool:
    """Whether an outage is in progress."""
    return time.monotonic() < self._down_until

  def cut(self, seconds: float) -> None:
    """Starts an outage of `seconds`: open connections die, new ones are closed at once."""
    with self._lock:
      self._down_until = time.monotonic() + seconds
      self.cuts.append((time.monotonic(), seconds))
      conns, self._conns = self._conns, []
    for s in conns:
      _close(s)

  def cut_at(self, request: bytes, nth: int, seconds: float) -> None:
    """Cuts for `seconds` when a request line matches the regex `request` for the nth time
    (from now), before that request reaches the server."""
    with self._lock:
      self._trigger, self._seen = (re.compile(request), nth, seconds), 0

  def heal(self) -> None:
    """Ends an outage now."""
    self._down_until = 0.0

  def close(self) -> None:
    """Stops listening and closes every connection."""
    _close(self.sock)
    self.cut(0)

  def _accept(self) -> None:
    while True:
      try:
        client, _ = self.sock.accept()
      except OSError:
        return
      if self.down:
        self.refused += 1
        _close(client)
        continue
      try:
        server = socket.create_connection(("127.0.0.1", self.upstream))
      except OSError:
        _close(client)
        continue
      with self._lock:
        self._conns += [client, server]
      threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
      threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

  def _fires(self, data: bytes) -> bool:
    with self._lock:
      if self._trigger is None or not self._trigger[0].search(data.split(b"\r\n", 1)[0]):
        return False
      self._seen += 1
      if self._seen < self._trigger[1]:
        return False
      seconds = self._trigger[2]
      self._trigger = None
    self.cut(seconds)
    return True

  def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
    try:
      while data := src.recv(1 << 16):
        if self.down or (up and self._fires(data)):
          break
        dst.sendall(data)
    except OSError:
      pass
    finally:
      _close(src)
      _close(dst)


def _close(s: socket.socket) -> None:
  try:
    s.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
  try:
    s.close()
  except OSError:
    pass

"""A moto S3 server on 127.0.0.1 for tests (conftest's `moto_endpoint` runs one per session):
moto_server(), make_bucket(), bucket_fs() and s3_env(endpoint)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def s3_env(endpoint: str) -> dict[str, str]:
  """The environment variables that point AWS clients at `endpoint` with test credentials.

  Args:
    endpoint: the server's URL, such as http://127.0.0.1:5000.

  Returns:
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION and AWS_ENDPOINT_URL.
  """
  return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


def make_bucket(endpoint: str, bucket: str) -> str:
  """`bucket` made on the server at `endpoint` unless it is there; returns `endpoint`."""
  import s3fs  # pylint: disable=import-outside-toplevel
  fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="testing",
                         secret="testing", skip_instance_cache=True)
  if not fs.exists(bucket):
    fs.mkdir(bucket)
  return endpoint


def bucket_fs(endpoint: str, bucket: str, monkeypatch):
  """An s3fs filesystem on the moto server holding `bucket`, with this test's environment
  pointing at the server (credentials and endpoint, as a run would read them)."""
  import s3fs  # pylint: disable=import-outside-toplevel
  for key, value in s3_env(endpoint).items():
    monkeypatch.setenv(key, value)
  fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
  if not fs.exists(bucket):
    fs.mkdir(bucket)
  return fs


@contextlib.contextmanager
def moto_server(timeout: float = 20.0) -> Iterator[str]:
  """Runs `python -m moto.server` on a free port of 127.0.0.1.

  Args:
    timeout: seconds to wait for the server to answer.

  Yields:
    The endpoint URL, such as http://127.0.0.1:5000.

  Raises:
    RuntimeError: when the server does not answer within `timeout`.
  """
  port = free_port()
  endpoint = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen(
      [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      env={**os.environ, **s3_env(endpoint)})
  try:
    _wait(proc, endpoint, timeout)
    yield endpoint
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _wait(proc: subprocess.Popen, endpoint: str, timeout: float) -> None:
  deadline = time.monotonic() + timeout
  opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"moto server exited with status {proc.returncode}")
    try:
      with opener.open(endpoint + "/moto-api/", timeout=1):
        return
    except urllib.error.HTTPError:
      return  # it answers, even if with an error status
    except OSError:
      time.sleep(0.1)
  raise RuntimeError(f"moto server at {endpoint} did not answer within {timeout}s")


class KillableProxy:
  """A TCP forwarder to the moto server that can be killed mid-transfer."""

  def __init__(self, upstream_port: int):
    self.upstream = upstream_port
    self.sock = socket.create_server(("127.0.0.1", 0))
    self.port = self.sock.getsockname()[1]
    self.conns: list[socket.socket] = []
    self.sent = 0
    self.dead = False
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try:
        client, _ = self.sock.accept()
      except OSError:
        return
      if self.dead:
        client.close()
        return
      server = socket.create_connection(("127.0.0.1", self.upstream))
      self.conns += [client, server]
      threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
      threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

  def _pump(self, src, dst, up):
    try:
      while (data := src.recv(1 << 16)) and not self.dead:
        dst.sendall(data)
        if up:
          self.sent += len(data)
    except OSError:
      pass
    finally:
      for s in (src, dst):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass
        s.close()

  def kill(self):
    """Closes the listening socket and every connection: the server is gone."""
    self.dead = True
    try:
      self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
    except OSError:
      pass
    self.sock.close()
    for s in self.conns:
      try:
        s.shutdown(socket.SHUT_RDWR)
        s.close()
      except OSError:
        pass

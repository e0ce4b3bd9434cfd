"""A moto S3 server on 127.0.0.1 for tests: moto_server() and s3_env(endpoint)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
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

"""Shared test setup: a private cache dir so tests never touch the user's."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The suite compiles hundreds of small programs, and XLA's backend optimization (LLVM's
# passes) is half of each CPU compile: 7.9 s -> 3.8 s for tiny-lm's kernels. No test checks
# what it changes (the speed of the code, a last digit of a sum), so it is off here, for
# this process and the runs it starts; the benchmark test turns it back on (BENCH_XLA_FLAGS).
FAST_COMPILE = "--xla_backend_optimization_level=0"
# the flags as the user's runs have them: a pytest-xdist worker inherits the controller's
# XLA_FLAGS with FAST_COMPILE already in them, so it is taken out by name
BENCH_XLA_FLAGS = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                           if f != FAST_COMPILE)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (BENCH_XLA_FLAGS + " " + FAST_COMPILE).strip()


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
  """Each worker its own sexpgpu cache (choices, links), and one XLA cache for the whole
  session, shared by both workers and every run they start (JAX_COMPILATION_CACHE_DIR):
  most modules compile the same few smoke programs, and a compile is most of a short run."""
  os.environ.setdefault("SEXPGPU_CACHE_DIR", str(tmp_path_factory.mktemp("sexpgpu-cache")))
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(shared / "xla-cache"))
  yield


def sexpgpu_cmd(*args):
  """The command line that runs the installed CLI with this interpreter."""
  return [sys.executable, "-m", "sexpgpu.cli.main", *args]


@pytest.fixture(scope="session")
def moto_endpoint():
  """One moto S3 server on 127.0.0.1 for the whole session; yields its endpoint URL."""
  from s3server import moto_server
  with moto_server() as endpoint:
    yield endpoint


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch, request):
  """A fresh bucket on the session's moto server, named after the test, with this test's
  environment pointing at the server as a run reads it (credentials, endpoint).

  Yields:
    (its name, an s3fs filesystem on the server).
  """
  from s3server import bucket_fs
  monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
  monkeypatch.delenv("AWS_PROFILE", raising=False)
  name = "t-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())
  name = name[:60].strip("-")
  yield name, bucket_fs(moto_endpoint, name, monkeypatch)

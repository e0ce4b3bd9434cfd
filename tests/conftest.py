"""Shared test setup: a private cache dir so tests never touch the user's."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
  os.environ.setdefault("SEXPGPU_CACHE_DIR", str(tmp_path_factory.mktemp("sexpgpu-cache")))
  yield


def sexpgpu_cmd(*args):
  """The command line that runs the installed CLI with this interpreter."""
  return [sys.executable, "-m", "sexpgpu.cli.main", *args]

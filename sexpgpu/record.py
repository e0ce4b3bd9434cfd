"""What a run records of itself wherever it writes (the config event, a checkpoint's meta, an
exported file's metadata): the versions it ran with, and knob values as JSON.

It imports nothing of sexpgpu, so every layer that writes a record can use it.
"""

from __future__ import annotations

import platform
from typing import Any


def jsonable(v: Any) -> Any:
  """A knob value as JSON: numbers and booleans as they are, anything else as text."""
  if isinstance(v, (bool, int, float)) or v is None:
    return v
  return str(v)


def versions() -> dict:
  """The versions of sexpgpu, jax, jaxlib and Python."""
  import jax
  import jaxlib
  return {"sexpgpu": sexpgpu_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": platform.python_version()}


def sexpgpu_version() -> str:
  """sexpgpu's installed version, or "source" when it is imported from a checkout that was
  never installed (PYTHONPATH pointing at it): a run records that rather than failing."""
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("sexpgpu")
  except PackageNotFoundError:
    return "source"

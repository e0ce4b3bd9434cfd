"""Flags merged with SEXPGPU_* variables (flags win); bad variables are E-ENV-001."""

from __future__ import annotations

import os

from sexpgpu.errors import SxError
from sexpgpu.run.loop import RunOptions


def _env(name: str) -> str | None:
  v = os.environ.get(name)
  return v if v not in (None, "") else None


def stacking_from_env() -> int | None:
  """SEXPGPU_STACKING: `auto` (None) or a fixed degree."""
  v = _env("SEXPGPU_STACKING")
  if v is None or v == "auto":
    return None
  try:
    n = int(v)
  except ValueError:
    n = 0
  if n < 1:
    raise SxError("E-ENV-001", f"SEXPGPU_STACKING={v} is not `auto` or a positive integer",
                  where="SEXPGPU_STACKING", fix="SEXPGPU_STACKING=auto or SEXPGPU_STACKING=2")
  return n


def check_variables() -> None:
  """Every SEXPGPU_* variable that must parse, checked before anything runs (E-ENV-001)."""
  from sexpgpu.devices.env import parse_memory, rendezvous_timeout
  from sexpgpu.run.devices import deterministic
  choices = {"SEXPGPU_PATTERNS": ("on", "off"), "SEXPGPU_CPU_COLLECTIVES": ("gloo",)}
  for name, allowed in choices.items():
    v = _env(name)
    if v is not None and v not in allowed:
      raise SxError("E-ENV-001", f"{name}={v} is not " + " or ".join(allowed), where=name,
                    fix=f"{name}={allowed[-1]}")
  if _env("SEXPGPU_MEMORY") is not None:
    parse_memory(os.environ["SEXPGPU_MEMORY"])
  rendezvous_timeout()
  stacking_from_env()
  deterministic()  # raises, naming the variable


def run_options(path: str, fv) -> RunOptions:
  """The run's options from parsed flags and the environment."""
  device = fv.device or _env("SEXPGPU_DEVICE") or "cpu"
  if device not in ("cpu", "cuda"):
    where = "--device" if fv.device else "SEXPGPU_DEVICE"
    raise SxError("E-ENV-001" if not fv.device else "E-DEV-001",
                  f"device `{device}` is not cpu or cuda", where=where, fix="cpu or cuda")
  check_variables()
  return RunOptions(
      file=path, device=device,
      metrics=fv.metrics if fv.metrics is not None else _env("SEXPGPU_METRICS"),
      status=fv.status if fv.status is not None else _env("SEXPGPU_STATUS"),
      checkpoint_dir=fv.checkpoint_dir if fv.checkpoint_dir is not None
      else _env("SEXPGPU_CHECKPOINT_DIR"),
      resume=fv.resume if fv.resume is not None else _env("SEXPGPU_RESUME"),
      stacking=stacking_from_env(), json=bool(fv.json))

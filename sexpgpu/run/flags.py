"""Flags merged with SEXPGPU_* variables (flags win), each parsed by sexpgpu/env.py."""

from __future__ import annotations

import os

from sexpgpu import env
from sexpgpu.errors import SxError
from sexpgpu.run.loop import RunOptions

_env = env.get


def init_from_sets(flag: str | None, sets: list[tuple[str, str]]) -> list[tuple[str, str]]:
  """`--init-from` (else SEXPGPU_INIT_FROM) as a `--set init-from=...` put first, so that
  the knob enters the slug as a --set does and a `--set init-from=` given too wins."""
  value = flag if flag not in (None, "") else _env("SEXPGPU_INIT_FROM")
  return ([("init-from", value)] if value else []) + list(sets)


def stacking_from_env() -> int | None:
  """SEXPGPU_STACKING: `auto` (None) or a fixed degree."""
  return env.parse_stacking(_env("SEXPGPU_STACKING"))


# flags whose variable the parsers check on their own: flag → the variable it overrides
_OVERRIDES = (("metrics", "SEXPGPU_METRICS"), ("device", "SEXPGPU_DEVICE"))


def check_variables(device: str | None = None, overridden: tuple[str, ...] = ()) -> None:
  """Every SEXPGPU_* variable that must parse, checked before anything runs.

  The parsers are sexpgpu/env.py's, the ones `doctor` reports with. A variable
  that a flag overrides (`overridden`) is not read, so not checked.
  """
  env.check_variables({k: v for k, v in os.environ.items() if k not in overridden}, device)


def run_options(path: str, fv) -> RunOptions:
  """The run's options from parsed flags and the environment."""
  device = (env.parse_device(fv.device, "--device") if fv.device
            else env.parse_device(_env("SEXPGPU_DEVICE")))
  check_variables(device, tuple(var for flag, var in _OVERRIDES if getattr(fv, flag)))
  if fv.resume is None and _env("SEXPGPU_RESUME") == "latest" and not (
      fv.checkpoint_dir or _env("SEXPGPU_CHECKPOINT_DIR")):
    raise SxError("E-CKPT-001", "SEXPGPU_RESUME=latest needs a checkpoint location, and none "
                  "was given", where="SEXPGPU_RESUME",
                  fix="pass --checkpoint-dir DIR (or set SEXPGPU_CHECKPOINT_DIR), or unset "
                  "SEXPGPU_RESUME")
  return RunOptions(
      file=path, device=device,
      metrics=fv.metrics if fv.metrics is not None else _env("SEXPGPU_METRICS"),
      metrics_where="--metrics" if fv.metrics is not None else "SEXPGPU_METRICS",
      status=fv.status if fv.status is not None else _env("SEXPGPU_STATUS"),
      checkpoint_dir=fv.checkpoint_dir if fv.checkpoint_dir is not None
      else _env("SEXPGPU_CHECKPOINT_DIR"),
      resume=fv.resume if fv.resume is not None else _env("SEXPGPU_RESUME"),
      stacking=stacking_from_env(), json=bool(fv.json), **_profile(fv))


def _profile(fv) -> dict:
  """--profile A..B (SEXPGPU_PROFILE) and --profile-dir (SEXPGPU_PROFILE_DIR)."""
  flag = getattr(fv, "profile", None)
  text, where = (flag, "--profile") if flag is not None else (_env("SEXPGPU_PROFILE"),
                                                              "SEXPGPU_PROFILE")
  folder = getattr(fv, "profile_dir", None)
  folder = folder if folder is not None else _env("SEXPGPU_PROFILE_DIR")
  return {"profile": env.parse_step_range(text, where) if text is not None else None,
          "profile_dir": folder}

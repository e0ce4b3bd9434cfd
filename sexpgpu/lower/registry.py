"""Platform lowering rules, registered per op and platform (as JAX's `mlir.register_lowering`).

An op's reference rule lives in `ir.ops`; a rule registered here replaces it
on one platform ("cpu", "gpu"), or on all of them (platform None), for the
step that runs there.
"""

from __future__ import annotations

from typing import Callable

from sexpgpu.ir.ops import OPS

# (op, platform or None for every platform) → rule(ctx, *inputs, **attrs)
_RULES: dict[tuple[str, str | None], Callable] = {}

# The names devices report for one kind of platform.
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def platform_name(platform: str | None) -> str | None:
  """The registry's name of a device's platform ("cuda" → "gpu"), None kept."""
  return None if platform is None else _ALIASES.get(platform, platform)


def register_lowering(op: str, rule: Callable, platform: str | None = None) -> Callable:
  """Registers `rule(ctx, *inputs, **attrs)` as op's lowering on `platform` (None: all).

  Raises:
    ValueError: op is not in the IR's table, or already has a rule there.
  """
  if op not in OPS:
    raise ValueError(f"no op {op} to lower")
  key = (op, platform_name(platform))
  if key in _RULES:
    raise ValueError(f"op {op} has a lowering on {platform or 'every platform'} already")
  _RULES[key] = rule
  return rule


def lowering(op: str, platform: str | None) -> Callable:
  """The rule that lowers `op` on `platform`: its own, else every platform's, else the reference."""
  platform = platform_name(platform)
  rule = _RULES.get((op, platform)) if platform is not None else None
  return rule or _RULES.get((op, None)) or OPS[op].lower


def registered() -> dict[tuple[str, str | None], Callable]:
  """A copy of the table: (op, platform) → rule."""
  return dict(_RULES)

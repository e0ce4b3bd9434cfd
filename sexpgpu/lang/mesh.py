"""A mesh of named axes as `:sharding` writes it (`fsdp:2,tensor:2`), parsed and checked
against the run's devices; the layouts themselves are sexpgpu/lower/layouts.py's."""

from __future__ import annotations

import math
import re

from sexpgpu.errors import SxError

AXES = ("data", "fsdp", "tensor", "expert")
AUTO = "auto"  # the plan chooses the mesh (sexpgpu/run/planning/layout_plan.py)
_MESH = re.compile(r"[a-z]+:\d+(,[a-z]+:\d+)*")


def is_auto(text: str) -> bool:
  """Whether `:sharding` is `auto`: a mesh the plan chooses before the steps are built."""
  return str(text) == AUTO


def is_mesh(text: str) -> bool:
  """Whether `text` is written as a mesh (`tensor:4`, `fsdp:2,tensor:2`) or is `auto`, the
  mesh the plan chooses."""
  return bool(_MESH.fullmatch(str(text))) or is_auto(text)


def parse_mesh(text: str, where: str | None = None, loc=None) -> tuple[tuple[str, int], ...]:
  """The mesh's (axis, size) pairs in the order written (none for `auto`).

  Raises:
    SxError: E-KNOB-003 naming an unknown or repeated axis, or a size below 1.
  """
  out: list[tuple[str, int]] = []
  if is_auto(text):  # chosen later, on the run's devices: no axis yet
    return ()
  for part in str(text).split(","):
    name, size = part.split(":")
    if name not in AXES:
      raise SxError("E-KNOB-003", f"`{name}` in :sharding {text} is not a mesh axis",
                    where=where, location=loc,
                    fix="write axes among " + ", ".join(AXES) + ", like fsdp:2,tensor:2")
    if any(n == name for n, _ in out):
      raise SxError("E-KNOB-003", f"axis `{name}` appears twice in :sharding {text}",
                    where=where, location=loc, fix="write each axis once")
    if int(size) < 1:
      raise SxError("E-KNOB-003", f"axis `{name}` has size {size} in :sharding {text}",
                    where=where, location=loc, fix="give each axis a size of 1 or more")
    out.append((name, int(size)))
  return tuple(out)


def check_devices(text: str, devices: int) -> tuple[tuple[str, int], ...]:
  """The mesh of `text`, checked against the run's devices (all its nodes', node-major).

  Raises:
    SxError: E-KNOB-003 when its product is not the device count (naming the sizes that
      are).
  """
  if is_auto(text):
    raise SxError("E-KNOB-003", ":sharding auto reached the steps unchosen: this path builds "
                  "a run's steps without the layout plan", where="--set sharding=auto",
                  fix="choose a layout (--set sharding=fsdp, or a mesh like fsdp:2,tensor:2); "
                  "`sexpgpu check FILE --print plan --set sharding=auto` prints the plan's "
                  "choice")
  mesh = parse_mesh(text, where=f"--set sharding={text}")
  product = math.prod(s for _, s in mesh)
  if product != devices:
    raise SxError("E-KNOB-003", f"the mesh {text} has {product} devices; the run has "
                  f"{devices}", where=f"--set sharding={text}",
                  fix=f"write axes whose sizes multiply to {devices}, like "
                  f"tensor:{devices} or fsdp:{devices}")
  return mesh

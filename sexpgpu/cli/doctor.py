"""`sexpgpu doctor [--device cuda]`: checks the floor, one line per check; exit 1 on a fail."""

from __future__ import annotations

import os

from absl import flags

from sexpgpu.errors import SxError


def cmd_doctor(argv: list[str]) -> int:
  """The doctor command: absl flags, then sexpgpu.devices.doctor.doctor."""
  from sexpgpu.cli.main import _parse
  from sexpgpu.devices.doctor import doctor
  fv = flags.FlagValues()
  flags.DEFINE_string("device", None, "cpu (default) or cuda (SEXPGPU_DEVICE)", flag_values=fv)
  rest = _parse(fv, argv, "doctor")
  if rest:
    raise SxError("E-FORM-001", f"sexpgpu doctor takes no file, given {' '.join(rest)}",
                  where="the command line", fix="sexpgpu doctor --device cuda")
  device = fv.device or os.environ.get("SEXPGPU_DEVICE") or "cpu"
  if device not in ("cpu", "cuda"):
    raise SxError("E-DEV-001" if fv.device else "E-ENV-001", f"device `{device}` is not cpu or "
                  "cuda", where="--device" if fv.device else "SEXPGPU_DEVICE", fix="cpu or cuda")
  return doctor(device)


COMMANDS = {"doctor": cmd_doctor}

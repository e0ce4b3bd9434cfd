"""`sexpgpu doctor [--device cuda]`: checks the floor, one line per check; exit 1 on a fail.

The machine's checks are `sexpgpu.devices.doctor`'s; the checkpoint location's are here,
above the packages they open (ckpt), so that devices/ imports nothing of them.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping

from absl import flags

from sexpgpu import env
from sexpgpu.errors import SxError

# Every command's start reads this module's COMMANDS: what the checks need (fsspec, orbax)
# is imported when the doctor runs, inside the functions below.


def check_checkpoints(environ: Mapping[str, str]) -> list:
  """SEXPGPU_CHECKPOINT_DIR: its endpoint answers (s3://), and a store there can be written
  and, when local, read back."""
  from sexpgpu.ckpt.store import CheckpointStore
  from sexpgpu.ckpt.where import is_remote, scrub
  from sexpgpu.devices.doctor import Check, check_endpoint, from_error
  loc = env.get("SEXPGPU_CHECKPOINT_DIR", environ)
  if not loc:
    return [Check("ok", "checkpoints", "SEXPGPU_CHECKPOINT_DIR unset: none written")]
  out = []
  if loc.startswith("s3://"):
    out.append(check_endpoint(environ))
    if out[-1].status == "fail":
      return out
  try:
    # Closed before the read-back removes the probe folder: the store's lock lives in it.
    with CheckpointStore(loc, ".sexpgpu-doctor", 1, where="SEXPGPU_CHECKPOINT_DIR") as store:
      store.check_writable()
    if not is_remote(loc):
      _read_back(store.run_dir)
  except SxError as e:
    out.append(from_error("checkpoints", e))
    return out
  except OSError as e:
    out.append(Check("fail", "checkpoints", f"{scrub(loc)} cannot be read back ({e})",
                     "a checkpoint location this user can write and read"))
    return out
  out.append(Check("ok", "checkpoints", f"{scrub(loc)} writable and readable"))
  return out


def _read_back(folder: str) -> None:
  path = os.path.join(folder, ".probe-read")
  try:
    with open(path, "wb") as f:
      f.write(b"probe")
    with open(path, "rb") as f:
      if f.read() != b"probe":
        raise OSError("read back differs")
  finally:
    try:
      os.remove(path)
      os.rmdir(folder)
    except OSError:
      pass


def run_checks(device: str = "cpu", environ: Mapping[str, str] | None = None) -> list:
  """Every check (devices.doctor.Check), in the order printed.

  Args:
    device: "cpu" (GPU findings are warnings) or "cuda" (they fail).
    environ: the environment (default os.environ).
  """
  from sexpgpu.devices.doctor import (check_cache, check_cudnn, check_devices, check_driver,
                                      check_gpus, check_jax, check_lib, check_nodes,
                                      check_plugin, check_python, check_variables)
  environ = os.environ if environ is None else environ
  checks = [check_python(), *check_jax(), check_plugin(device), check_driver(device),
            *check_gpus(device), check_cudnn(device), check_lib(device, "nvrtc", "libnvrtc"),
            check_lib(device, "cublas", "libcublas"), check_devices(device, environ),
            *check_nodes(device, environ), *check_variables(environ), check_cache(environ),
            *check_checkpoints(environ)]
  return checks


def doctor(device: str = "cpu", environ: Mapping[str, str] | None = None,
           write: Callable[[str], None] | None = None) -> int:
  """Runs every check and prints one line each; returns 0 when nothing fails, else 1."""
  write = write or (lambda line: (sys.stdout.write(line + "\n"), sys.stdout.flush()))
  failed = False
  for c in run_checks(device, environ):
    write(c.line())
    failed |= c.status == "fail"
  return 1 if failed else 0


def cmd_doctor(argv: list[str]) -> int:
  """The doctor command: absl flags, then doctor()."""
  from sexpgpu.cli.main import parse_flags
  fv = flags.FlagValues()
  flags.DEFINE_string("device", None, "cpu (default) or cuda (SEXPGPU_DEVICE)", flag_values=fv)
  rest = parse_flags(fv, argv, "doctor")
  if rest:
    raise SxError("E-FORM-001", f"sexpgpu doctor takes no file, given {' '.join(rest)}",
                  where="the command line", fix="sexpgpu doctor --device cuda")
  device = (env.parse_device(fv.device, "--device") if fv.device
            else env.parse_device(env.get("SEXPGPU_DEVICE")))
  return doctor(device)


COMMANDS = {"doctor": cmd_doctor}

"""The machine's side of `sexpgpu doctor`: Python, JAX, the CUDA plugin, driver, GPUs and
libraries, the SEXPGPU_* variables and the cache folder, one Check each.

The checks of what lies above the devices (the checkpoint location) and the command that
runs them all are `sexpgpu.cli.doctor`'s.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from typing import Mapping

from sexpgpu.devices import env as denv
from sexpgpu.errors import SxError
from sexpgpu.paths import cache_dir

MIN_DRIVER = 580
MIN_CC = (8, 0)
FIX_PLUGIN = 'pip install "sexpgpu[cuda]" (jax[cuda13])'
FIX_DRIVER = "install an NVIDIA driver of the 580 series or newer (CUDA 13)"


@dataclasses.dataclass(frozen=True)
class Check:
  """One doctor line: status (ok, warn, fail), the check's name, what was found, the fix."""

  status: str
  name: str
  detail: str
  fix: str | None = None

  def line(self) -> str:
    """`ok python: 3.12.3`, or with the fix on a fail: `fail cache: ... — fix: ...`."""
    text = f"{self.status} {self.name}: {self.detail}"
    return text + (f" — fix: {self.fix}" if self.fix and self.status == "fail" else "")


def from_error(name: str, e: SxError) -> Check:
  """The fail line of a check that met an SxError: its code, message and fix."""
  return Check("fail", name, f"error[{e.code}] {e.message}", e.fix)


def _gpu_missing(device: str, name: str, detail: str, fix: str) -> Check:
  if device == "cuda":
    return Check("fail", name, detail, fix)
  return Check("warn", name, f"{detail}; no GPU: cuda runs unavailable")


# --- the checks -------------------------------------------------------------------

def check_python() -> Check:
  v = sys.version_info
  ok = v >= (3, 11)
  return Check("ok" if ok else "fail", "python", f"{v.major}.{v.minor}.{v.micro}",
               None if ok else "Python 3.11 or newer")


def check_jax() -> list[Check]:
  out = []
  for mod in ("jax", "jaxlib"):
    try:
      m = __import__(mod)
      out.append(Check("ok", mod, getattr(m, "__version__", "?")))
    except ImportError as e:
      out.append(Check("fail", mod, f"not importable ({e})", "pip install sexpgpu"))
  return out


def _plugin() -> str | None:
  for name in ("jax_cuda13_plugin", "jax_plugins.xla_cuda13"):
    try:
      if importlib.util.find_spec(name) is not None:
        return name
    except (ImportError, ValueError):
      continue
  return None


def check_plugin(device: str) -> Check:
  name = _plugin()
  if name is None:
    return _gpu_missing(device, "cuda plugin", "jax_cuda13 plugin not installed", FIX_PLUGIN)
  try:
    import jax
    n = len(jax.devices("cuda"))
  except RuntimeError as e:
    return Check("fail" if device == "cuda" else "warn", "cuda plugin",
                 f"{name} installed, but the cuda backend does not start ({_first_line(e)})",
                 FIX_DRIVER)
  return Check("ok", "cuda plugin", f"{name}, {n} cuda devices")


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def driver_version() -> str | None:
  """The NVIDIA driver's version (`580.65.06`), from /proc or nvidia-smi, or None."""
  try:
    with open("/proc/driver/nvidia/version", encoding="ascii", errors="replace") as f:
      m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", f.read())
      if m:
        return m.group(1)
  except OSError:
    pass
  out = _smi(["--query-gpu=driver_version", "--format=csv,noheader"])
  return out[0].strip() if out else None


def check_driver(device: str) -> Check:
  v = driver_version()
  if v is None:
    return _gpu_missing(device, "driver", "no NVIDIA driver found", FIX_DRIVER)
  major = int(v.split(".")[0])
  if major < MIN_DRIVER:
    return Check("fail" if device == "cuda" else "warn", "driver",
                 f"{v}, older than the {MIN_DRIVER} series", FIX_DRIVER)
  return Check("ok", "driver", f"{v} (series {major})")


def _smi(args: list[str]) -> list[str] | None:
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return None
  try:
    p = subprocess.run([smi, *args], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  return [ln for ln in p.stdout.splitlines() if ln.strip()] if p.returncode == 0 else None


def gpus() -> list[tuple[str, str, str]]:
  """(name, compute capability, memory) of each visible GPU, from nvidia-smi."""
  rows = _smi(["--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader"]) or []
  out = []
  for row in rows:
    parts = [p.strip() for p in row.split(",")]
    if len(parts) >= 3:
      out.append((parts[0], parts[1], parts[2]))
  cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
  if cvd is not None:
    keep = [int(p) for p in cvd.split(",") if p.strip().isdigit()]
    out = [out[i] for i in keep if i < len(out)]
  return out


def check_gpus(device: str) -> list[Check]:
  found = gpus()
  if not found:
    return [_gpu_missing(device, "gpu", "no GPU visible", "check the driver and "
                         "CUDA_VISIBLE_DEVICES")]
  out = []
  for i, (name, cc, mem) in enumerate(found):
    try:
      major, minor = (int(x) for x in cc.split("."))
    except ValueError:
      major, minor = 0, 0
    if (major, minor) < MIN_CC:
      out.append(Check("fail", f"gpu {i}", f"{name}, compute capability {cc}, {mem}",
                       f"the {name} is below compute capability 8.0 (A100, L4, H100 or newer)"))
    else:
      out.append(Check("ok", f"gpu {i}", f"{name}, compute capability {cc}, {mem}"))
  return out


def _find_lib(stem: str) -> str | None:
  """A CUDA library from the nvidia-* wheels (site-packages/nvidia/...), else the loader's."""
  for base in sys.path:
    for pat in (f"nvidia/*/lib/{stem}.so*", f"nvidia/*/*/lib/{stem}.so*",
                f"nvidia/lib/{stem}.so*"):
      hits = sorted(glob.glob(os.path.join(base, pat)))
      if hits:
        return hits[-1]
  import ctypes.util
  found = ctypes.util.find_library(stem[3:])
  return found


def _load(stem: str):
  path = _find_lib(stem)
  if path is None:
    return None, None
  try:
    return ctypes.CDLL(path), path
  except OSError:
    return None, path


def check_cudnn(device: str) -> Check:
  lib, path = _load("libcudnn")
  if lib is None:  # optional, as the seed says: never a fail
    return Check("warn", "cudnn", "cuDNN not loadable; attention and products run the ordinary "
                 "lowering")
  try:
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    v = int(lib.cudnnGetVersion())
  except AttributeError:
    return Check("warn", "cudnn", f"{path}: no cudnnGetVersion")
  major, minor, patch = v // 10000, (v % 10000) // 100, v % 100
  if major != 9:
    return Check("warn", "cudnn", f"{major}.{minor}.{patch}; fused attention needs 9.x")
  return Check("ok", "cudnn", f"{major}.{minor}.{patch}")


def check_lib(device: str, name: str, stem: str) -> Check:
  lib, path = _load(stem)
  if lib is None:
    return _gpu_missing(device, name, f"{stem} not loadable" + (f" ({path})" if path else ""),
                        FIX_PLUGIN)
  return Check("ok", name, os.path.basename(path or stem))


def check_devices(device: str, environ: Mapping[str, str]) -> Check:
  value = environ.get("SEXPGPU_DEVICES")
  visible = len(gpus()) if device == "cuda" else denv.cpu_visible(environ)
  if device == "cuda" or value:
    try:
      got = denv.parse_devices(value, visible, device)
    except SxError as e:
      return from_error("SEXPGPU_DEVICES", e)
    return Check("ok", "SEXPGPU_DEVICES", f"{value or 'unset'}: ranks on {device} "
                 f"{','.join(map(str, got))}")
  return Check("ok", "SEXPGPU_DEVICES", "unset: one device")


def check_nodes(device: str, environ: Mapping[str, str]) -> list[Check]:
  out = []
  try:
    cfg = denv.parse_nodes(environ, device)
    out.append(Check("ok", "nodes", "one node" if cfg is None else
                     f"node {cfg.rank} of {cfg.nodes}, rendezvous {cfg.rendezvous}, "
                     f"{cfg.gradients} gradients between nodes"))
  except SxError as e:
    out.append(from_error("nodes", e))
  try:
    out.append(Check("ok", "SEXPGPU_RENDEZVOUS_TIMEOUT", f"{denv.rendezvous_timeout(environ):g} s"))
  except SxError as e:
    out.append(from_error("SEXPGPU_RENDEZVOUS_TIMEOUT", e))
  if environ.get("SEXPGPU_MEMORY"):
    try:
      out.append(Check("ok", "SEXPGPU_MEMORY",
                       f"plans against {denv.parse_memory(environ['SEXPGPU_MEMORY'])} bytes"))
    except SxError as e:
      out.append(from_error("SEXPGPU_MEMORY", e))
  return out


def check_variables(environ: Mapping[str, str]) -> list[Check]:
  """The other SEXPGPU_* variables, by the parsers `run` uses: a fail line for each bad one."""
  own_line = ("SEXPGPU_RENDEZVOUS_TIMEOUT", "SEXPGPU_MEMORY")  # check_nodes reports them
  bad = [from_error(name, e) for name, e in denv.variable_errors(environ) if name not in own_line]
  return bad or [Check("ok", "variables", "every SEXPGPU_* variable set parses")]


def check_cache(environ: Mapping[str, str]) -> Check:
  cache = cache_dir(environ)
  try:
    os.makedirs(cache, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache, prefix=".doctor-") as f:
      f.write(b"probe")
      f.flush()
  except OSError as e:
    return Check("fail", "cache", f"{cache} is not writable ({e.strerror or e})",
                 "set SEXPGPU_CACHE_DIR to a writable folder")
  return Check("ok", "cache", f"{cache} writable")


def check_endpoint(environ: Mapping[str, str], timeout: float = 5.0) -> Check:
  url = environ.get("AWS_ENDPOINT_URL") or environ.get("AWS_ENDPOINT_URL_S3")
  if not url:
    region = environ.get("AWS_DEFAULT_REGION") or environ.get("AWS_REGION") or "us-east-1"
    url = f"https://s3.{region}.amazonaws.com"
  u = urllib.parse.urlparse(url)
  host, port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
  try:
    with socket.create_connection((host, port), timeout=timeout):
      pass
  except OSError as e:
    return Check("fail", "s3 endpoint", f"{u.scheme}://{host}:{port} does not answer "
                 f"({e.strerror or e})", "check AWS_ENDPOINT_URL and the network")
  return Check("ok", "s3 endpoint", f"{u.scheme}://{host}:{port} answers")

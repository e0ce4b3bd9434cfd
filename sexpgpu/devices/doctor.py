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
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
from typing import Mapping

from sexpgpu import env as denv
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


# The plugin's own libraries (jax_plugins.xla_cuda13 loads them before it registers): one
# that does not load leaves JAX with no cuda backend and only a log line saying why.
PLUGIN_LIBS = ("libcudart", "libnvrtc", "libcublas", "libcublasLt", "libcusparse",
               "libcusolver", "libcufft", "libcupti", "libnccl", "libcudnn")
# Where a CUDA device's driver shows itself; JAX does not even try CUDA without one of them
DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
FIX_LIBRARY = ('pip install --force-reinstall "sexpgpu[cuda]" (its nvidia-* wheels carry the '
               "CUDA libraries; a system copy on LD_LIBRARY_PATH can shadow them)")
FIX_VISIBLE = ("check CUDA_VISIBLE_DEVICES against `nvidia-smi -L` (indices, GPU-… or MIG-… "
               "UUIDs) and that the container was started with its GPUs")
FIX_BUSY = ("stop the other processes on the GPU (`nvidia-smi` lists them) or lower "
            "XLA_PYTHON_CLIENT_MEM_FRACTION")

# Why a CUDA backend did not start, read from JAX's error and the plugin's log: (pattern,
# cause, fix), the first that matches wins. `{1}` in a cause is the pattern's group.
PLUGIN_FAILURES = (
    (r"Unable to load (\w+)", "the CUDA library {1} cannot be loaded", FIX_LIBRARY),
    (r"Outdated (\w+) installation", "{1} is older than the one JAX was built against",
     FIX_LIBRARY),
    (r"CUDA_ERROR_INSUFFICIENT_DRIVER|driver version is insufficient|DRIVER_MISMATCH|"
     r"CUDA_ERROR_COMPAT_NOT_SUPPORTED|CUDA_ERROR_NO_BINARY_FOR_GPU",
     "the NVIDIA driver is too old for the plugin's CUDA", FIX_DRIVER),
    (r"CUDA_ERROR_NO_DEVICE|no CUDA-capable device|CUDA_ERROR_INVALID_DEVICE",
     "CUDA finds no GPU", FIX_VISIBLE),
    (r"CUDA_ERROR_OUT_OF_MEMORY|out of memory|no supported devices found for platform CUDA",
     "the GPU's memory is taken", FIX_BUSY),
    (r"CUDA_ERROR_NOT_INITIALIZED|CUDA_ERROR_OPERATING_SYSTEM|CUDA_ERROR_UNKNOWN|cuInit",
     "the driver did not start CUDA", FIX_DRIVER),
)


def plugin_failure(text: str, device_nodes: bool, missing: list[str]) -> tuple[str, str]:
  """The cause and the fix of a CUDA backend that did not start.

  Args:
    text: JAX's error and the warnings the plugin logged while starting.
    device_nodes: whether an NVIDIA device node (/dev/nvidiactl, ...) exists.
    missing: the plugin's CUDA libraries that do not load.

  Returns:
    (cause, fix): from PLUGIN_FAILURES; else no device node means no driver (or a
    container without its GPUs); else a library that does not load is named; else
    JAX's own log is where the reason is.
  """
  for pattern, cause, fix in PLUGIN_FAILURES:
    m = re.search(pattern, text)
    if m:
      return cause.replace("{1}", m.group(1) if m.groups() else ""), fix
  if not device_nodes:
    return ("no NVIDIA device node (" + ", ".join(DEVICE_NODES[:2]) + "): the driver is not "
            "loaded or the container was started without its GPUs",
            FIX_DRIVER + "; in a container, start it with its GPUs (docker run --gpus all)")
  if missing:
    return f"the CUDA libraries {', '.join(missing)} cannot be loaded", FIX_LIBRARY
  return ("the plugin did not register, and said no more",
          "TF_CPP_MIN_LOG_LEVEL=0 sexpgpu doctor --device cuda shows JAX's log")


class _Logged(logging.Handler):
  """The warnings JAX and its CUDA plugin log while the backend starts."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.lines: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    try:
      self.lines.append(record.getMessage())
    except Exception:  # pylint: disable=broad-except  (a malformed record says nothing)
      pass


def _start_cuda() -> tuple[int, None] | tuple[None, str]:
  """(cuda devices, None), or (None, JAX's error and the plugin's warnings)."""
  import jax
  logged = _Logged()
  loggers = [logging.getLogger(n) for n in ("jax_plugins", "jax._src.xla_bridge")]
  for lg in loggers:
    lg.addHandler(logged)
  try:
    return len(jax.devices("cuda")), None
  except RuntimeError as e:
    return None, "\n".join([str(e), *logged.lines])
  finally:
    for lg in loggers:
      lg.removeHandler(logged)


def cuda_failure(text: str) -> tuple[str, str]:
  """Why this machine's CUDA backend did not start, and the fix.

  Args:
    text: JAX's error (and what the plugin logged), or "" when JAX silently offered
      other devices.

  Returns:
    (cause, fix): the plugin missing; else plugin_failure's reading with this machine's
    device nodes and the plugin's libraries that do not load.
  """
  if _plugin() is None:
    return "the jax_cuda13 plugin is not installed", FIX_PLUGIN
  missing = [stem for stem in PLUGIN_LIBS if _load(stem)[0] is None]
  return plugin_failure(text, any(os.path.exists(d) for d in DEVICE_NODES), missing)


def check_plugin(device: str) -> Check:
  name = _plugin()
  if name is None:
    return _gpu_missing(device, "cuda plugin", "jax_cuda13 plugin not installed", FIX_PLUGIN)
  n, text = _start_cuda()
  if n is None:
    cause, fix = cuda_failure(text)
    first = (text.strip().splitlines() or ["no error text"])[0][:200]
    return Check("fail" if device == "cuda" else "warn", "cuda plugin",
                 f"{name} installed, but the cuda backend does not start: {cause} ({first})",
                 fix)
  return Check("ok", "cuda plugin", f"{name}, {n} cuda devices")


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


@dataclasses.dataclass(frozen=True)
class Gpu:
  """A card, or a MIG slice of one, as nvidia-smi lists it."""

  uuid: str     # GPU-…, or MIG-… for a slice
  name: str     # the card's name; a slice's adds its profile ("… MIG 1g.10gb")
  cc: str       # compute capability, "9.0"
  memory: str   # "81559 MiB", or a slice's profile memory ("10gb")
  index: int    # nvidia-smi's index of the card (a slice's: its card's)


def smi_devices() -> tuple[list[Gpu], list[Gpu]] | None:
  """Every card and every MIG slice nvidia-smi lists (CUDA_VISIBLE_DEVICES aside), or None
  where nvidia-smi is missing or fails."""
  rows = _smi(["--query-gpu=index,uuid,name,compute_cap,memory.total",
               "--format=csv,noheader"])
  if rows is None:
    return None
  cards = []
  for row in rows:
    parts = [p.strip() for p in row.split(",")]
    if len(parts) >= 5 and parts[0].isdigit():
      cards.append(Gpu(parts[1], parts[2], parts[3], parts[4], int(parts[0])))
  slices, card = [], None
  for ln in _smi(["-L"]) or []:
    m = re.match(r"\s*GPU (\d+):", ln)
    if m:
      card = next((c for c in cards if c.index == int(m.group(1))), None)
      continue
    m = re.match(r"\s*MIG ([\w.+]+)\s+Device\s+\d+: \(UUID: ([^)]+)\)", ln)
    if m and card is not None:
      mem = re.search(r"\d+gb$", m.group(1))
      slices.append(Gpu(m.group(2).strip(), f"{card.name} MIG {m.group(1)}", card.cc,
                        mem.group(0) if mem else card.memory, card.index))
  return cards, slices


def visible(cards: list[Gpu], slices: list[Gpu], cvd: str | None) -> list[Gpu]:
  """The devices a CUDA process sees under CUDA_VISIBLE_DEVICES, in its order.

  CUDA reads the list as far as its first entry that names no device: an index, a GPU-
  UUID or a MIG- UUID, each UUID possibly shortened to a prefix that only one device has.
  Unset, every card is visible; "" or "-1" hides them all.
  """
  if cvd is None:
    return list(cards)
  out: list[Gpu] = []
  for entry in (e.strip() for e in cvd.split(",")):
    if entry.isdigit():
      hits = [c for c in cards if c.index == int(entry)]
    elif entry.startswith("GPU-"):
      hits = [c for c in cards if c.uuid.startswith(entry)]
    elif entry.startswith("MIG-"):
      hits = [g for g in slices if g.uuid.startswith(entry)]
    else:
      hits = []
    if len(hits) != 1:
      break
    if hits[0] not in out:
      out.append(hits[0])
  return out


def gpus() -> list[Gpu]:
  """The GPUs (or MIG slices) this process's CUDA sees: nvidia-smi's, through
  CUDA_VISIBLE_DEVICES."""
  found = smi_devices()
  if found is None:
    return []
  return visible(*found, os.environ.get("CUDA_VISIBLE_DEVICES"))


def gpu_count() -> int:
  """How many GPUs this process's CUDA sees; without nvidia-smi, the entries of
  CUDA_VISIBLE_DEVICES before its first that is not an index or a UUID."""
  found = smi_devices()
  cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
  if found is not None:
    return len(visible(*found, cvd))
  n = 0
  for entry in (e.strip() for e in (cvd or "").split(",")):
    if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
      break
    n += 1
  return n


def check_gpus(device: str) -> list[Check]:
  found = gpus()
  cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
  if not found:
    where = f"no GPU visible under CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else \
        "no GPU visible"
    return [_gpu_missing(device, "gpu", where, "check the driver and CUDA_VISIBLE_DEVICES "
                         "(indices, or UUIDs as `nvidia-smi -L` prints them)")]
  out = []
  for i, g in enumerate(found):
    try:
      major, minor = (int(x) for x in g.cc.split("."))
    except ValueError:
      major, minor = 0, 0
    detail = f"{g.name}, compute capability {g.cc}, {g.memory}"
    if (major, minor) < MIN_CC:
      out.append(Check("fail", f"gpu {i}", detail,
                       f"the {g.name} is below compute capability 8.0 (A100, L4, H100 or newer)"))
    else:
      out.append(Check("ok", f"gpu {i}", detail))
  slices = sum(g.uuid.startswith("MIG-") for g in found)
  if slices > 1:
    out.append(Check("warn", "mig", f"{slices} MIG slices listed; CUDA may enumerate only "
                     "the first MIG slice in one process (NVIDIA's MIG user guide): one "
                     "slice a run"))
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
  if lib is None:  # optional: never a fail
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
  value = denv.get("SEXPGPU_DEVICES", environ)
  visible = gpu_count() if device == "cuda" else denv.cpu_visible(environ)
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
  if denv.get("SEXPGPU_MEMORY", environ):
    try:
      out.append(Check("ok", "SEXPGPU_MEMORY",
                       f"plans against {denv.parse_memory(denv.get('SEXPGPU_MEMORY', environ))} bytes"))
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

"""Opening the device, and counting XLA compilations and persistent-cache hits."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from sexpgpu import env
from sexpgpu.env import check_visible, cpu_visible, parse_switch
from sexpgpu.env import parse_device_list  # noqa: F401  (SEXPGPU_DEVICES's one parser)
from sexpgpu.errors import SxError
from sexpgpu.paths import usable_cache_dir, write_atomic


def open_device(kind: str):
  """The first JAX device of `kind` ("cpu" or "cuda"); starts the backend.

  Raises:
    SxError: E-DEV-001 when the CUDA plugin is missing or no GPU is visible.
  """
  import jax
  if kind == "cpu":
    cpu_flags()
    return jax.devices("cpu")[0]
  from sexpgpu.devices.doctor import MIN_DRIVER, driver_version
  version = driver_version()
  if version is not None and int(version.split(".")[0]) < MIN_DRIVER:
    raise SxError("E-DEV-003", f"the NVIDIA driver {version} is older than the {MIN_DRIVER} "
                  "series that CUDA 13 needs", where="--device cuda / SEXPGPU_DEVICE")
  deterministic_flags()
  try:
    devs = jax.devices("cuda")
  except RuntimeError as e:
    raise cuda_unavailable(str(e)) from None
  if not devs:
    raise SxError("E-DEV-001", "the cuda device cannot be opened: no GPU visible",
                  where="--device cuda / SEXPGPU_DEVICE",
                  fix='pip install "sexpgpu[cuda]" (jax[cuda13]) on a machine with an NVIDIA '
                  "driver of the 580 series or newer; check CUDA_VISIBLE_DEVICES")
  for d in devs:
    cc = getattr(d, "compute_capability", None)
    if cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 0):
      raise SxError("E-DEV-002", f"{d.device_kind} (GPU {d.id}) has compute capability {cc}; "
                    "bf16 tensor-core products need 8.0 or newer", where="--device cuda",
                    fix="run on an A100, L4, H100 or newer, or limit CUDA_VISIBLE_DEVICES")
  return devs[0]


# XLA's CPU backend hands dot products to the YNNPACK library: measured 1.3x faster at the
# benchmark's compute shape and 2x at the tiny one, with the same losses (benchmarks/).
CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type=dot"


def cpu_flags() -> None:
  """Our XLA CPU flags, set before the backend starts unless the user chose their own."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_experimental_ynn_fusion_type" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " " + CPU_XLA_FLAGS).strip()


# glibc's malloc options (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# glibc serves an allocation larger than this (its largest mmap threshold) with a fresh mmap
MMAP_CEILING = 32 << 20
# the largest trim threshold mallopt takes: a freed chunk above it goes back to the OS
TRIM_CEILING = 2**31 - 1
_kept = False


def keep_host_memory() -> bool:
  """Makes glibc's malloc reuse the memory of XLA's per-step buffers; True once done.

  XLA's CPU runtime allocates each step's temporary buffer (168 MB at the benchmark's
  compute shape) on a worker thread and frees it when the step ends. glibc serves an
  allocation above MMAP_CEILING with a fresh mmap and unmaps it on free, so every step
  page-faults through new memory: 41,000 faults a step there, a quarter of its time.
  One arena, no mmap and no trimming keep that memory in the heap between steps, as
  PyTorch's and XLA's GPU allocators keep theirs. The one arena's lock costs the
  threads' small allocations: 0.55 -> 0.86 ms a step at the tiny shape, whose buffers
  glibc reuses anyway. Above TRIM_CEILING a freed buffer goes back to the OS all the
  same, and the heap only fragments. So a run asks for this only when its steps'
  values lie between the two ceilings (`run.setup.wants_kept_host_memory`). It must
  run before the backend's threads first allocate (their arena is chosen then);
  elsewhere than glibc it does nothing.
  """
  global _kept
  if _kept:
    return True
  import ctypes
  import ctypes.util
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return False
  if not hasattr(libc, "gnu_get_libc_version"):  # another C library than glibc
    return False
  _kept = all(libc.mallopt(option, value) == 1 for option, value in
              ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_CEILING)))
  return _kept


def deterministic() -> bool:
  """Whether SEXPGPU_DETERMINISTIC asks for bitwise-reproducible GPU runs.

  Raises:
    SxError: E-ENV-001 when it is neither 0 nor 1.
  """
  return parse_switch("SEXPGPU_DETERMINISTIC", env.get("SEXPGPU_DETERMINISTIC"))


def _autotune_dir() -> str:
  from sexpgpu.paths import cache_dir
  path = os.path.join(cache_dir(), "autotune")
  os.makedirs(path, exist_ok=True)
  return path


def autotune_dump_path() -> str:
  """Where XLA writes its GPU autotuning results (all of this process's, at each compile).

  One path per cache folder, never one per process: jax hashes XLA_FLAGS into the
  persistent compilation cache's keys, so a process id in a path would give every
  process keys of its own and no cache hits across processes.
  """
  return os.path.join(_autotune_dir(), "results.textproto")


def _resumed_path(results: str) -> str:
  """A checkpoint's autotuning results as a file named by their content: two resumes of
  one checkpoint set equal flags (and so share compilation-cache hits)."""
  digest = hashlib.sha256(results.encode()).hexdigest()[:16]
  return os.path.join(_autotune_dir(), f"resumed-{digest}.textproto")


# When this process set the dump flag: results written before are another process's.
_dump_since: float | None = None


def deterministic_flags(autotune: dict | None = None) -> None:
  """SEXPGPU_DETERMINISTIC=1: XLA's deterministic GPU ops, and its autotuning results
  written to a file that checkpoints keep. `autotune` (a checkpoint's `xla_autotune`)
  is read back instead of autotuning again, so a resumed run picks the same kernels.
  Set before the backend starts; a flag the user set in XLA_FLAGS is left alone. The
  flags are equal in every process that sets them (no per-process path)."""
  global _dump_since
  if not deterministic():
    return
  flags = os.environ.get("XLA_FLAGS", "")
  want = {"xla_gpu_deterministic_ops": "true", "xla_gpu_exclude_nondeterministic_ops": "true",
          "xla_gpu_dump_autotune_results_to": autotune_dump_path()}
  if autotune is not None:
    path = _resumed_path(autotune["results"])
    if not os.path.exists(path):  # written whole, then renamed: a reader never sees half
      write_atomic(path, autotune["results"])
    want["xla_gpu_load_autotune_results_from"] = path
  for name, value in want.items():
    if name not in flags:
      flags += f" --{name}={value}"
  os.environ["XLA_FLAGS"] = flags.strip()
  if _dump_since is None:  # less a second: a file's time is the kernel's coarser clock
    _dump_since = time.time() - 1.0


def autotune_results() -> dict | None:
  """This process's autotuning results for a checkpoint's meta, under SEXPGPU_DETERMINISTIC.

  The file is shared by the processes of one cache folder; one last written before this
  process set its flags holds another's results and is not taken."""
  if not deterministic():
    return None
  path = autotune_dump_path()
  try:
    if _dump_since is not None and os.path.getmtime(path) < _dump_since:
      return None
    with open(path) as f:
      text = f.read()
  except OSError:  # nothing was autotuned (or not on a GPU)
    return None
  return {"jaxlib": _jaxlib_version(), "results": text} if text else None


def autotune_of(meta: dict | None) -> dict | None:
  """A checkpoint's autotuning results, when this jaxlib can read them back."""
  got = (meta or {}).get("xla_autotune")
  if not got or got.get("jaxlib") != _jaxlib_version():
    return None
  return got


def _jaxlib_version() -> str:
  from importlib import metadata
  return metadata.version("jaxlib")


def peak_bytes(device) -> int | None:
  """The allocator's high-water mark on a GPU (None where the device keeps no statistics)."""
  try:
    stats = device.memory_stats()
  except Exception:  # the CPU client keeps none
    return None
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


class Placement:
  """Where the run lives: one device, a 1-D mesh ("data",) over several, or a 2-D mesh
  ("node", "gpu") over the devices of several processes (nodes)."""

  def __init__(self, kind: str, devices: list, nodes: int = 1):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    self.kind = kind
    self.devices = devices
    self.nodes = nodes
    self.node = jax.process_index() if nodes > 1 else 0
    if nodes > 1:
      self.mesh = Mesh(np.array(devices).reshape(nodes, -1), ("node", "gpu"))
      axes = ("node", "gpu")
    else:
      self.mesh = Mesh(devices, ("data",)) if len(devices) > 1 else None
      axes = ("data",)
    self.local_devices = [d for d in devices if d.process_index == jax.process_index()]
    if self.mesh is not None:
      self._rep = NamedSharding(self.mesh, P())
      self._shard = NamedSharding(self.mesh, P(axes))
    self._jax = jax
    self._np = np

  @property
  def ranks(self) -> int:
    return len(self.devices)

  @property
  def multiprocess(self) -> bool:
    return self.nodes > 1

  def host(self, x):
    """A numpy copy of a (replicated) array, from this process's own shard."""
    if self.nodes > 1 and not getattr(x, "is_fully_addressable", True):
      return self._np.asarray(x.addressable_data(0))
    return self._np.asarray(x)

  def local_share(self, k: int) -> range:
    """The step's microbatches this process reads: its ranks' contiguous share of K."""
    per_rank = k // self.ranks
    first = self.devices.index(self.local_devices[0])
    return range(first * per_rank, (first + len(self.local_devices)) * per_rank)

  @property
  def first(self):
    """This process's first device (the global first on one process)."""
    return self.local_devices[0]

  def replicate(self, tree):
    """Places a pytree on every rank (parameters, optimizer states)."""
    if self.mesh is None:
      return self._jax.device_put(tree, self.first)
    if self.multiprocess:  # every process holds the same values
      return self._jax.tree_util.tree_map(
          lambda x: x if getattr(x, "sharding", None) == self._rep else
          self._jax.make_array_from_process_local_data(self._rep, self.host(x)), tree)
    return self._jax.device_put(tree, self._rep)

  def abstract(self, tree):
    """Abstract values placed as `replicate` would place them (for compiling ahead of time)."""
    if self.mesh is None:
      return tree
    return self._jax.tree_util.tree_map(
        lambda x: self._jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._rep), tree)

  def shard(self, tree, global_lead: int | None = None):
    """Places a pytree whose leading axis (microbatches) is split over the ranks.

    With several processes each passes only its own share; `global_lead` is the whole axis.
    """
    if self.mesh is None:
      return self._jax.device_put(tree, self.first)
    if self.multiprocess:
      return self._jax.tree_util.tree_map(
          lambda x: self._jax.make_array_from_process_local_data(
              self._shard, x, (global_lead,) + x.shape[1:]), tree)
    return self._jax.device_put(tree, self._shard)


def microbatches_divide(k: int, ranks: int) -> None:
  """Raises E-DP-003 unless the step's K microbatches split evenly over the ranks."""
  if k % ranks:
    raise SxError("E-DP-003", f"the {k} microbatches do not divide over {ranks} devices",
                  where="SEXPGPU_DEVICES", fix="pick a device count that divides "
                  ":microbatches, or --set microbatches=N")


def cuda_unavailable(text: str, offered: str = "") -> SxError:
  """E-DEV-001 for a CUDA backend that did not start, with doctor's reading of why.

  Args:
    text: JAX's error, or "" when JAX silently offered other devices instead.
    offered: the platforms JAX offered instead ("cpu"), or "".
  """
  from sexpgpu.devices.doctor import cuda_failure
  cause, fix = cuda_failure(text)
  first = (text.strip().splitlines() or [""])[0][:200]
  return SxError("E-DEV-001", "the cuda devices cannot be opened on this node: "
                 + (f"JAX offers {offered} devices instead; " if offered else "")
                 + cause + (f" ({first})" if first else ""),
                 where="--device cuda / SEXPGPU_DEVICE",
                 fix=fix + "; sexpgpu doctor --device cuda says what else is missing")


def open_devices(kind: str, ordinals: list[int] | None, nodes_cfg=None) -> Placement:
  """Opens the device kind and the ranks SEXPGPU_DEVICES names (all visible GPUs when unset).

  On `cpu`, SEXPGPU_DEVICES=0,1 makes that many XLA host devices (set before the backend
  starts), up to `env.cpu_visible`. One rank on a device other than the first
  becomes JAX's default device, so what is compiled ahead of time lives there too.
  Raises E-DP-001 for an ordinal that is not visible, E-DEV-001 without CUDA.
  """
  import jax
  if nodes_cfg is not None:
    # jax.distributed already limited each process to its SEXPGPU_DEVICES (local_device_ids)
    try:
      devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    except RuntimeError as e:  # a CUDA plugin whose backend failed to start
      if kind == "cpu":
        raise
      raise cuda_unavailable(str(e)) from None
    if kind != "cpu" and any(d.platform not in ("gpu", "cuda") for d in devs):
      # a node whose CUDA backend failed: JAX answers with its CPU devices, never trained on
      raise cuda_unavailable("", ", ".join(sorted({d.platform for d in devs})))
    counts = {}
    for d in devs:
      counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(set(counts.values())) != 1:
      raise SxError("E-DP-006", "the nodes have different device counts: " + ", ".join(
          f"node {p} {n}" for p, n in sorted(counts.items())), where="SEXPGPU_DEVICES")
    return Placement(kind, devs, nodes_cfg.nodes)
  if kind == "cpu":
    cpu_flags()
    if ordinals is None:
      return _placed(kind, [jax.devices("cpu")[0]])
    check_visible(ordinals, cpu_visible(), kind)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      jax.config.update("jax_num_cpu_devices", max(ordinals) + 1)
    devs = jax.devices("cpu")
  else:
    first = open_device(kind)
    devs = jax.devices(first.platform)
    if ordinals is None:
      return _placed(kind, list(devs))
  check_visible(ordinals, len(devs), kind)
  return _placed(kind, [devs[o] for o in ordinals])


def _placed(kind: str, devices: list) -> Placement:
  """The Placement; one device becomes JAX's default, so what is compiled ahead of time for
  abstract values (no sharding of their own) is compiled for it, not for device 0."""
  import jax
  jax.config.update("jax_default_device", devices[0] if len(devices) == 1 else None)
  return Placement(kind, devices)


class CompileCounter:
  """XLA compilations and persistent compilation-cache hits, from jax.monitoring."""

  _instance: "CompileCounter | None" = None

  def __init__(self):
    self.lock = threading.Lock()
    self.compiled = 0
    self.seconds = 0.0
    self.hits = 0

  @classmethod
  def install(cls, cache: str) -> "CompileCounter":
    import jax
    if cls._instance is None:
      inst = cls()
      # JAX's own variable, when set, keeps its meaning: several runs or jobs may share
      # one XLA cache while each keeps its own sexpgpu cache (choices, links, bundles)
      # (E-ENV-001 when it cannot be one: a cache that silently does nothing is a slow run)
      own = env.get("JAX_COMPILATION_CACHE_DIR")
      xla_dir = (usable_cache_dir(own, "JAX_COMPILATION_CACHE_DIR") if own
                 else os.path.join(cache, "xla"))
      try:
        if not own:  # JAX's own was made above, or is remote and JAX's to reach
          os.makedirs(xla_dir, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", xla_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
      except OSError:
        pass

      def on_event(name, **kw):
        if name == "/jax/compilation_cache/cache_hits":
          with inst.lock:
            inst.hits += 1

      def on_duration(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
          with inst.lock:
            inst.compiled += 1
            inst.seconds += secs

      jax.monitoring.register_event_listener(on_event)
      jax.monitoring.register_event_duration_secs_listener(on_duration)
      cls._instance = inst
    return cls._instance

  def snapshot(self) -> tuple[int, float, int]:
    """(XLA compilations, their seconds, persistent-cache hits); a hit also reports a
    backend compile event, so it is taken out of the compilations."""
    with self.lock:
      return max(self.compiled - self.hits, 0), self.seconds, self.hits

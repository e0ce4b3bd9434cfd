"""Opening the device, and counting XLA compilations and persistent-cache hits."""

from __future__ import annotations

import os
import threading

from sexpgpu.errors import SxError


def open_device(kind: str):
  """The first JAX device of `kind` ("cpu" or "cuda"); starts the backend.

  Raises:
    SxError: E-DEV-001 when the CUDA plugin is missing or no GPU is visible.
  """
  import jax
  if kind == "cpu":
    return jax.devices("cpu")[0]
  try:
    devs = jax.devices("cuda")
  except RuntimeError:
    devs = []
  if not devs:
    raise SxError("E-DEV-001", "the cuda device cannot be opened: no CUDA backend or no GPU "
                  "visible", where="--device cuda / SEXPGPU_DEVICE",
                  fix='pip install "sexpgpu[cuda]" (jax[cuda13]) on a machine with an NVIDIA '
                  "driver of the 580 series or newer; check CUDA_VISIBLE_DEVICES")
  return devs[0]


def parse_device_list(value: str | None) -> list[int] | None:
  """SEXPGPU_DEVICES as ordinals, or None when unset.

  Raises:
    SxError: E-DP-001 when it does not parse or repeats an ordinal.
  """
  if value is None or value.strip() == "":
    return None
  fix = "list visible ordinals once each, SEXPGPU_DEVICES=0,1"
  try:
    ords = [int(v) for v in value.split(",")]
  except ValueError:
    raise SxError("E-DP-001", f"SEXPGPU_DEVICES={value} does not parse", where="SEXPGPU_DEVICES",
                  fix=fix) from None
  if any(o < 0 for o in ords) or len(set(ords)) != len(ords):
    raise SxError("E-DP-001", f"SEXPGPU_DEVICES={value} repeats an ordinal or names a negative one",
                  where="SEXPGPU_DEVICES", fix=fix)
  return ords


class Placement:
  """Where the run lives: one device, or a 1-D data-parallel mesh over several."""

  def __init__(self, kind: str, devices: list):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    self.kind = kind
    self.devices = devices
    self.mesh = Mesh(devices, ("data",)) if len(devices) > 1 else None
    if self.mesh is not None:
      self._rep = NamedSharding(self.mesh, P())
      self._shard = NamedSharding(self.mesh, P("data"))
    self._jax = jax

  @property
  def ranks(self) -> int:
    return len(self.devices)

  @property
  def first(self):
    return self.devices[0]

  def replicate(self, tree):
    """Places a pytree on every rank (parameters, optimizer states)."""
    if self.mesh is None:
      return self._jax.device_put(tree, self.first)
    return self._jax.device_put(tree, self._rep)

  def abstract(self, tree):
    """Abstract values placed as `replicate` would place them (for compiling ahead of time)."""
    if self.mesh is None:
      return tree
    return self._jax.tree_util.tree_map(
        lambda x: self._jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._rep), tree)

  def shard(self, tree):
    """Places a pytree whose leading axis (microbatches) is split over the ranks."""
    if self.mesh is None:
      return self._jax.device_put(tree, self.first)
    return self._jax.device_put(tree, self._shard)


def open_devices(kind: str, ordinals: list[int] | None) -> Placement:
  """Opens the device kind and the ranks SEXPGPU_DEVICES names (all visible GPUs when unset).

  On `cpu`, SEXPGPU_DEVICES=0,1 makes that many XLA host devices (set before the backend
  starts). Raises E-DP-001 for an ordinal that is not visible, E-DEV-001 without CUDA.
  """
  import jax
  if kind == "cpu":
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if ordinals is not None and not forced:
      jax.config.update("jax_num_cpu_devices", max(ordinals) + 1)
    devs = jax.devices("cpu")
    if ordinals is None:
      return Placement(kind, [devs[0]])
  else:
    first = open_device(kind)
    devs = jax.devices(first.platform)
    if ordinals is None:
      return Placement(kind, list(devs))
  missing = [o for o in ordinals if o >= len(devs)]
  if missing:
    raise SxError("E-DP-001", f"SEXPGPU_DEVICES names ordinal {missing[0]}, but only "
                  f"{len(devs)} {kind} device{'s are' if len(devs) != 1 else ' is'} visible",
                  where="SEXPGPU_DEVICES", fix="list visible ordinals once each, "
                  "SEXPGPU_DEVICES=0,1 (CUDA_VISIBLE_DEVICES limits what is visible)")
  return Placement(kind, [devs[o] for o in ordinals])


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
      xla_dir = os.path.join(cache, "xla")
      try:
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
    with self.lock:
      return self.compiled, self.seconds, self.hits

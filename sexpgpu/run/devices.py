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

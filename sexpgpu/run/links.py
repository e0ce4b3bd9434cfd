"""The table of devices and links the layout plan predicts with: published figures for GPUs,
NVLink and InfiniBand, and this machine's host devices measured once and remembered.

A link is what a collective's group crosses: `within` a node (NVLink on a GPU node; shared
memory between XLA host devices) or `across` nodes (InfiniBand, one NIC a GPU as on a DGX).
Each is a bandwidth (bytes a second one device sends in one direction) and a latency (the
fixed seconds of one collective).
"""

from __future__ import annotations

import dataclasses
import json
import os

from sexpgpu.paths import read_json_object, write_atomic

LINKS_VERSION = 2  # 2: the devices' copy rate (hbm) measured with the others copying too


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One device kind and its links.

  Attributes:
    name: the table's name (`H100`, or `cpu:<kind> x4` for measured host devices).
    peak: dense flop/s at bf16 (a GPU; f32 runs take half) or as measured (host).
    hbm: memory bandwidth, bytes/s one device reads and writes (host devices: while the
      others copy too, since they share the machine's memory).
    memory: bytes one device holds.
    within, across: (bytes/s, seconds a collective) inside a node and between nodes.
    per_node: devices a node holds.
    source: where the figures come from (published, measured, remembered).
  """

  name: str
  peak: float
  hbm: float
  memory: float
  within: tuple[float, float]
  across: tuple[float, float]
  per_node: int
  source: str

  def peak_at(self, precision: str) -> float:
    """The peak at a run's precision: a GPU's TF32 rate is half its bf16 rate."""
    return self.peak if precision in ("bf16", "fp8") or self.name.startswith("cpu") else self.peak / 2


GiB = 1 << 30
# Published figures, per GPU. NVLink: one direction of its total bidirectional bandwidth
# (A100 600 GB/s, H100/H200 900 GB/s, B200 1.8 TB/s); InfiniBand: one 200 Gb/s HDR NIC a
# GPU (DGX A100) or one 400 Gb/s NDR NIC a GPU (DGX H100/H200/B200). Latencies: about 10 µs
# for an NCCL ring step inside a node, 20 µs across (NCCL's own tuning tables' order).
GPUS = {
    "A100": Hardware("A100", 312e12, 2.04e12, 80 * GiB, (300e9, 10e-6), (25e9, 20e-6), 8,
                     "published"),
    "H100": Hardware("H100", 989e12, 3.35e12, 80 * GiB, (450e9, 10e-6), (50e9, 20e-6), 8,
                     "published"),
    "H200": Hardware("H200", 989e12, 4.8e12, 141 * GiB, (450e9, 10e-6), (50e9, 20e-6), 8,
                     "published"),
    "B200": Hardware("B200", 2250e12, 8.0e12, 180 * GiB, (900e9, 10e-6), (50e9, 20e-6), 8,
                     "published"),
}


def gpu(name: str) -> Hardware:
  """A GPU of the table by its short name (`H100`); KeyError when it is not there."""
  return GPUS[name.upper()]


def measure_host(devices) -> dict[str, float]:
  """The host devices' link, timed: an all-reduce of 4 MiB a device (bandwidth) and of 8
  floats (latency) over every device, and their matmul and copy rates when all run at once.

  Returns:
    {"bandwidth": bytes/s a device sends, "latency": seconds a collective, "flops": flop/s
    one device reaches while the others compute too, "copy": bytes/s one device reads and
    writes while the others copy too}.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from sexpgpu.run.planning.plan import fastest as best
  n = len(devices)
  mesh = Mesh(np.array(devices), ("d",))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d")))  # noqa: E731

  total = jax.jit(lambda x: jnp.broadcast_to(x.sum(0, keepdims=True), x.shape),
                  out_shardings=NamedSharding(mesh, P("d")))
  big = put(jnp.ones((n, 1 << 20), jnp.float32))
  small = put(jnp.ones((n, 8), jnp.float32))
  t_big, t_small = best(total, big), best(total, small, 20)
  nbytes = 4 << 20
  moved = 2 * (n - 1) / n * nbytes
  side = 512
  mats = put(jnp.ones((n * side, side), jnp.float32))
  mm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x.reshape(n, side, side),
                                    x.reshape(n, side, side)).reshape(n * side, side),
               out_shardings=NamedSharding(mesh, P("d")))
  t_mm = best(mm, mats)
  # an optimizer's update is such a pass over the state: read, scale, write
  scale = jax.jit(lambda x: x * 0.5 + 1.0, out_shardings=NamedSharding(mesh, P("d")))
  words = 4 << 20
  t_copy = best(scale, put(jnp.ones((n, words), jnp.float32)))
  return {"bandwidth": moved / max(t_big - t_small, 1e-9), "latency": t_small,
          "flops": 2 * side ** 3 / max(t_mm, 1e-9), "copy": 2 * 4 * words / max(t_copy, 1e-9)}


def host(devices, cache_dir: str | None, memory: float) -> Hardware:
  """This machine's host devices as a Hardware: measured once per device kind and count,
  remembered in `<cache>/links.json` with jax's version (delete it to measure again).

  Args:
    devices: the run's devices (XLA host devices).
    cache_dir: where links.json is kept (None: measured every time).
    memory: bytes a device may hold (the memory plan's free memory).
  """
  import jax
  d = devices[0]
  name = f"{d.platform}:{getattr(d, 'device_kind', '')} x{len(devices)}"
  path = os.path.join(cache_dir, "links.json") if cache_dir else None
  known = read_json_object(path).get(name) if path else None
  keys = ("bandwidth", "latency", "flops", "copy")
  if (isinstance(known, dict) and known.get("version") == LINKS_VERSION
      and known.get("jax") == jax.__version__
      and all(isinstance(known.get(k), (int, float)) for k in keys)):
    got, source = {k: float(known[k]) for k in keys}, "remembered (links.json)"
  else:
    got, source = measure_host(devices), "measured"
    if path:
      data = read_json_object(path)
      data[name] = dict(got, version=LINKS_VERSION, jax=jax.__version__)
      write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
  link = (got["bandwidth"], got["latency"])
  return Hardware(name, got["flops"], got["copy"], memory, link, link, len(devices), source)

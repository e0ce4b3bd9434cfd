"""Model flops counted from the IR (matmuls, einsums, attention), for tokens/s and MFU,
and the bytes of the values a forward pass computes.

XLA's cost_analysis counts a scan body once, however many trips it makes, so the
count here walks the IR instead and multiplies each repeat body by its size.
"""

from __future__ import annotations

import math
import re
from typing import Callable

from sexpgpu.ir.graph import Graph, Node, walk
from sexpgpu.ir.shapes import np_dtype


def _einsum_flops(spec: str, shapes: list[tuple[int, ...]]) -> int:
  lhs = spec.replace(" ", "").split("->")[0].split(",")
  sizes: dict[str, int] = {}
  for sub, shape in zip(lhs, shapes):
    letters = re.sub(r"\.\.\.", "", sub)
    for ch, d in zip(letters[::-1], shape[::-1]):
      sizes[ch] = d
  return 2 * math.prod(sizes.values()) if sizes else 0


# op name → flops(node) of one evaluation, or the reason the op counts none. Every op
# of the IR has an entry (tests/test_op_table.py); an op with none would drop out of MFU
# silently. Products count 2 a multiply-add, as the field's MFU does (PaLM's appendix B).
FLOPS: dict[str, Callable[[Node], int] | str] = {}


LEAVES = ("input", "param", "carry")  # the graph's leaves, which compute nothing


def register_flops(rule: Callable[[Node], int] | str, *ops: str) -> None:
  """Registers `rule(node)` (or a reason for counting none) as the FLOPs of `ops`.

  Raises:
    ValueError: an op already has an entry.
  """
  for op in ops:
    if op in FLOPS:
      raise ValueError(f"op {op} has a FLOPs rule already")
    FLOPS[op] = rule


def _matmul(node: Node) -> int:
  return 2 * node.inputs[0].shape[-1] * math.prod(node.shape)


def _sdpa(node: Node) -> int:
  q, k = node.inputs[:2]
  full = 2 * 2 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
  # A causal mask leaves half the products to do, and the field counts half (PaLM's MFU).
  return full // 2 if node.attr("causal") else full


def _chunked_xent(node: Node) -> int:
  h, w = node.inputs[:2]
  return 2 * math.prod(h.shape) * w.shape[-1]


def _conv(node: Node) -> int:
  w = node.inputs[1]
  # each output element is a dot product over the kernel's window and its input channels
  return 2 * math.prod(node.shape) * math.prod(w.shape[:-1])


register_flops(_matmul, "matmul")
register_flops(lambda n: _einsum_flops(n.attr("spec"), [i.shape for i in n.inputs]), "einsum")
register_flops(_sdpa, "sdpa")
register_flops(_chunked_xent, "chunked-cross-entropy")
register_flops(_conv, "conv")
register_flops(
    "not a product: MFU counts multiply-adds only",
    "+", "-", "*", "/", "pow", "max", "min", "mod", "neg", "abs", "exp", "log", "sqrt", "rsqrt",
    "square", "tanh", "cos", "sin", "sigmoid", "relu", "gelu", "silu", "erf", "softplus",
    "log1p", "expm1", "floor", "ceil", "round", "sign", "isfinite", "logical-not",
    "logical-and", "logical-or", "<", "<=", ">", ">=", "=", "!=", "where", "cast", "clip",
    "sum", "mean", "max-of", "min-of", "logsumexp", "argmax", "softmax", "log-softmax",
    "causal-mask", "segment-mask", "dropout", "cross-entropy", "cumsum", "cumprod",
    "linear-recurrence",
    "max-pool", "avg-pool", "top-k", "top-k-indices", "sort", "argsort",
    "bernoulli", "random-normal", "random-uniform", "random-int", "random-permutation")
register_flops(
    "moves or makes values, computes none", "reshape", "transpose", "concat", "slice", "take",
    "one-hot", "expand", "squeeze", "broadcast", "tril", "triu", "flip", "tile", "pad",
    "take-along", "scatter-add", "full", "iota", "tap", "stop-gradient")


def node_flops(node: Node) -> int:
  """Multiply-add flops of one node (0 for ops that are not products).

  Raises:
    KeyError: the op has no entry in FLOPS.
  """
  if node.op in LEAVES:
    return 0
  rule = FLOPS[node.op]
  return 0 if isinstance(rule, str) else rule(node)


def _flops(roots: list[Node]) -> int:
  total = 0
  for node in walk(roots):
    if node.op == "repeat":
      body = node.attr("body")
      total += node.attr("n") * _flops([body.output])
    else:
      total += node_flops(node)
  return total


def forward_flops(graph: Graph) -> int:
  """Flops of one forward evaluation of the graph on one microbatch."""
  return _flops(list(graph.outputs.values()))


def train_flops(graph: Graph, microbatches: int) -> int:
  """Flops of one optimizer step: forward and backward (3x forward) over every microbatch."""
  return 3 * forward_flops(graph) * microbatches


def _value_bytes(roots: list[Node]) -> int:
  total = 0
  for node in walk(roots):
    if node.op == "repeat":
      total += node.attr("n") * _value_bytes([node.attr("body").output])
    elif node.op not in ("input", "param", "carry"):
      total += math.prod(node.shape) * np_dtype(node.dtype).itemsize
  return total


def forward_bytes(graph: Graph) -> int:
  """Bytes of every value one forward evaluation computes on one microbatch.

  An estimate of the step's activations, known before the device opens.
  """
  return _value_bytes(list(graph.outputs.values()))


# Dense bf16 peaks, flop/s, by the exact name the device reports (jax's `device_kind`);
# f32 runs count the TF32 tensor-core peak, half of it. A name is matched whole, never
# as a substring: "NVIDIA L4" is not "NVIDIA L40S".
GPU_PEAKS = {
    "NVIDIA B200": 2250e12,
    "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12,
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12, "NVIDIA L4": 121e12,
    "NVIDIA A10": 125e12, "NVIDIA A10G": 70e12,
    "NVIDIA GeForce RTX 4090": 165e12, "NVIDIA GeForce RTX 3090": 71e12,
}


def gpu_peak(kind: str, precision: str) -> float | None:
  """The peak of a GPU by its exact reported name, or None for a card not in the table."""
  peak = GPU_PEAKS.get(" ".join(kind.split()))
  if peak is None:
    return None
  return peak if precision == "bf16" else peak / 2


def device_peak(device, precision: str, cache: str | None = None) -> float | None:
  """The device's peak flop/s: the table for GPUs, a measured matmul rate for the CPU."""
  if device.platform in ("gpu", "cuda"):
    return gpu_peak(getattr(device, "device_kind", ""), precision)
  return _cpu_peak(cache)


_CPU_PEAK: float | None = None


def _cpu_peak(cache: str | None) -> float:
  """A 1024² f32 matmul's rate on this CPU, measured once per process."""
  global _CPU_PEAK
  if _CPU_PEAK is None:
    import time

    import jax
    import jax.numpy as jnp
    n = 1024
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(3):
      t = time.perf_counter()
      f(x).block_until_ready()
      best = min(best, time.perf_counter() - t)
    _CPU_PEAK = 2 * n ** 3 / best
  return _CPU_PEAK

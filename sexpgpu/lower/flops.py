"""Flops counted from the IR (each op's entry in FLOPS), for tokens/s and MFU, and the
bytes of the values a forward pass computes.

XLA's cost_analysis counts a scan body once, however many trips it makes, so the
count here walks the IR instead and multiplies each repeat body by its size.
"""

from __future__ import annotations

import math
import re

from sexpgpu.ir.graph import Graph, Node, body_nodes, walk
from sexpgpu.ir.opdef import KINDS, LEAVES, OPS, OpTable
from sexpgpu.ir.ops_scan import combines, interleaved
from sexpgpu.ir.shapes import np_dtype


def _einsum_flops(spec: str, shapes: list[tuple[int, ...]]) -> int:
  lhs = spec.replace(" ", "").split("->")[0].split(",")
  sizes: dict[str, int] = {}
  for sub, shape in zip(lhs, shapes):
    letters = re.sub(r"\.\.\.", "", sub)
    for ch, d in zip(letters[::-1], shape[::-1]):
      sizes[ch] = d
  return 2 * math.prod(sizes.values()) if sizes else 0


# op name → flops(node) of one evaluation, or the reason the op counts none: an op's own
# entry, else its kind's (every op has one: tests/test_op_table.py); an op with none would
# drop out of MFU silently. Products count 2 a multiply-add, as the field's MFU does
# (PaLM's appendix B); an op written in Python counts what XLA's cost analysis finds.
MOVES = "moves or makes values, computes none"


def _per_element(k: int):
  """k flops an output element (XLA's count of an elementwise op: 1, a transcendental 0)."""
  return lambda node: k * math.prod(node.shape)


def _per_input_element(k: int):
  """k flops an element of the first input (a reduction, a normalization over an axis)."""
  return lambda node: k * math.prod(node.inputs[0].shape)


# Elementwise work counts as XLA's cost analysis counts it, so the counted FLOPs of a small
# model agree with XLA's (products dominate a large one either way).
FLOPS = OpTable("flops", "sexpgpu/lower/flops.py", {
    "pointwise": _per_element(1), "mask": _per_element(1), "reduction": _per_input_element(1),
    "window": _per_input_element(1), "loss": _per_input_element(4), "movement": MOVES,
    "constant": MOVES, "random": "compares and moves values: no arithmetic"})
register_flops = FLOPS.register


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


def _taps(n: int, k: int, stride: int, dilation: int, lo: int, out: int) -> int:
  """Kernel taps that land inside an axis of size n, summed over its `out` outputs."""
  return sum(1 for o in range(out) for j in range(k) if 0 <= o * stride - lo + j * dilation < n)


def _conv(node: Node) -> int:
  x, w = node.inputs[:2]
  spatial = len(x.shape) - 2
  per = lambda v: (v,) * spatial if isinstance(v, int) else tuple(v)  # noqa: E731
  stride, dilation, padding = per(node.attr("stride")), per(node.attr("dilation")), \
      node.attr("padding")
  taps = 1
  for i in range(spatial):
    n, k, out = x.shape[1 + i], w.shape[i], node.shape[1 + i]
    span = dilation[i] * (k - 1) + 1
    if padding == "valid":
      lo = 0
    elif padding == "same":
      lo = max((out - 1) * stride[i] + span - n, 0) // 2
    elif padding == "causal":
      lo = span - 1
    else:
      lo = padding[i][0]
    taps *= _taps(n, k, stride[i], dilation[i], lo, out)
  # taps that read padding multiply zeros, which XLA does not count and neither does this
  return 2 * x.shape[0] * taps * w.shape[-2] * w.shape[-1]


def _trips(node: Node) -> int:
  """How many times a scan evaluates its function: once a position for a scan, once an
  element combination for an associative scan."""
  n = node.inputs[node.attr("carries")].shape[node.attr("axis")]
  return n if node.op == "scan" else combines(n)


def _scan(node: Node) -> int:
  flops = _trips(node) * _count(body_nodes(node))
  if node.op == "associative-scan":  # and an addition an element to interleave each level
    n = node.inputs[0].shape[node.attr("axis")]
    flops += interleaved(n) * sum(math.prod(s) // n for d, s in node.attr("types")
                                  if d != "bool") if n else 0
  return flops


def _linear_recurrence(node: Node) -> int:
  """An associative scan of (A, X) pairs: 3 flops a combination (A·A', A'·X + X'), and the
  interleaving's addition for each of the two."""
  n = node.shape[node.attr("axis") % len(node.shape)]
  per = math.prod(node.shape) // n if n else 0
  return (3 * combines(n) + 2 * interleaved(n)) * per


register_flops(_matmul, "matmul")
register_flops(lambda n: _einsum_flops(n.attr("spec"), [i.shape for i in n.inputs]), "einsum")
register_flops(_sdpa, "sdpa")
register_flops(_chunked_xent, "chunked-cross-entropy")
register_flops(_conv, "conv")
register_flops(_scan, "scan", "associative-scan")
register_flops(_linear_recurrence, "linear-recurrence")
register_flops(_per_element(2), "softplus", "dropout", "cumsum", "cumprod")
register_flops(_per_element(8), "gelu")
register_flops(_per_element(1), "scatter-add")
register_flops(
    "a transcendental: XLA counts it apart from FLOPs", "exp", "log", "sqrt", "rsqrt", "tanh",
    "cos", "sin", "sigmoid", "erf", "log1p", "expm1")
register_flops(_per_input_element(3), "logsumexp")
register_flops(_per_input_element(4), "softmax", "log-softmax")
register_flops("compares and moves values: no arithmetic", "top-k", "top-k-indices", "sort",
               "argsort", "cast")
register_flops(MOVES, "tap", "stop-gradient")


def node_flops(node: Node) -> int:
  """Flops of one node: 2 a multiply-add of a product, elementwise work as XLA counts it.

  Raises:
    KeyError: the op has no entry in FLOPS.
  """
  if node.op in LEAVES:
    return 0
  rule = FLOPS[node.op]
  return 0 if isinstance(rule, str) else rule(node)


def _flops(roots: list[Node]) -> int:
  return _count(walk(roots))


def _count(nodes) -> int:
  total = 0
  for node in nodes:
    if node.op == "repeat":
      body = node.attr("body")
      total += node.attr("n") * _flops([body.output])
    else:
      total += node_flops(node)
  return total


def forward_flops(graph: Graph) -> int:
  """Flops of one forward evaluation of the graph on one microbatch."""
  return _flops(list(graph.outputs.values()))


def _each_input(f: int, flags: list[bool]) -> int:
  """A product's backward: one product of the forward's size for each input that needs a
  gradient (dA and dB of a matmul; a linear recurrence's dA and dX each scan back)."""
  return f * sum(flags)


def _once(f: int, flags: list[bool]) -> int:
  """The backward of elementwise and data-moving work: about the forward's, once."""
  return f if any(flags) else 0


def _twice(f: int, flags: list[bool]) -> int:
  """Attention's and an einsum's backward: twice the forward."""
  return 2 * f if any(flags) else 0


# op name → backward(forward flops, whether each tensor input needs a gradient) → flops, or
# the reason no gradient passes the op (none is counted, and none flows past it). A product
# counts its forward once for each input that needs a gradient, so a new product op is not
# undercounted; every other kind, its forward once.
BACKWARD = OpTable("backward FLOPs", "sexpgpu/lower/flops.py",
                   {k: _each_input if k == "product" else _once for k in KINDS})
BACKWARD.register(_twice, "sdpa", "einsum")
BACKWARD.register(_each_input, "linear-recurrence")
BACKWARD.register("passes no gradient", "stop-gradient")

# op name → which of its inputs the backward reads (kept from the forward for it), or the
# reason it reads none (a sum, a view, a comparison): run/planning/layout_plan.py counts them as a
# step's activations. Products, losses, normalizations and nonlinearities read theirs.
_NONE = "its gradient reads none of its inputs"


def _inputs(node: Node) -> tuple:
  return tuple(node.inputs)


SAVES = OpTable("saved inputs", "sexpgpu/lower/flops.py", {
    "pointwise": _inputs, "product": _inputs, "loss": _inputs, "along": _inputs,
    "window": _inputs, "function": _inputs, "opaque": _inputs, "reduction": _NONE,
    "movement": _NONE, "mask": _NONE, "constant": "has no inputs", "random": "has no inputs"})
SAVES.register(_NONE, "+", "-", "neg", "cast", "where", "dropout", "tap", "stop-gradient",
               "mod", "floor", "ceil", "round", "sign", "isfinite", "logical-not",
               "logical-and", "logical-or", "<", "<=", ">", ">=", "=", "!=", "cumsum",
               "argsort", "top-k-indices", "avg-pool")
SAVES.register(_inputs, "logsumexp", "max-of", "min-of", "take", "take-along")
SAVES.register(lambda node: tuple(node.inputs[1:2]), "scatter-add")  # its indices


def saved_inputs(node: Node) -> tuple:
  """The inputs of `node` its backward reads (none for a leaf or an op that reads none)."""
  if node.op in LEAVES or node.op not in SAVES:
    return ()
  rule = SAVES[node.op]
  return () if isinstance(rule, str) else rule(node)


def _backward(roots: list[Node], needs: dict[int, bool]) -> int:
  """Flops of the backward pass over `roots`; `needs` is filled with uid → whether the
  value depends on a parameter (only such values carry a gradient)."""
  return _backward_nodes(walk(roots), needs)


def _backward_nodes(nodes, needs: dict[int, bool]) -> int:
  total = 0
  for node in nodes:
    ins = [i for i in node.inputs if isinstance(i, Node)]
    if node.op == "param":
      needs[node.uid] = True
    elif node.op in ("input", "carry"):  # a body's argument: as its body set it
      needs[node.uid] = needs.get(node.uid, node.op == "carry")
    elif node.op == "repeat":
      body = node.attr("body")
      inner = {body.carry.uid: True}
      total += node.attr("n") * _backward([body.output], inner)
      needs[node.uid] = True
    elif _is_function(node):  # its function's backward, once a trip
      f, inner = _scan_backward(node, needs)
      total += _trips(node) * f
      needs[node.uid] = any(inner.get(r.uid, False) for r in node.attr("body").results)
    elif node.op == "part":  # one value of a scan's tuple: computes nothing, carries its need
      needs[node.uid] = any(needs.get(i.uid, False) for i in ins)
    else:
      flags = [needs.get(i.uid, False) for i in ins]
      rule = BACKWARD[node.op]
      needs[node.uid] = any(flags) and not isinstance(rule, str)
      if needs[node.uid]:
        total += rule(node_flops(node), flags)
  return total


def _is_function(node: Node) -> bool:
  """Whether the node applies a function of the IR (a scan: its body counts per trip)."""
  op = OPS.get(node.op)
  return op is not None and op.kind == "function"


def _scan_backward(node: Node, needs: dict[int, bool]) -> tuple[int, dict[int, bool]]:
  """(the backward flops of one trip of a scan's function, what needs a gradient in it).

  An argument needs one where its operand does; a carry also where the function makes its
  next value from one that does (a parameter read at every position)."""
  body, k = node.attr("body"), node.attr("carries")
  ops = node.inputs[:node.attr("operands")]
  if node.op == "scan":
    flags = [needs.get(i.uid, False) for i in ops]
  else:  # both arguments of a combination are elements of the operands
    flags = [needs.get(i.uid, False) for i in ops] * 2
  while True:
    inner = dict(needs)
    inner.update({a.uid: f for a, f in zip(body.args, flags)})
    f = _backward_nodes(body_nodes(node), inner)
    out = [inner.get(r.uid, False) for r in body.results]
    grown = [a or b for a, b in zip(flags, out[:k] + flags[k:])] if node.op == "scan" else \
        [a or b for a, b in zip(flags, out + out)]
    if grown == flags:
      return f, inner
    flags = grown


def train_flops(graph: Graph, microbatches: int) -> int:
  """Flops of one optimizer step over every microbatch: the forward, and a backward that
  computes only the gradients a parameter needs (no gradient of a batch's own inputs, which
  the 6N rule counts and XLA does not compute)."""
  roots = list(graph.outputs.values())
  return (forward_flops(graph) + _backward(roots, {})) * microbatches


def _value_bytes(roots: list[Node]) -> int:
  total = 0
  for node in walk(roots):
    if node.op == "repeat":
      total += node.attr("n") * _value_bytes([node.attr("body").output])
    elif _is_function(node):  # each trip's values, and the stacked ones
      body = body_nodes(node)
      total += _trips(node) * sum(math.prod(n.shape) * np_dtype(n.dtype).itemsize
                                  for n in body if n.op not in LEAVES and n.dtype != "tuple")
      total += sum(math.prod(s) * np_dtype(d).itemsize for d, s in node.attr("types"))
    elif node.op not in LEAVES:
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
  return peak if precision in ("bf16", "fp8") else peak / 2


def device_peak(device, precision: str, cache: str | None = None) -> float | None:
  """The device's peak flop/s: the table for GPUs, a measured matmul rate for the CPU."""
  if device.platform in ("gpu", "cuda"):
    return gpu_peak(getattr(device, "device_kind", ""), precision)
  return _cpu_peak(cache)


_CPU_PEAK: float | None = None
# The file in the run's cache folder that keeps the measured rate, by machine_key().
PEAK_FILE = "cpu-peak.json"


def machine_key() -> str:
  """What the CPU's measured matmul rate depends on: the machine, its processor, the cores
  this process may use, JAX's and jaxlib's versions and XLA_FLAGS."""
  import os
  import platform

  import jax
  import jaxlib
  model = ""
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      model = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), "")
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return (f"{platform.machine()} {model or platform.processor()} cores {cores} "
          f"jax {jax.__version__} jaxlib {jaxlib.__version__} "
          f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')}")


def _cpu_peak(cache: str | None) -> float:
  """A 1024² f32 matmul's rate on this CPU: measured once per process, and kept in `cache`
  (the run's cache folder) by machine_key(), so that a later run neither compiles nor times
  the probe. The probe's input is put, not made on the device (jnp.ones would compile a
  broadcast and a convert): one executable, the matmul."""
  global _CPU_PEAK
  if _CPU_PEAK is None:
    import json
    import os
    import time

    import jax
    import numpy as np
    path, key = (os.path.join(cache, PEAK_FILE) if cache else None), machine_key()
    kept = _read_json(path)
    if isinstance(kept.get(key), (int, float)) and kept[key] > 0:
      _CPU_PEAK = float(kept[key])
      return _CPU_PEAK
    n = 1024
    x = jax.device_put(np.ones((n, n), np.float32))
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(3):
      t = time.perf_counter()
      f(x).block_until_ready()
      best = min(best, time.perf_counter() - t)
    _CPU_PEAK = 2 * n ** 3 / best
    if path is not None:
      try:  # written whole or not at all; a folder that cannot be written measures again
        os.makedirs(cache, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
          json.dump({**kept, key: _CPU_PEAK}, out, indent=1, sort_keys=True)
        os.replace(tmp, path)
      except OSError:
        pass
  return _CPU_PEAK


def _read_json(path: str | None) -> dict:
  """The object in the file at `path`, or {} (no path, no file, unreadable or not an object)."""
  import json
  if path is None:
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      got = json.load(f)
  except (OSError, ValueError):
    return {}
  return got if isinstance(got, dict) else {}

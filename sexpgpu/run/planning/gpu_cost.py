"""The paper plan's GPU step time: matmuls at the throughput their shapes reach, attention at
its kernel's, memory-bound work at HBM bandwidth, collectives at NCCL's bus bandwidth with
FSDP's all-gathers hidden behind compute, and each kernel's launch.

Every parameter is a datasheet or a published microbenchmark figure, cited where it is set;
none is fitted to a published training run (benchmarks/plan_vs_published.py holds the model
against those). The terms of one device's step:

- matmul: each product of the graph (and its two backward products, dX and dW) at
  `mamf × waves` of the dense peak: the best rate a large GEMM reaches (MAMF) times the
  share of the SMs its output tiles keep busy (wave quantization), or at HBM bandwidth when
  its operands' bytes take longer than its arithmetic;
- attention: each sdpa's FLOPs at the forward and backward efficiency of the kernel that
  serves it on that GPU (cuDNN's fused attention for bf16, the Pallas flash kernel on Triton
  otherwise, as lower/attention.py chooses when each is available);
- memory-bound: every other op's bytes at HBM bandwidth, elementwise chains fused as XLA's
  loop fusion fuses them (a value is written only where a product, attention or the step's
  end reads it), the backward at twice the forward's bytes, plus the optimizer's pass;
- collectives exposed: FSDP's parameter all-gathers overlap the compute (XLA's latency
  hiding scheduler gathers block i+1 while block i computes) and its gradients'
  reduce-scatters the backward, all but one block's share; data's all-reduce after the last
  microbatch, tensor's all-reduces and expert's all-to-alls lie on the critical path and
  are charged whole;
- overhead: each kernel's launch.
"""

from __future__ import annotations

import dataclasses
import math

from sexpgpu.ir.graph import Node, walk
from sexpgpu.ir.opdef import LEAVES
from sexpgpu.ir.shapes import np_dtype


@dataclasses.dataclass(frozen=True)
class GpuCost:
  """One GPU kind's figures for the step-time model.

  Attributes:
    name: the plan's table name (links.py's GPUS).
    peak: dense bf16 tensor-core flop/s (the datasheet's, without sparsity).
    mamf: the fraction of `peak` the best large bf16 GEMM sustains.
    sms: streaming multiprocessors (the units a GEMM's output tiles are spread over).
    hbm: memory bandwidth, bytes/s (datasheet).
    attention: kernel → (forward, backward) fraction of `peak` at head dim 128, long rows.
    within, across: NCCL's achievable bus bandwidth (bytes/s a GPU) inside a node and
      between nodes.
  """

  name: str
  peak: float
  mamf: float
  sms: int
  hbm: float
  attention: dict
  within: float
  across: float


# Peaks and HBM: NVIDIA's datasheets (A100 SXM 80GB: 312 TFLOP/s bf16, 2.039 TB/s; H100 SXM:
# 989 TFLOP/s, 3.35 TB/s; H200 SXM: the H100's compute, 4.8 TB/s; HGX B200: 2.25 PFLOP/s a
# GPU, 8 TB/s). SMs: the A100 and H100 whitepapers (108, 132), B200 148.
# MAMF: Stas Bekman's ml-engineering "Maximum Achievable Matmul FLOPS comparison table"
# (mamf-finder.py sweeps of bf16 GEMM shapes): A100 SXM 267.9 of 312 (85.9%), H100 SXM 792.1
# of 989 (80.1%); the H200 takes the H100's (same SMs and clocks) and the B200 the same
# fraction (no figure in the table).
# Attention: the FlashAttention-2 paper (Dao 2023, figs. 4-7: A100, causal, head dim 128,
# 2k-16k rows: forward ~190-225 of 312, backward ~160-190) for A100's cuDNN and flash kernels
# (cuDNN's fused attention is FA2-class there); the FlashAttention-3 paper (Shah et al.
# 2024, figs. 5-6: H100, causal, head dim 128: cuDNN forward ~580-620 of 989, FA2 and
# Triton's ~320-370; backward fig. 7: cuDNN ~450-500, FA2 ~250-300).
# NCCL bus bandwidth: nccl-tests all_reduce_perf busbw inside a DGX node as NVIDIA and
# ml-engineering's network chapter report it (A100 NVLink3 ~230 GB/s of 300 a direction,
# H100 NVLink4 ~360 GB/s of 450 without NVLS); across nodes ~80% of the NIC's line rate
# (HDR 200 Gb/s ~20 GB/s, NDR 400 Gb/s ~40 GB/s a GPU) in the same reports.
GPUS = {
    "A100": GpuCost("A100", 312e12, 0.859, 108, 2.039e12,
                    {"cudnn": (0.65, 0.55), "pallas-flash": (0.55, 0.45)}, 230e9, 20e9),
    "H100": GpuCost("H100", 989e12, 0.801, 132, 3.35e12,
                    {"cudnn": (0.60, 0.47), "pallas-flash": (0.35, 0.28)}, 360e9, 40e9),
    "H200": GpuCost("H200", 989e12, 0.801, 132, 4.8e12,
                    {"cudnn": (0.60, 0.47), "pallas-flash": (0.35, 0.28)}, 360e9, 40e9),
    "B200": GpuCost("B200", 2250e12, 0.801, 148, 8.0e12,
                    {"cudnn": (0.60, 0.47), "pallas-flash": (0.35, 0.28)}, 720e9, 40e9),
}
# CUTLASS 3's Hopper (and cuBLAS's large-problem) bf16 GEMM tile: 128 × 256 outputs a CTA;
# NVIDIA's "Matrix Multiplication Background User's Guide" explains tile and wave
# quantization with it.
TILE = (128, 256)
# A head dim of 64 runs at ~0.8 of 128's rate (FA2 paper figs. 4-5, FA3 paper fig. 5).
SMALL_HEAD = 0.8
# One kernel's launch and the gap after it: ~4 µs (NVIDIA's "Getting Started with CUDA
# Graphs" blog measures 3-4 µs a kernel launched back to back without a graph).
LAUNCH = 4e-6
PRODUCTS = ("matmul", "einsum", "conv", "chunked-cross-entropy")
# FP8 (`:precision fp8`): the dense FP8 tensor-core peak is twice bf16's on every card that
# has one (H100/H200 SXM datasheets: 1,979 vs 989 TFLOP/s; HGX B200: 4.5 vs 2.25 PFLOP/s).
# No published MAMF sweep of FP8 GEMMs sits beside the bf16 one above: the bf16 fraction is
# assumed for FP8 too. Current scaling reads each operand twice (its amax, then the
# conversion) and writes it as one byte: the HBM bytes an element adds, for a bf16 activation
# or cotangent and for an f32 weight.
FP8_SPEEDUP = 2.0
FP8_QUANT_BYTES = {"activation": 2 + 2 + 1, "weight": 4 + 4 + 1}
VIEWS = ("reshape", "transpose", "broadcast", "expand", "squeeze")


def cost(name: str) -> GpuCost:
  """The model's figures for a GPU of the plan's table (`H100`); KeyError when absent."""
  return GPUS[name.upper()]


def matmul_seconds(gpu: GpuCost, m: int, n: int, k: int, itemsize: int = 2) -> float:
  """Seconds of one [m, k] × [k, n] product: at MAMF times the share of the SMs its output
  tiles keep busy, or its operands' and result's bytes at HBM bandwidth, whichever is longer."""
  if m * n * k == 0:
    return 0.0
  tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
  waves = math.ceil(tiles / gpu.sms)
  busy = m * n / (waves * gpu.sms * TILE[0] * TILE[1])
  arithmetic = 2 * m * n * k / (gpu.peak * gpu.mamf * busy)
  memory = itemsize * (m * k + k * n + m * n) / gpu.hbm
  return max(arithmetic, memory)


def matmul_efficiency(gpu: GpuCost, m: int, n: int, k: int) -> float:
  """The fraction of the dense peak a product of that shape reaches."""
  return 2 * m * n * k / gpu.peak / matmul_seconds(gpu, m, n, k)


def memory_seconds(gpu: GpuCost, nbytes: float) -> float:
  """Seconds to move `nbytes` through HBM at the datasheet bandwidth."""
  return nbytes / gpu.hbm


def attention_kernel(precision: str) -> str:
  """The kernel lower/attention.py serves a GPU's attention with: cuDNN's fused attention
  takes bf16 (it refuses f32), the Pallas flash kernel on Triton the rest."""
  return "cudnn" if precision in ("bf16", "fp8") else "pallas-flash"


def _bytes(node) -> int:
  return 0 if node.dtype == "tuple" else math.prod(node.shape) * np_dtype(node.dtype).itemsize


def _source(x):
  while getattr(x, "op", None) in VIEWS:
    x = x.inputs[0]
  return x


def _kind(node) -> str:
  if node.op in PRODUCTS:
    return "matmul"
  if node.op == "sdpa":
    return "attention"
  if node.op in LEAVES or node.op in VIEWS:
    return "none"
  return "memory"


def graph_work(graph, gpu: GpuCost, precision: str, fp8: frozenset = frozenset()) -> dict:
  """One microbatch's forward and backward on one GPU, each term's seconds and kernels.

  Returns:
    {"matmul", "attention", "memory": seconds; "kernels": launches; "repeat": the part of
    each inside repeated blocks (seconds of one forward, for remat); "blocks": trips of
    repeated blocks}. `fp8`: the uids of the products lower/fp8.py runs in float8.
  """
  item = 2 if precision in ("bf16", "fp8") else 4
  fwd, bwd = gpu.attention[attention_kernel(precision)]
  out = {"matmul": 0.0, "attention": 0.0, "memory": 0.0, "kernels": 0, "repeat": 0.0,
         "blocks": 0}

  def visit(roots, times: int, inside: bool):
    nodes = list(walk(roots))
    readers: dict = {}
    for node in nodes:
      for x in (i for i in node.inputs if isinstance(i, Node)):
        readers.setdefault(getattr(_source(x), "uid", None), []).append(_kind(node))
    for node in nodes:
      if node.op == "repeat":
        n = int(node.attr("n"))
        out["blocks"] += times * n
        visit([node.attr("body").output], times * n, True)
        continue
      kind, secs = _kind(node), 0.0
      if kind == "matmul" and node.uid in fp8:
        secs, quant = _product_fp8(node, gpu)
        out["memory"] += times * quant
        out["kernels"] += times * 3  # the amax, the conversion, a third for the cotangent
      elif kind == "matmul":
        secs = _product(node, gpu, item)
      elif kind == "attention":
        q, k = node.inputs[:2]
        flops = 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
        flops //= 2 if node.attr("causal") else 1
        blocks = math.prod(q.shape[:-2]) * math.ceil(q.shape[-2] / 128)
        busy = blocks / (math.ceil(blocks / gpu.sms) * gpu.sms)
        rate = gpu.peak * busy * (SMALL_HEAD if q.shape[-1] < 128 else 1.0)
        secs = flops / (rate * fwd) + 2 * flops / (rate * bwd)
      elif kind == "memory":
        secs = 3 * _fused_bytes(node, readers, item) / gpu.hbm  # forward + twice backward
      else:
        continue
      out[kind] += times * secs
      out["repeat"] += times * secs / (3 if kind != "attention" else 1 + 2 * fwd / bwd) \
          if inside else 0.0
      out["kernels"] += times * (3 if kind == "matmul" else 2 if kind == "attention" else
                                 (3 if _written(node, readers) else 0))
  visit(list(graph.outputs.values()), 1, False)
  return out


def _product(node, gpu: GpuCost, item: int) -> float:
  """A product's forward and its backward's two products (dX: [m, n]·[n, k]; dW: [k, m]·[m, n])."""
  if node.op in ("matmul", "chunked-cross-entropy"):
    x, w = node.inputs[:2]
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    n = w.shape[-1] if node.op == "chunked-cross-entropy" else node.shape[-1]
    secs = 0.0
    if node.op == "chunked-cross-entropy":  # the logits (f32) written and read a chunk at a time
      secs += 3 * 2 * 4 * m * n / gpu.hbm
    return secs + (matmul_seconds(gpu, m, n, k, item) + matmul_seconds(gpu, m, k, n, item)
                   + matmul_seconds(gpu, k, n, m, item))
  from sexpgpu.lower.flops import node_flops  # an einsum or convolution: at MAMF
  return 3 * node_flops(node) / (gpu.peak * gpu.mamf)


def _product_fp8(node, gpu: GpuCost) -> tuple[float, float]:
  """An FP8 product's three GEMMs at the FP8 rate with one-byte operands, and the seconds
  its current scaling spends quantising x, w (forward) and the cotangent (backward)."""
  x, w = node.inputs[:2]
  act, wt = FP8_QUANT_BYTES["activation"], FP8_QUANT_BYTES["weight"]
  fast = dataclasses.replace(gpu, peak=gpu.peak * FP8_SPEEDUP)
  if node.op == "einsum":  # an expert einsum: its three products at the FP8 MAMF rate
    from sexpgpu.lower.flops import node_flops
    quant = (act * math.prod(x.shape) + wt * math.prod(w.shape)
             + act * math.prod(node.shape)) / gpu.hbm
    return 3 * node_flops(node) / (fast.peak * fast.mamf), quant
  k, m, n = x.shape[-1], math.prod(x.shape[:-1]), node.shape[-1]
  gemms = (matmul_seconds(fast, m, n, k, 1) + matmul_seconds(fast, m, k, n, 1)
           + matmul_seconds(fast, k, n, m, 1))
  quant = (act * m * k + wt * k * n + act * m * n) / gpu.hbm
  return gemms, quant


def _written(node, readers) -> bool:
  """Whether a memory-bound op's value leaves its fusion: a product or attention reads it,
  or the step's end (nothing in the graph reads it)."""
  got = readers.get(node.uid)
  return not got or any(k in ("matmul", "attention") for k in got)


def _fused_bytes(node, readers, item: int) -> int:
  """A memory-bound op's HBM traffic under loop fusion: the inputs a product, attention or
  a leaf made (read), and its own value when it leaves the fusion (written)."""
  total = sum(_value_bytes(_source(x), item) for x in node.inputs
              if isinstance(x, Node) and _kind(_source(x)) != "memory")
  return total + (_value_bytes(node, item) if _written(node, readers) else 0)


def _value_bytes(node, item: int) -> int:
  """A value's bytes on the GPU: the IR's f32 activations at the run's precision (bf16 runs
  compute in bf16), parameters and other dtypes as they are."""
  if node.op not in LEAVES and node.dtype == "f32":
    return math.prod(node.shape) * item
  return _bytes(node)


_CACHE: dict = {}


def work(graph, gpu: GpuCost, precision: str, only: tuple = ()) -> dict:
  """`graph_work`, remembered for the graph (every candidate of a plan shares it); `only`:
  the run's `:fp8` globs (lower/fp8.py's `selected`)."""
  key = (id(graph), gpu.name, precision, tuple(only))
  if precision not in ("bf16", "fp8"):  # f32 runs take TF32's tensor-core rate (links.py)
    gpu = dataclasses.replace(gpu, peak=gpu.peak / 2)
  if key not in _CACHE or _CACHE[key][0] is not graph:
    fp8 = frozenset()
    if precision == "fp8":
      from sexpgpu.lower.fp8 import selected
      fp8 = selected(graph, tuple(only))
    _CACHE[key] = (graph, graph_work(graph, gpu, precision, fp8))
  return _CACHE[key][1]


def collective_seconds(col, gpu: GpuCost, n: int) -> float:
  """A collective's seconds alone: its ring bytes at NCCL's bus bandwidth for the link it
  crosses, and its calls' latency (~10 µs inside a node, ~20 µs across: links.py)."""
  moved = 2 * (n - 1) / n if col.kind == "all-reduce" else (n - 1) / n
  bus = gpu.within if col.crosses == "within" else gpu.across
  return moved * col.nbytes / bus + col.count * (10e-6 if col.crosses == "within" else 20e-6)


def exposed(col, gpu: GpuCost, n: int, compute: float, blocks: int) -> float:
  """Seconds a collective adds to the step, less what hides behind `compute` seconds: FSDP's
  all-gathers and reduce-scatters sit inside the repeated blocks' scan, one block's at a
  time, and XLA's latency hiding scheduler runs them beside the neighbouring block's
  compute, so all but one block's share can hide; data's all-reduce (after the last
  microbatch), tensor's all-reduces and expert's all-to-alls lie on the critical path."""
  secs = collective_seconds(col, gpu, n)
  if col.axis == "fsdp":
    return max(secs - compute, secs / (blocks + 1))
  return secs


def charge(cand, graph, hw, microbatches: int, precision: str, fp8_spec=None) -> None:
  """Sets a layout_plan Candidate's compute and collectives' seconds by this model and keeps
  each term in `cand.terms` (seconds a step on one device).

  Args:
    cand: the candidate, its collectives and update already estimated.
    graph: the train graph.
    hw: links.py's Hardware of a GPU of `GPUS`.
    microbatches: K, microbatches a step.
    precision: the run's precision.
    fp8_spec: the run's `:fp8` (front/tuning.py's Spec of its globs), or None.
  """
  gpu = cost(hw.name)
  w = work(graph, gpu, precision, () if fp8_spec is None else tuple(fp8_spec.get("patterns")))
  devices = math.prod(s for _, s in cand.mesh)
  share = microbatches / devices  # microbatches a device runs (a tensor group splits each)
  remat = w["repeat"] if cand.remat else 0.0
  terms = {"matmul": share * w["matmul"], "attention": share * w["attention"],
           "memory-bound": share * w["memory"] + cand.update, "remat": share * remat}
  busy = terms["matmul"] + terms["attention"] + terms["memory-bound"] + terms["remat"]
  sizes = dict(cand.mesh)
  # the gathers hide behind the forward and backward, the gradients' reduce-scatter behind
  # what of the backward (two thirds of the compute) the gathers leave
  left = {"all-gather": busy, "reduce-scatter": 2 * busy / 3}
  for col in sorted(cand.collectives, key=lambda x: x.kind != "all-gather"):
    hide = min(left.get(col.kind, 0.0), left["all-gather"])
    col.seconds = exposed(col, gpu, sizes[col.axis], hide, max(w["blocks"], 1))
    if col.axis == "fsdp":
      left["all-gather"] = max(left["all-gather"] - (collective_seconds(
          col, gpu, sizes[col.axis]) - col.seconds), 0.0)
  terms["collectives exposed"] = sum(c.seconds for c in cand.collectives)
  terms["overhead"] = share * w["kernels"] * LAUNCH
  cand.compute = busy - cand.update + terms["overhead"]
  cand.terms = terms


def terms_line(cand) -> str:
  """The plan's line of a step's terms: `matmul 412 ms, attention …`."""
  parts = [f"{k} {_ms(v)}" for k, v in cand.terms.items() if k != "remat" or v]
  return ", ".join(parts)


def _ms(s: float) -> str:
  return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


__all__ = ["GPUS", "GpuCost", "charge", "cost", "matmul_efficiency", "matmul_seconds",
           "memory_seconds", "terms_line", "work"]

"""FP8 matmuls (`:precision fp8`): the hidden layers' products in float8 with current scaling.

Each selected product `x @ w` quantises both operands to e4m3 (`float8_e4m3fn`) with a
per-tensor scale from the current tensor's absolute maximum (current scaling, as torchao's
Float8 dynamic scaling and Transformer Engine's `Float8CurrentScaling` do: no amax history,
so no scale state to carry or checkpoint), and its gradient quantises the incoming cotangent
to e5m2 (`float8_e5m2`: range over precision) the same way. Everything else runs in bf16.

The dequantised form, `convert(q_f8 → bf16) × scale` on each operand and then the dot, is
the pattern XLA's GPU `GemmRewriter` folds into one cuBLASLt FP8 gemm with the scales as its
a/b scale operands (xla/service/gpu/transforms/gemm_rewriter.cc, "ScaledABUnscaledD"); on
the CPU the same graph runs with the rounding to float8 done for real (XLA emulates f8), so
the numerics are the GPU's up to the order of the sums.

Which products: those whose right operand is a parameter of role `hidden` (ir/roles.py),
read whole as a matrix. Embeddings, the readout, norms and every activation × activation
product (attention's scores) stay bf16. `LowerCtx.fp8_only`, globs over parameter paths,
names the matrices instead (a readout too, when named).
"""

from __future__ import annotations

import fnmatch

import jax
import jax.numpy as jnp

from sexpgpu.errors import SxError
from sexpgpu.ir.graph import Graph, Node
from sexpgpu.ir.roles import all_nodes, roles

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
# The products' operands after dequantisation, and everything FP8 leaves alone.
WIDE = jnp.bfloat16
# The roles whose products go to FP8 by default.
ROLES = ("hidden",)
# Compute capability from which GPUs multiply in FP8 (Ada 8.9, Hopper 9.0, Blackwell 10.0).
MIN_CAPABILITY = (8, 9)
# Ops a weight passes through unchanged on its way to the product.
_VIEWS = ("cast", "tap")


def quantise(x, dtype):
  """(x in `dtype`, its scale): x × (dtype's largest / amax(x)) rounded to `dtype`, and the
  factor that brings it back (1 / that multiplier). Current scaling: the amax is this
  tensor's own; an all-zero tensor keeps the multiplier 1."""
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32))
  top = jnp.float32(jnp.finfo(dtype).max)
  mult = jnp.where(amax > 0, top / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0)
  q = jnp.clip(x32 * mult, -top, top).astype(dtype)
  return q, (1.0 / mult).astype(jnp.float32)


def dequantise(q, scale):
  """`q` widened to bf16 and multiplied by its scale: the operand form cuBLASLt's FP8 gemm
  takes (XLA folds the convert and the scale into the call)."""
  return q.astype(WIDE) * scale.astype(WIDE)


def _dot(a, b, a_axes, b_axes):
  """a · b contracting `a_axes` with `b_axes`, summed in f32, on the dequantised operands as
  they are (no reshape or transpose between the scale and the dot)."""
  return jax.lax.dot_general(a, b, ((a_axes, b_axes), ((), ())),
                             preferred_element_type=jnp.float32)


@jax.custom_vjp
def fp8_matmul(x, w):
  """`x @ w` (f32 operands, w a matrix) with both in e4m3 under current scaling, summed in f32.

  Its gradient quantises the cotangent to e5m2 and multiplies it by the e4m3 operands kept
  from the forward product (each product of the backward pass in FP8 too)."""
  qx, sx = quantise(x, E4M3)
  qw, sw = quantise(w, E4M3)
  return _dot(dequantise(qx, sx), dequantise(qw, sw), (x.ndim - 1,), (0,))


def _fwd(x, w):
  qx, sx = quantise(x, E4M3)
  qw, sw = quantise(w, E4M3)
  out = _dot(dequantise(qx, sx), dequantise(qw, sw), (x.ndim - 1,), (0,))
  # the float8 operands, not the wide ones, are what the backward pass keeps
  return out, (qx, sx, qw, sw)


def _bwd(res, g):
  qx, sx, qw, sw = res
  qg, sg = quantise(g, E5M2)
  g8 = dequantise(qg, sg)
  lead = tuple(range(g.ndim - 1))
  dx = _dot(g8, dequantise(qw, sw), (g.ndim - 1,), (1,))  # g · wᵀ
  dw = _dot(dequantise(qx, sx), g8, lead, lead)  # xᵀ · g over every leading axis
  return dx, dw


fp8_matmul.defvjp(_fwd, _bwd)


def matmul_rule(ctx, a, b):
  """The lowering of a product the FP8 selection names: FP8 where `b` is a float matrix,
  the bf16 product otherwise (a shape the selection did not foresee)."""
  if b.ndim == 2 and a.ndim >= 1 and jnp.issubdtype(a.dtype, jnp.floating) and \
      jnp.issubdtype(b.dtype, jnp.floating):
    refuse_old_gpu(ctx)
    ctx.notes.append({"kind": "fp8", "shape": (tuple(a.shape), tuple(b.shape))})
    out = fp8_matmul(a.astype(jnp.float32), b.astype(jnp.float32))
    return out.astype(jnp.result_type(a, b))
  from sexpgpu.ir.ops import OPS
  return OPS["matmul"].lower(ctx, a, b)


def _weight(node) -> Node | None:
  """The `param` node a product's right operand is, through casts and taps, or None."""
  while isinstance(node, Node) and node.op in _VIEWS:
    node = node.inputs[0]
  return node if isinstance(node, Node) and node.op == "param" else None


def selected(graph: Graph, only: tuple[str, ...] = ()) -> frozenset:
  """The uids of the `matmul` nodes of `graph` that run in FP8: those whose right operand is
  a parameter read whole as a matrix (its per-layer shape in a repeat) of a role in ROLES,
  or, with `only`, whose path one of those globs matches (the readout too, when named).

  Raises:
    SxError: E-RUN-002 for a glob that matches no parameter a product reads as its matrix.
  """
  key = (id(graph), tuple(only))
  hit = _CACHE.get(key)
  if hit is not None and hit[0] is graph:
    return hit[1]
  weights = {}  # matmul uid → its matrix's path
  for node in all_nodes(graph):
    if node.op == "matmul" and len(node.inputs) >= 2:
      w = _weight(node.inputs[1])
      if w is not None and len(w.shape) == 2:
        weights[node.uid] = w.attr("path")
  if only:
    paths = sorted(set(weights.values()))
    for pat in only:
      if not any(fnmatch.fnmatchcase(p, pat) for p in paths):
        raise SxError("E-RUN-002", f"fp8 pattern \"{pat}\" matches no matrix a product reads",
                      where="fp8", fix="name the parameters as `check --print params` lists "
                      "them, e.g. \"*/mlp/*\"; products here: " + ", ".join(paths[:6]))
    out = {u for u, p in weights.items() if any(fnmatch.fnmatchcase(p, g) for g in only)}
  else:
    found = roles(graph)
    out = {u for u, p in weights.items() if p in found and found[p].role in ROLES}
  if len(_CACHE) > 64:
    _CACHE.clear()
  _CACHE[key] = (graph, frozenset(out))
  return _CACHE[key][1]


# (id(graph), globs) → (the graph, kept so that its id is not reused; its selection)
_CACHE: dict[tuple, tuple[Graph, frozenset]] = {}


def selected_paths(graph: Graph, only: tuple[str, ...] = ()) -> list[str]:
  """The parameter paths whose products `selected` puts in FP8, in the graph's order."""
  uids = selected(graph, only)
  paths = {}
  for node in all_nodes(graph):
    if node.uid in uids:
      paths[_weight(node.inputs[1]).attr("path")] = True
  return [p for p in graph.params if p in paths]


def capability_ok(capability: tuple[int, int] | None) -> bool:
  """Whether a GPU of this compute capability multiplies in FP8 (None: not known, allowed)."""
  return capability is None or tuple(capability) >= MIN_CAPABILITY


def refuse(card: str, capability: tuple[int, int], where: str) -> None:
  """Raises E-PREC-001 for FP8 on `card` of `capability` (below 8.9), found at `where`."""
  major, minor = capability
  raise SxError("E-PREC-001", f"{card} has compute capability {major}.{minor}; FP8 matmuls "
                f"need 8.9 or newer (Ada, Hopper, Blackwell)", where=where,
                fix=f"--set precision=bf16 on the {card}, or plan for --gpu H100 / H200")


def refuse_old_gpu(ctx) -> None:
  """E-PREC-001 when this step is traced for a CUDA device present here that is too old."""
  if ctx.platform != "gpu":
    return
  from sexpgpu.lower.cuda_target import cuda_present
  if not cuda_present():
    return
  device = jax.devices("cuda")[0]
  text = str(getattr(device, "compute_capability", "") or "")
  try:
    capability = tuple(int(p) for p in text.split(".")[:2])
  except ValueError:
    return
  if len(capability) == 2 and not capability_ok(capability):
    refuse(device.device_kind, capability, "--set precision=fp8 (the run's device)")

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
product (attention's scores) stay bf16. `:fp8 ["glob" ...]` (`LowerCtx.fp8_only`) names the
weights instead, a readout too; it may also name a two-operand einsum's weight (an MoE's
stacked experts, `ecd,edh->ech`), quantised per tensor the same way, each gradient an einsum
of the e5m2 cotangent. A product FP8 does not take (an einsum of three operands such as
Mixtral's weighted `w2`, a convolution) is refused when a pattern names its weight
(E-PREC-002), never left in bf16 unsaid.
"""

from __future__ import annotations

import fnmatch
import functools

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


def _einsum(spec, a, b):
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec, x, w):
  """The two-operand einsum `spec` of x and w with both in e4m3 under current scaling,
  summed in f32; its gradients are the einsums of the e5m2 cotangent with the e4m3 operands
  kept from the forward (`einsum_ok` says which specs have them)."""
  return _efwd(spec, x, w)[0]


def _efwd(spec, x, w):
  qx, sx = quantise(x, E4M3)
  qw, sw = quantise(w, E4M3)
  return _einsum(spec, dequantise(qx, sx), dequantise(qw, sw)), (qx, sx, qw, sw)


def _ebwd(spec, res, g):
  qx, sx, qw, sw = res
  a, rest = spec.replace(" ", "").split(",")
  b, c = rest.split("->")
  g8 = dequantise(*quantise(g, E5M2))
  dx = _einsum(f"{c},{b}->{a}", g8, dequantise(qw, sw))
  dw = _einsum(f"{a},{c}->{b}", dequantise(qx, sx), g8)
  return dx, dw


fp8_einsum.defvjp(_efwd, _ebwd)


def einsum_ok(spec: str) -> bool:
  """Whether FP8 takes the einsum `spec`: two operands, no ellipsis, no index repeated
  within an operand, and each operand's every index in the other or the result (so each
  gradient is one einsum of the cotangent with the other operand)."""
  spec = spec.replace(" ", "")
  if "..." in spec or spec.count("->") != 1 or spec.count(",") != 1:
    return False
  a, rest = spec.split(",")
  b, c = rest.split("->")
  if any(len(set(t)) != len(t) for t in (a, b, c)):
    return False
  return set(a) <= set(b) | set(c) and set(b) <= set(a) | set(c) and set(c) <= set(a) | set(b)


def matmul_rule(ctx, a, b, *more, spec: str | None = None):
  """The lowering of a product the FP8 selection names: a matmul of a float matrix `b`, or
  the two-operand einsum `spec` (the selection takes no other), in FP8.

  Raises:
    SxError: E-PREC-001 on a CUDA device below compute capability 8.9 (refuse_old_gpu).
  """
  floats = all(jnp.issubdtype(v.dtype, jnp.floating) for v in (a, b, *more))
  if spec is None and b.ndim == 2 and a.ndim >= 1 and not more and floats:
    refuse_old_gpu(ctx)
    ctx.notes.append({"kind": "fp8", "shape": (tuple(a.shape), tuple(b.shape))})
    out = fp8_matmul(a.astype(jnp.float32), b.astype(jnp.float32))
    return out.astype(jnp.result_type(a, b))
  if spec is not None and not more and floats and einsum_ok(spec):
    refuse_old_gpu(ctx)
    ctx.notes.append({"kind": "fp8", "shape": (tuple(a.shape), tuple(b.shape)), "spec": spec})
    out = fp8_einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return out.astype(jnp.result_type(a, b))
  from sexpgpu.ir.ops import OPS
  if spec is not None:  # not reached from `selected`'s products: the op's own rule
    return OPS["einsum"].lower(ctx, a, b, *more, spec=spec)
  return OPS["matmul"].lower(ctx, a, b, *more)


def _weight(node) -> Node | None:
  """The `param` node a product's right operand is, through casts and taps, or None."""
  while isinstance(node, Node) and node.op in _VIEWS:
    node = node.inputs[0]
  return node if isinstance(node, Node) and node.op == "param" else None


# The products of the IR (gpu_cost.PRODUCTS): FP8 takes a matmul of a matrix and a two-operand
# einsum (`einsum_ok`); a pattern naming a weight only the others read is refused.
PRODUCTS = ("matmul", "einsum", "conv", "chunked-cross-entropy")


def _products(graph: Graph) -> tuple[dict, dict]:
  """({uid: weight path} of the products FP8 takes, {weight path: the op of a product it
  does not take}) over every node of `graph`, repeats' bodies included."""
  hit = _PRODUCTS.get(id(graph))
  if hit is not None and hit[0] is graph:
    return hit[1]
  takes, others = {}, {}
  for node in all_nodes(graph):
    if node.op not in PRODUCTS:
      continue
    ws = [_weight(x) for x in node.inputs if isinstance(x, Node)]
    ws = [w for w in ws if w is not None]
    if node.op == "matmul" and len(node.inputs) == 2 and _weight(node.inputs[1]) is not None \
        and len(_weight(node.inputs[1]).shape) == 2:
      takes[node.uid] = _weight(node.inputs[1]).attr("path")
    elif node.op == "einsum" and len(node.inputs) == 2 and ws and einsum_ok(node.attr("spec")):
      takes[node.uid] = ws[-1].attr("path")
    else:
      for w in ws:
        if node.op == "einsum":
          why = f'einsum "{node.attr("spec")}" of {len(node.inputs)} operands'
        elif node.op == "matmul":
          why = f"a matmul reading a {len(w.shape)}-d weight, or one on its left"
        else:
          why = node.op
        others.setdefault(w.attr("path"), why)
  if len(_PRODUCTS) > 64:
    _PRODUCTS.clear()
  _PRODUCTS[id(graph)] = (graph, (takes, others))
  return takes, others


def selected(graph: Graph, only: tuple[str, ...] = ()) -> frozenset:
  """The uids of the products of `graph` that run in FP8: the matmuls and two-operand
  einsums whose weight (a parameter, through casts and taps) has a role in ROLES, or, with
  `only`, whose weight's path one of those globs matches. A glob naming nothing of this
  graph selects nothing here (`check_patterns` holds the run's patterns to the loss)."""
  key = (id(graph), tuple(only))
  hit = _CACHE.get(key)
  if hit is not None and hit[0] is graph:
    return hit[1]
  weights, _ = _products(graph)
  if only:
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
_PRODUCTS: dict[int, tuple[Graph, tuple[dict, dict]]] = {}


def patterns(run: dict) -> tuple[str, ...]:
  """A run's `:fp8` globs (its `run` table, front/tuning.py's Spec), or () for the hidden
  matrices: what every LowerCtx of the run takes as `fp8_only`."""
  spec = run.get("fp8")
  return tuple(spec.get("patterns")) if spec is not None else ()


def check_patterns(graphs: list[Graph], run: dict) -> None:
  """Holds the run's `:fp8` globs to its loss graphs: each must name the weight of a product
  FP8 takes in one of them.

  Raises:
    SxError: E-RUN-002 at `:fp8` for a glob that names no product's weight (the products'
      weights listed); E-PREC-002 at `:fp8` for one that names a weight only products FP8
      does not take read (the product named).
  """
  spec = run.get("fp8")
  if spec is None:
    return
  takes, others = set(), {}
  for g in graphs:
    w, o = _products(g)
    takes |= set(w.values())
    others.update(o)
  for pat in spec.get("patterns"):
    bad = sorted(p for p in others if p not in takes and fnmatch.fnmatchcase(p, pat))
    if bad:
      raise SxError("E-PREC-002", f":fp8 pattern \"{pat}\" names {bad[0]}, whose product FP8 "
                    f"does not take ({others[bad[0]]}; it takes a matmul of a matrix or a "
                    "two-operand einsum)", location=spec.loc,
                    fix=f"leave {bad[0]} out of :fp8 (it stays bf16), or write its product "
                    "as two-operand einsums")
    if any(fnmatch.fnmatchcase(p, pat) for p in takes):
      continue
    raise SxError("E-RUN-002", f":fp8 pattern \"{pat}\" names no weight a product reads",
                  location=spec.loc, fix="name the weights as `check --print params` lists "
                  "them, e.g. \"*/mlp/*\"; products' weights here: "
                  + ", ".join(sorted(takes)[:6]))


def selected_paths(graph: Graph, only: tuple[str, ...] = ()) -> list[str]:
  """The parameter paths whose products `selected` puts in FP8, in the graph's order."""
  uids = selected(graph, only)
  weights, _ = _products(graph)
  paths = {weights[u] for u in uids}
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

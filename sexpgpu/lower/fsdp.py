"""FSDP: the train step with parameters, gradients, sums and optimizer state sharded.

Written as one global program under `jax.jit`, with each state array placed by a
`NamedSharding` and XLA's SPMD partitioner inserting the all-gathers of the
parameters and the reduce-scatters of the gradients. The alternative, `shard_map`
with explicit collectives (as the replicated data-parallel step is written), was
not taken:
- inside `shard_map` every optimizer that reads a global quantity
  (`clip_by_global_norm`, the gradient-norm metric, the diagnostics' norms) would
  see only its shard, so each such optax transform would need a collective of its
  own; under `jit` the optax chain runs unchanged on sharded arrays and the norms
  are global;
- a stacked `repeat` gathers one layer at a time inside its scan because the
  partitioner places the gather there; with `shard_map` the model's lowering would
  have to gather each layer's weights itself.
Measured (benchmarks/bench_fsdp_styles.py, 4 host devices, adam on a 4-layer MLP,
shard_map ÷ jit step): 0.35 at width 1024 and batch 256, 0.80 at batch 2048, 1.01 at
width 512 and batch 1024. So a hand-written step can be up to 2.8× faster where the
partitioner gathers activations rather than weights. At the benchmark's transformer
shape this step costs 1.05× the replicated step (bench_fsdp.py), so `jit` stays, and
written-out gathers are the place to look when a shape is slow. The microbatch split
is as in the replicated step: rank r runs microbatches r·K/R … (r+1)·K/R − 1 of a
step, with the same dropout keys.

One sum is written as an explicit collective all the same: with bf16 node gradients,
the nodes' sums cross the nodes in a `shard_map` reduce-scatter (fsdp) or all-reduce
(hsdp) of bf16 values. Left to the partitioner, the compiled program converted them
back to f32 before sending them, and the bf16 sum would have saved no bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower import fp8
from sexpgpu.lower.attention import under_rank_vmap
from sexpgpu.lower.interp import NOT_HANDLED, arguments, lowered, repeat_value, run_graph
from sexpgpu.lower.registry import lowering
from sexpgpu.lower.layouts import DATA_AXES
from sexpgpu.lower.step import TrainStep

SHARDINGS = ("replicate", "fsdp", "hsdp")


def shard_axes(mesh, sharding: str) -> tuple[str, ...]:
  """The mesh axes an array's state is split over: all of them (fsdp), or within a node
  (hsdp: the `gpu` axis of a (node, gpu) mesh; on one node that is every device).

  Over nodes fsdp splits `gpu`-major: a node's sum, split over its devices, then
  reduce-scattered over `node`, leaves each device exactly its parameters' shard."""
  names = tuple(mesh.axis_names)
  if "gpu" in names:
    return ("gpu",) if sharding == "hsdp" else ("gpu", "node")
  return names


def _split_axis(spec: P) -> int | None:
  """The axis a PartitionSpec splits (spec_for splits at most one), or None."""
  return next((i for i, a in enumerate(spec) if a is not None), None)


def spec_for(shape: tuple[int, ...], n: int, axes: tuple[str, ...], skip: int = 0) -> P:
  """Splits the largest axis that `n` divides (after the first `skip`, a repeat's layer
  axes, which stay whole so a scan gathers one layer at a time); else replicated."""
  best = None
  for i in range(skip, len(shape)):
    if shape[i] % n == 0 and shape[i] >= n and (best is None or shape[i] > shape[best]):
      best = i
  if best is None:
    return P()
  spec = [None] * len(shape)
  spec[best] = axes if len(axes) > 1 else axes[0]
  return P(*spec)


@dataclasses.dataclass
class ShardedTrainStep(TrainStep):
  """A TrainStep whose state is sharded over the mesh (`fsdp` or `hsdp`).

  `stacks` maps each parameter path to its repeat axes count, so the layer axes of a
  stacked repeat stay whole. On a mesh of named axes (`:sharding fsdp:2,tensor:2`,
  lower/layouts.py) `layout` gives each parameter's spec, the ranks' axis of the batch
  splits over the data axes only, and the partitioner splits the matmuls of a tensor
  pair rather than gathering their weights (measured in tests/test_layouts.py: no
  constraint on activations was needed, in an unrolled repeat or a scanned one).
  """

  sharding: str = "fsdp"
  stacks: dict = dataclasses.field(default_factory=dict)
  # a mesh of named axes (lower/layouts.py): each parameter path's PartitionSpec
  layout: dict | None = None
  # expert einsums' uids → where their tokens are held on `expert` (layouts.Pairs.dispatch)
  dispatch: dict = dataclasses.field(default_factory=dict)
  # sequence parallel: the uids of the tensor pairs' ends and starts (layouts.Pairs)
  ends: frozenset = frozenset()
  starts: frozenset = frozenset()
  inner: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    super().__post_init__()
    if self.mesh is None or self.ranks == 1:
      raise ValueError("a sharded step needs a mesh of several devices")
    if self.layout is not None:  # the batch splits over the data axes, never `tensor`
      self.over = tuple(a for a in ("fsdp",) if a in self.mesh.axis_names)
      self.data_axes = tuple(a for a in DATA_AXES if a in self.mesh.axis_names)
    else:
      self.over = shard_axes(self.mesh, self.sharding)
    self.n = int(np.prod([self.mesh.shape[a] for a in self.over]))
    self.gpus = self.ranks // self.nodes
    # bf16 sums between nodes: each node's f32 sum plus its carried rounding error, sent
    # as bf16 in the reduce-scatter (fsdp) or all-reduce (hsdp) over the node axis
    self.carried = self.node_gradients == "bf16" and self.nodes > 1
    self._fused = jax.jit(self._sharded_full, donate_argnums=(0,))
    self._update = jax.jit(self._sharded_update, donate_argnums=(0,))
    self._grads = jax.jit(self._sharded_chunk, donate_argnums=(4, 5))
    self._zeros_fn = jax.jit(self._sharded_zeros)
    self._specs: dict[tuple, P] = {}

  # --- where each array lives ------------------------------------------------------------
  def param_spec(self, path: str, shape: tuple[int, ...]) -> P:
    """A parameter's PartitionSpec."""
    if self.layout is not None:
      return self.layout.get(path, P())
    return spec_for(shape, self.n, self.over, self.stacks.get(path, 0))

  def _loss_and_grad(self, params, batch, step, index):
    """A microbatch's loss and gradients, with the layout's activations held where the
    rules place them (`_rule`); with tap diagnostics the partitioner chooses, with the
    same numbers."""
    if not (self.dispatch or self.ends) or any(d.kind == "tap" for d in self.diags):
      return super()._loss_and_grad(params, batch, step, index)
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), index)
    ctx = LowerCtx(self.precision, rng, True, self.notes, self.platform, fp8_only=self.fp8_only)
    if ctx.precision == "fp8":  # the rule lowers products itself: it needs the selection
      ctx = dataclasses.replace(ctx, fp8=fp8.selected(self.graph, ctx.fp8_only))

    def loss_fn(p):
      return run_graph(self.graph, p, batch, ctx, None, self._rule(p, batch, ctx))["out"].astype(
          jnp.float32)

    loss, grads = self._grad(loss_fn, params)
    return loss, jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads), {}

  def _held(self, x, axis: int | None, name: str):
    """`x` held split on `name` at `axis` (None: whole on every axis this rule names)."""
    spec = [None] * x.ndim
    if axis is not None:
      spec[axis] = name
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

  def _rule(self, params, inputs, ctx):
    """interp's per-node rule for the layout, asked inside repeats' bodies too:

    - expert parallel: the tokens an expert einsum reads and writes held on `expert`. Left
      to itself the partitioner gathers every whole expert weight to the tokens; held so,
      the dispatch and the combine become all-to-alls (tests/test_layouts.py reads them);
    - sequence parallel (Megatron's): a pair's end (a row half's matmul, the embedding's
      take) gives its sum split on the sequence axis (-2), so its all-reduce becomes a
      reduce-scatter and the norms, residual adds and dropouts up to the next pair run on a
      slice of the sequence; a pair's start (a column half's matmul) reads its input whole,
      one all-gather. Where the sequence does not divide over `tensor` the end stays an
      all-reduce. The cotangents are held the same way, so the backward pass mirrors it.
    """
    t = self.mesh.shape.get("tensor", 1)

    def rule(node, env):
      if node.op == "repeat":
        return repeat_value(node, env, params, inputs, ctx, None, self._rule)
      uid = node.uid
      if not (uid in self.dispatch or uid in self.ends or uid in self.starts
              or uid in self.inner):
        return NOT_HANDLED
      args = arguments(node, env)
      x = args[0]
      along = node.op == "matmul" and x.ndim >= 2 and x.shape[-2] % t == 0
      if along and (uid in self.starts or uid in self.ends):
        return self._pair_edge(node, args, ctx, uid in self.starts)
      if uid in self.dispatch:
        i, axis, out = self.dispatch[uid]
        args[i] = self._held(args[i], axis, "expert")
      if uid in self.starts:
        args[0] = self._held(x, None, "tensor")
      value = lowered(node, ctx, args, dict(node.attrs))
      if uid in self.dispatch:
        return self._held(value, self.dispatch[uid][2], "expert")
      if uid in self.inner:
        return self._held(value, self.inner[uid], "tensor")
      if uid in self.ends and value.ndim >= 2 and value.shape[-2] % t == 0:
        # an embedding's rows summed over the vocabulary's shards (held whole first, else the
        # partitioner may gather the table instead), then sliced on the sequence
        return self._held(self._held(value, None, "tensor"), value.ndim - 2, "tensor")
      return value
    return rule

  def _pair_edge(self, node, args, ctx, start: bool):
    """A pair's first or last matmul under sequence parallel, its collective written out
    over `tensor` (the other axes left to the partitioner): the start all-gathers its input
    [.. seq/t, in] and multiplies by its columns [in, out/t]; the end multiplies its
    [.. seq, in/t] by its rows [in/t, out] and reduce-scatters the sum on the sequence.
    Their transposes are each other's collective, so the backward pass is the mirror.
    Written out because the partitioner, given the same placement by constraints, sums with
    an all-reduce and slices it on host devices (no reduce-scatter pass on the CPU)."""
    x, w = args[0], args[1]
    lower, attrs = lowering(node.op, ctx.platform), dict(node.attrs)
    if node.uid in ctx.fp8:  # an FP8 product: each device's half scaled by its own amax
      lower = fp8.matmul_rule
    seq, rank = x.ndim - 2, x.ndim + w.ndim - 2

    def on(ndim, axis):
      spec = [None] * ndim
      spec[axis] = "tensor"
      return P(*spec)

    if start:
      def body(x_, w_):
        return lower(ctx, jax.lax.all_gather(x_, "tensor", axis=seq, tiled=True), w_, **attrs)
      specs, out = (on(x.ndim, seq), on(w.ndim, w.ndim - 1)), on(rank, rank - 1)
    else:
      def body(x_, w_):
        return jax.lax.psum_scatter(lower(ctx, x_, w_, **attrs), "tensor",
                                    scatter_dimension=seq, tiled=True)
      specs, out = (on(x.ndim, x.ndim - 1), on(w.ndim, 0)), on(rank, seq)
    return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out,
                         axis_names={"tensor"}, check_vma=False)(x, w)

  def carry_spec(self, path: str, shape: tuple[int, ...]) -> P:
    """A node sum's or carry's PartitionSpec ([nodes, *shape]): one row a node, the row
    split over that node's devices on the parameter's own split axis."""
    axis = _split_axis(self.param_spec(path, shape))
    if axis is None:
      inner = tuple(spec_for(shape, self.gpus, ("gpu",), self.stacks.get(path, 0)))
      inner += (None,) * (len(shape) - len(inner))
    else:
      inner = tuple("gpu" if i == axis else None for i in range(len(shape)))
    return P("node", *inner)

  def _node_sum(self, path: str, sent):
    """The nodes' bf16 sums ([nodes, *shape]) summed over `node` in bf16, as one explicit
    collective so the bytes between nodes are bf16 whatever the partitioner would choose:
    a reduce-scatter onto the parameter's shards (fsdp), or an all-reduce (hsdp, and an
    array no axis of which fits)."""
    shape = tuple(sent.shape[1:])
    spec, rows = self.param_spec(path, shape), self.carry_spec(path, shape)
    axis = _split_axis(spec)
    scatter = axis is not None and "node" in self.over

    def body(x):
      if scatter:
        return jax.lax.psum_scatter(x[0], "node", scatter_dimension=axis, tiled=True)
      return jax.lax.psum(x[0], "node")
    out = jax.shard_map(body, mesh=self.mesh, in_specs=rows,
                        out_specs=spec if scatter else P(*tuple(rows)[1:]), check_vma=False)
    return out(sent).astype(jnp.float32)

  def _carry_shardings(self, params: dict) -> dict:
    return {path: NamedSharding(self.mesh, self.carry_spec(path, tuple(p.shape)))
            for path, p in params.items()}

  def _sums_shardings(self, params: dict) -> dict:
    """Where the step's gradient sums live: by node when carried, else as the parameters."""
    return self._carry_shardings(params) if self.carried else self._param_shardings(params)

  def state_shardings(self, state: dict) -> dict:
    """NamedShardings for a train state: parameters by their spec, optimizer leaves under a
    parameter's path and of its shape as that parameter (else as the first parameter of
    their shape), everything else replicated."""
    by_shape, shapes = {}, {}
    for path, p in state["params"].items():
      shapes[path] = tuple(p.shape)
      by_shape.setdefault(tuple(p.shape), self.param_spec(path, tuple(p.shape)))

    def leaf(keys, x):
      shape = tuple(x.shape)
      for k in keys:
        path = getattr(k, "key", None)
        if isinstance(path, str) and shapes.get(path) == shape:
          return NamedSharding(self.mesh, self.param_spec(path, shape))
      return NamedSharding(self.mesh, by_shape.get(shape, P()))

    out = {}
    for k, v in state.items():
      if k == "params":
        out[k] = {path: NamedSharding(self.mesh, self.param_spec(path, tuple(p.shape)))
                  for path, p in v.items()}
      elif k == "carry":
        out[k] = {path: NamedSharding(self.mesh, self.carry_spec(path, tuple(x.shape[1:])))
                  for path, x in v.items()}
      else:
        out[k] = jax.tree_util.tree_map_with_path(leaf, v)
    return out

  def _param_shardings(self, params: dict) -> dict:
    return {path: NamedSharding(self.mesh, self.param_spec(path, tuple(p.shape)))
            for path, p in params.items()}

  def _constrain(self, tree, shardings):
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, tree, shardings)

  def _place_state(self, state):
    sh = self.state_shardings(state)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh)

  # --- the step ----------------------------------------------------------------------------
  def _by_rank(self, batches):
    """[K, ...] split by rank: [R, K/R, ...] (rank r's microbatches contiguous, as placed)."""
    per = self.microbatches // self.ranks
    out = jax.tree_util.tree_map(lambda x: x.reshape((self.ranks, per) + x.shape[1:]), batches)
    if self.layout is None:
      return out
    # a mesh: the ranks' axis over the data axes only; a tensor group computes together
    data = NamedSharding(self.mesh, P(self.data_axes or None))
    return jax.tree_util.tree_map(lambda x: jax.lax.with_sharding_constraint(x, data), out)

  def _ranks_grads(self, params, batches, step, offset):
    """Every rank's loss and gradient sums over its microbatches of `batches` ([R, S, ...]),
    summed over ranks into the parameters' shardings."""
    per = self.microbatches // self.ranks

    def rank(bb, r):
      loss, grads, _, tapped = self._stacked_grads(params, bb, step, offset + r * per)
      return loss, grads, tapped

    # attention's rules build (and probe) what batches under this vmap (lower/attention.py)
    with under_rank_vmap(self.ranks):
      loss, grads, tapped = jax.vmap(rank)(batches, jnp.arange(self.ranks))
    if self.carried:  # each node's sum, kept apart until the update sends it in bf16
      by_node = lambda g: jnp.sum(g.reshape((self.nodes, self.gpus) + g.shape[1:]), 1)
      grads = self._constrain(jax.tree_util.tree_map(by_node, grads),
                              self._carry_shardings(self._train(params)))
    else:
      grads = self._constrain(jax.tree_util.tree_map(lambda g: jnp.sum(g, 0), grads),
                              self._param_shardings(self._train(params)))
    tapped = {n: v.reshape(-1) for n, v in tapped.items()}
    return jnp.sum(loss), grads, tapped

  def _finish(self, state, loss, grads, tapped, stop, rates):
    carry = None
    if self.carried:
      fed = jax.tree_util.tree_map(jnp.add, grads, state["carry"])
      sent = jax.tree_util.tree_map(lambda e: e.astype(jnp.bfloat16), fed)
      carry = jax.tree_util.tree_map(lambda e, q: e - q.astype(jnp.float32), fed, sent)
      grads = self._constrain({path: self._node_sum(path, q) for path, q in sent.items()},
                              self._param_shardings(self._train(state["params"])))
    new_state, metrics = self._apply(state, loss, grads, tapped, rates)
    if carry is not None:
      new_state["carry"] = carry
    new_state = self._constrain(new_state, self.state_shardings(state))
    flag = jnp.max(stop).astype(jnp.float32)  # any rank's stop flag stops every rank
    return new_state, jnp.concatenate([metrics, flag[None]])

  def _sharded_full(self, state, batches, stop, rates):
    loss, grads, tapped = self._ranks_grads(state["params"], self._by_rank(batches),
                                            state["step"], 0)
    return self._finish(state, loss, grads, tapped, stop, rates)

  def _sharded_chunk(self, params, batches, step, c, acc_loss, acc_grads):
    s = self.stacking
    chunk = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, c * s, s, axis=1),
                                   self._by_rank(batches))
    loss, grads, tapped = self._ranks_grads(params, chunk, step, c * s)
    return acc_loss + loss, jax.tree_util.tree_map(jnp.add, acc_grads, grads), tapped

  def _sharded_zeros(self, params):
    params = self._train(params)  # sums of the trained parameters' gradients only
    lead = (self.nodes,) if self.carried else ()
    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(lead + p.shape, jnp.float32), params)
    return jnp.float32(0.0), self._constrain(zeros, self._sums_shardings(params))

  def _sharded_update(self, state, loss, grads, tapped, stop, rates):
    return self._finish(state, loss, grads, tapped, stop, rates)

  def _abstract_sums(self, params: dict) -> dict:
    params = self._train(params)
    lead = (self.nodes,) if self.carried else ()
    shardings = self._sums_shardings(params)
    return {k: jax.ShapeDtypeStruct(lead + tuple(p.shape), jnp.float32, sharding=shardings[k])
            for k, p in params.items()}

  # --- ahead of time -----------------------------------------------------------------------
  def executables(self, state, batches) -> dict:
    """The step's executables compiled for abstract, sharded inputs (plan, cost model)."""
    if self.fused:
      return {"train step": self.compile(state, batches)}
    grads = self.compile(state, batches)
    state = self._place_state(state)
    params = state["params"]
    rep = NamedSharding(self.mesh, P())
    loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    sums = self._abstract_sums(params)
    tapped = {d.name: jax.ShapeDtypeStruct((self.microbatches,), jnp.float32, sharding=rep)
              for d in self.diags if d.kind == "tap"}
    update = self._update.lower(state, loss, sums, tapped, self._stop_abstract(),
                                self._rates_abstract()).compile()
    self._grads_exec, self._update_exec = grads, update
    return {"gradient call": grads, "update": update}

  def _lowering(self, state, batches):
    """(the jitted step, or stacked its gradient call, its abstract sharded arguments)."""
    state, batches = self._place_state(state), self._placed(batches, "data")
    if self.fused:
      return self._fused, (state, batches, self._stop_abstract(), self._rates_abstract())
    rep = NamedSharding(self.mesh, P())
    loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    sums = self._abstract_sums(state["params"])
    return self._grads, (state["params"], batches, state["step"], jnp.int32(0), loss, sums)


def share(tree: Any) -> Any:
  """Each leaf as the ShapeDtypeStruct of one device's shard (its sharding's shard shape)."""
  def one(x):
    sh = getattr(x, "sharding", None)
    shape = sh.shard_shape(x.shape) if sh is not None else x.shape
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return jax.tree_util.tree_map(one, tree)

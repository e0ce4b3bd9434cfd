"""The train step (K microbatches, stacked by lax.scan, one update) and the pass step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sexpgpu.ir.graph import Graph
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower.interp import run_graph

REDUCE = {"mean": jnp.mean, "max": jnp.max, "min": jnp.min, "sum": jnp.sum,
          "rms": lambda x: jnp.sqrt(jnp.mean(jnp.square(x)))}


@dataclasses.dataclass(frozen=True)
class Diag:
  """A selected diagnostic as the step computes it."""

  name: str
  kind: str  # grad-norm | param-norm | update-ratio | tap
  arg: str | None
  reduce: str


def _norm(tree: dict, prefix: str | None) -> Any:
  leaves = [v for k, v in tree.items() if prefix is None or k.startswith(prefix)]
  if not leaves:
    return jnp.float32(0.0)
  return jnp.sqrt(sum(jnp.sum(jnp.square(v.astype(jnp.float32))) for v in leaves))


def _once_computed(flag, tree):
  """`flag`, as a value XLA computes only after every leaf of `tree`.

  (bits | 1) != 0 holds for any bits, so the flag is unchanged; XLA cannot prove that,
  so the flag depends on one element of each leaf: the first, indexed, not read through
  `ravel()`, whose reshape made XLA gather every whole sharded parameter at each update.
  """
  deps = [jax.lax.bitcast_convert_type(leaf[(0,) * leaf.ndim].astype(jnp.float32),
                                       jnp.uint32) | 1
          for leaf in jax.tree_util.tree_leaves(tree) if leaf.size]
  return flag & jnp.all(jnp.stack(deps) != 0) if deps else flag


def _finite(x):
  return jnp.all(jnp.isfinite(x))


@dataclasses.dataclass
class TrainStep:
  """Jitted functions of one train step at a stacking degree.

  `step(state, batches, stop)` runs all K microbatches and the update; with a
  stacking below K it is made of K/S calls of the stacked gradient graph and
  one update call, all driven from `step`.
  """

  graph: Graph
  optimizer: optax.GradientTransformation
  schedule: Callable
  precision: str
  microbatches: int
  stacking: int
  seed: int
  on_nan: str
  diags: tuple[Diag, ...] = ()
  mesh: Any = None  # the data-parallel mesh: ("data",), or ("node", "gpu") over nodes
  node_gradients: str = "f32"  # between nodes: "f32" exact, or "bf16" with error feedback
  platform: str | None = None  # "cpu" or "gpu": lowering rules that differ by device
  # the parameters trained (`:trainable`, LoRA's adapters); None: every one. The others are
  # constants of the step: not differentiated, not in the optimizer state, passed through
  trainable: frozenset | None = None
  fp8_only: tuple = ()  # under fp8, the `:fp8` globs naming the products (LowerCtx.fp8_only)
  # The learning rates' numbers (lower/optim.py's rate_numbers: peak, warmup, length, ...)
  # as arguments of the step, and `recipe(numbers)` → (optimizer, schedule) built from their
  # traced copies: another rate or length reuses the executable. Without a recipe the
  # optimizer and schedule above are the step's constants.
  recipe: Callable | None = None
  rates: dict | None = None

  def __post_init__(self):
    self.ranks = 1 if self.mesh is None else self.mesh.size
    self.axes = () if self.mesh is None else tuple(self.mesh.axis_names)
    self.nodes = self.mesh.shape["node"] if "node" in self.axes else 1
    self.notes: list = []  # what lowering rules chose (cuDNN, Pallas or XLA attention, ...)
    self.metric_names = ["loss", "grad_norm", "lr", "finite"] + ["diag/" + d.name
                                                                  for d in self.diags]
    self.fused = self.stacking * self.ranks == self.microbatches
    # with several ranks the step also returns the ranks' stop flag
    self.step_names = self.metric_names + (["stop"] if self.ranks > 1 else [])
    if self.ranks > 1:
      self._fused = jax.jit(self._dp_step, donate_argnums=(0,))
      self._update = jax.jit(self._dp_update, donate_argnums=(0,))
    else:
      self._fused = jax.jit(self._full_step, donate_argnums=(0,))
      self._update = jax.jit(self._apply, donate_argnums=(0,))
    self._grads = jax.jit(self._chunk_grads, donate_argnums=(4, 5))
    self._zeros_fn = jax.jit(self._zeros, out_shardings=self._sharding("data"))
    self._fused_exec = self._grads_exec = self._update_exec = None
    self._rates_on = None  # the rates' numbers on the step's devices, put there once

  def _rate_values(self) -> dict:
    """The rates' numbers as the step takes them: int32 and float32 scalars."""
    if self.recipe is None:
      return {}
    return jax.tree_util.tree_map(
        lambda v: np.int32(v) if isinstance(v, int) else np.float32(v), self.rates)

  def _rates_abstract(self) -> dict:
    return self._placed(jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct((), v.dtype),
                                               self._rate_values()), "rep")

  def _rates_for(self, state) -> dict:
    """The rates' numbers placed as the state's replicated parts are (once a step object)."""
    if self._rates_on is None:
      values = self._rate_values()
      sharding = self._sharding("rep")
      if sharding is None:  # one device: the state's
        sharding = jax.tree_util.tree_leaves(state)[0].sharding
      self._rates_on = jax.device_put(values, sharding)
    return self._rates_on

  def _recipe(self, rates: dict):
    """(optimizer, schedule): the step's constants, or built from the traced rates."""
    if self.recipe is None:
      return self.optimizer, self.schedule
    return self.recipe(rates)

  def _train(self, params: dict) -> dict:
    """The parameters the step trains, by path (all of them without `trainable`)."""
    if self.trainable is None:
      return params
    return {k: v for k, v in params.items() if k in self.trainable}

  def _grad(self, loss_fn, params: dict, has_aux: bool = False):
    """jax.value_and_grad of `loss_fn(params)` with respect to the trained parameters only:
    the frozen ones enter as constants, so no gradient of theirs is computed."""
    if self.trainable is None:
      return jax.value_and_grad(loss_fn, has_aux=has_aux)(params)
    frozen = {k: v for k, v in params.items() if k not in self.trainable}
    return jax.value_and_grad(lambda t: loss_fn({**frozen, **t}), has_aux=has_aux)(
        self._train(params))

  # a microbatch's loss and gradient; dropout's key from (seed, step, microbatch)
  def _loss_and_grad(self, params, batch, step, index):
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), index)
    ctx = LowerCtx(self.precision, rng, True, self.notes, self.platform, fp8_only=self.fp8_only)

    def loss_fn(p):
      taps = {} if any(d.kind == "tap" for d in self.diags) else None
      out = run_graph(self.graph, p, batch, ctx, taps)["out"]
      tapped = {}
      for d in self.diags:
        if d.kind == "tap":
          vals = (taps or {}).get(d.arg, [])
          tapped[d.name] = (REDUCE[d.reduce](jnp.stack([REDUCE[d.reduce](v.astype(jnp.float32))
                                                       for v in vals]))
                            if vals else jnp.float32(0.0))
      return out.astype(jnp.float32), tapped

    (loss, tapped), grads = self._grad(loss_fn, params, has_aux=True)
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    return loss, grads, tapped

  def _stacked_grads(self, params, batches, step, offset):
    """Sums loss and f32 gradients over the leading (stacked) axis of `batches`."""
    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32),
                                   self._train(params))

    def body(acc, xs):
      batch, i = xs
      loss, grads, tapped = self._loss_and_grad(params, batch, step, offset + i)
      acc_loss, acc_grads = acc
      return (acc_loss + loss, jax.tree_util.tree_map(jnp.add, acc_grads, grads)), (loss, tapped)

    n = jax.tree_util.tree_leaves(batches)[0].shape[0]
    (loss, grads), (losses, tapped) = jax.lax.scan(body, (jnp.float32(0.0), zeros),
                                                   (batches, jnp.arange(n)))
    return loss, grads, losses, tapped

  def _apply(self, state, loss_sum, grad_sum, tapped, rates):
    optimizer, schedule = self._recipe(rates)
    k = self.microbatches
    loss = loss_sum / k
    grads = jax.tree_util.tree_map(lambda g: g / k, grad_sum)
    params, opt = state["params"], state["opt"]
    trained = self._train(params)
    updates, new_opt = optimizer.update(grads, opt, trained)
    new_params = optax.apply_updates(trained, updates)
    ok = _finite(loss) & _finite(optax.tree.norm(grads))
    halted = jnp.bool_(False)
    if self.on_nan == "stop":
      # The loop reads a step's numbers one step late, so the step after a non-finite one
      # may already be running when the loop stops: under `:on-nan stop` it changes nothing.
      halted = state["skipped"] > 0
      ok = ok & ~halted
    # a non-finite step keeps the old state (the select fuses into the update)
    keep = lambda flag, new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(flag, a, b),
                                                         new, old)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "lr": jnp.asarray(schedule(state["step"]), jnp.float32), "finite": ok}
    for d in self.diags:
      if d.kind == "grad-norm":
        metrics["diag/" + d.name] = _norm(grads, d.arg)
      elif d.kind == "param-norm":
        metrics["diag/" + d.name] = _norm(params, d.arg)
      elif d.kind == "update-ratio":
        metrics["diag/" + d.name] = _norm(updates, d.arg) / jnp.maximum(_norm(trained, d.arg),
                                                                        1e-12)
      else:
        metrics["diag/" + d.name] = REDUCE[d.reduce](tapped[d.name])
    new_state = dict(state)
    kept = keep(ok, new_params, trained)  # a frozen parameter is passed through as it is
    new_state["params"] = {k: kept.get(k, v) for k, v in params.items()}
    # The optimizer state's select waits for the new parameters. Left unordered, XLA
    # copies every donated optimizer state buffer at the start of the step, since both
    # the parameters' and the state's updates read the old moments: a second optimizer
    # state's worth of memory, and its copying time.
    new_state["opt"] = keep(_once_computed(ok, kept), new_opt, opt)
    new_state["step"] = state["step"] + jnp.where(halted, 0, 1).astype(state["step"].dtype)
    new_state["skipped"] = state["skipped"] + jnp.where(ok | halted, 0, 1).astype(jnp.int32)
    # one f32 vector, so reading a step's numbers is a single transfer
    return new_state, jnp.stack([jnp.asarray(metrics[n], jnp.float32)
                                 for n in self.metric_names])

  def _full_step(self, state, batches, rates):
    loss, grads, _, tapped = self._stacked_grads(state["params"], batches, state["step"], 0)
    return self._apply(state, loss, grads, tapped, rates)

  # --- data parallel: rank r takes microbatches r·K/R … (r+1)·K/R − 1 of each step ---------
  def _shard(self, fn, in_specs, out_specs):
    from jax.sharding import PartitionSpec as P
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  def _combine(self, loss, grads, carry=None):
    """This rank's loss and gradient sums, summed across ranks: the step's one combination.

    Between nodes with bf16 gradients, each device adds its carried rounding error to
    the node's f32 sum, sends that rounded to bf16, and keeps the new rounding error.
    """
    loss = jax.lax.psum(loss, self.axes)
    if carry is None:
      return loss, jax.lax.psum(grads, self.axes), None
    node_sum = jax.lax.psum(grads, "gpu")
    fed = jax.tree_util.tree_map(lambda g, c: g + c[0], node_sum, carry)
    sent = jax.tree_util.tree_map(lambda e: e.astype(jnp.bfloat16), fed)
    new_carry = jax.tree_util.tree_map(lambda e, q: (e - q.astype(jnp.float32))[None], fed, sent)
    grads = jax.tree_util.tree_map(lambda q: jax.lax.psum(q, "node").astype(jnp.float32), sent)
    return loss, grads, new_carry

  def _rank_grads(self, params, batches, step, offset):
    """This rank's microbatches' loss and gradient sums (rank r takes r·K/R … of the step)."""
    rank = jax.lax.axis_index(self.axes)
    loss, grads, _, tapped = self._stacked_grads(params, batches, step,
                                                 offset + rank * (self.microbatches // self.ranks))
    tapped = {n: jax.lax.all_gather(v, self.axes, tiled=True) for n, v in tapped.items()}
    return loss, grads, tapped

  def _dp_apply(self, state, loss, grads, tapped, stop, rates):
    """Combines the ranks' sums once, updates, and reads every rank's stop flag."""
    loss, grads, carry = self._combine(loss, grads, state.get("carry"))
    new_state, metrics = self._apply(state, loss, grads, tapped, rates)
    if carry is not None:
      new_state["carry"] = carry
    # every rank's stop flag, so a signal on one node stops all at the same step
    flag = jax.lax.pmax(stop[0], self.axes).astype(jnp.float32)
    return new_state, jnp.concatenate([metrics, flag[None]])

  def _state_specs(self, state):
    from jax.sharding import PartitionSpec as P
    return {k: (P(self.axes) if k == "carry" else P()) for k in state}

  def _dp_step(self, state, batches, stop, rates):
    from jax.sharding import PartitionSpec as P

    def inner(state, batches, stop, rates):
      loss, grads, tapped = self._rank_grads(state["params"], batches, state["step"], 0)
      return self._dp_apply(state, loss, grads, tapped, stop, rates)

    specs = self._state_specs(state)
    return self._shard(inner, (specs, P(self.axes), P(self.axes), P()), (specs, P()))(
        state, batches, stop, rates)

  def _dp_update(self, state, loss, grads, tapped, stop, rates):
    """The update after K/(S·R) gradient calls: each rank's sums arrive split by rank."""
    from jax.sharding import PartitionSpec as P

    def inner(state, loss, grads, tapped, stop, rates):
      return self._dp_apply(state, loss[0], jax.tree_util.tree_map(lambda g: g[0], grads),
                            tapped, stop, rates)

    specs = self._state_specs(state)
    return self._shard(inner, (specs, P(self.axes), P(self.axes), P(), P(self.axes), P()),
                       (specs, P()))(state, loss, grads, tapped, stop, rates)

  def _chunk_local(self, params, batches, step, c, acc_loss, acc_grads):
    """Adds chunk c's loss and gradients (microbatches c·S … (c+1)·S − 1) to the sums.

    With several ranks the sums stay each rank's own (a leading axis of one here, of
    R outside): they are combined once, in the update.
    """
    s = self.stacking
    chunk = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, c * s, s), batches)
    if self.ranks > 1:
      loss, grads, tapped = self._rank_grads(params, chunk, step, c * s)
      return (acc_loss + loss[None],
              jax.tree_util.tree_map(lambda a, g: a + g[None], acc_grads, grads), tapped)
    loss, grads, _, tapped = self._stacked_grads(params, chunk, step, c * s)
    return acc_loss + loss, jax.tree_util.tree_map(jnp.add, acc_grads, grads), tapped

  def _chunk_grads(self, params, batches, step, c, acc_loss, acc_grads):
    if self.ranks == 1:
      return self._chunk_local(params, batches, step, c, acc_loss, acc_grads)
    from jax.sharding import PartitionSpec as P
    mine = P(self.axes)
    return self._shard(self._chunk_local, (P(), mine, P(), P(), mine, mine),
                       (mine, mine, P()))(params, batches, step, c, acc_loss, acc_grads)

  def _sharding(self, kind: str):
    """Replicated ("rep") or split over ranks ("data") on the mesh; None on one device."""
    if self.mesh is None:
      return None
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(self.mesh, P() if kind == "rep" else P(self.axes))

  def _placed(self, tree, kind: str):
    """Abstract values carrying the shardings the real arguments will have."""
    sh = self._sharding(kind)
    if sh is None:
      return tree
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                  tree)

  def _zeros(self, params):
    """The running sums of a stacked step: one per rank (a leading axis R) with several."""
    lead = (self.ranks,) if self.ranks > 1 else ()
    return (jnp.zeros(lead, jnp.float32),
            jax.tree_util.tree_map(lambda p: jnp.zeros(lead + p.shape, jnp.float32),
                                   self._train(params)))

  def stop_flags(self, stop: bool = False):
    """This process's stop flag for each of its ranks, placed as the step expects."""
    local = np.full((len(self.mesh.local_devices),), int(stop), np.int32)
    return jax.make_array_from_process_local_data(self._sharding("data"), local, (self.ranks,))

  def _stop_abstract(self):
    return self._placed(jax.ShapeDtypeStruct((self.ranks,), jnp.int32), "data")

  def _place_state(self, state):
    return {k: self._placed(v, "data" if k == "carry" else "rep") for k, v in state.items()}

  def __call__(self, state, batches, stop=None):
    """One optimizer step over `batches` (leading axis K); returns (state, metrics vector)."""
    if self.ranks > 1 and stop is None:
      stop = self.stop_flags()
    extra = ((stop,) if self.ranks > 1 else ()) + (self._rates_for(state),)
    if self.fused:
      return (self._fused_exec or self._fused)(state, batches, *extra)
    # K/(S·R) calls of the stacked gradient graph, each adding into f32 sums, then one update.
    loss, grads = self._zeros_fn(state["params"])
    fn = self._grads_exec or self._grads
    tapped = []
    for c in range(self.microbatches // self.ranks // self.stacking):
      loss, grads, t = fn(state["params"], batches, state["step"], jnp.int32(c), loss, grads)
      tapped.append(t)
    tap = {n: jnp.concatenate([t[n] for t in tapped]) for n in (tapped[0] if tapped else {})}
    return (self._update_exec or self._update)(state, loss, grads, tap, *extra)

  def compile(self, state, batches):
    """Compiles the step ahead of time for these (abstract) inputs; returns the executable."""
    lowered = self.lowered(state, batches)
    compiled = lowered.compile()
    if self.fused:
      self._fused_exec = compiled
    return compiled

  def executables(self, state, batches) -> dict:
    """Every executable of one step, compiled for abstract inputs (memory plan, cost model).

    The fused step is one executable; a stacked step is its gradient call and its update.
    """
    if self.fused:
      return {"train step": self.compile(state, batches)}
    grads = self.compile(state, batches)
    state = self._place_state(state)
    loss, sums = self._placed(jax.eval_shape(self._zeros, state["params"]), "data")
    tapped = self._placed({d.name: jax.ShapeDtypeStruct((self.microbatches,), jnp.float32)
                           for d in self.diags if d.kind == "tap"}, "rep")
    extra = ((self._stop_abstract(),) if self.ranks > 1 else ()) + (self._rates_abstract(),)
    update = self._update.lower(state, loss, sums, tapped, *extra).compile()
    self._grads_exec, self._update_exec = grads, update
    return {"gradient call": grads, "update": update}

  def lowered(self, state, batches):
    """The fused step lowered for abstract inputs (for memory and cost analysis)."""
    fn, args = self._lowering(state, batches)
    return fn.lower(*args)

  def _lowering(self, state, batches):
    """(the jitted function that `lowered` lowers, its abstract placed arguments)."""
    state, batches = self._place_state(state), self._placed(batches, "data")
    if self.fused:
      extra = ((self._stop_abstract(),) if self.ranks > 1 else ()) + (self._rates_abstract(),)
      return self._fused, (state, batches, *extra)
    loss, grads = self._placed(jax.eval_shape(self._zeros, state["params"]), "data")
    return self._grads, (state["params"], batches, state["step"], jnp.int32(0), loss, grads)

  def lowered_for_cuda(self, state, batches):
    """The step (stacked: its gradient call) as a CUDA run lowers it, on any machine.

    Built afresh with the GPU's lowering rules, so nothing traced here reaches this
    step's own executables. Returns (the jax Lowered, the rules' notes).
    """
    from sexpgpu.lower.cuda_target import lower_for_cuda
    step = dataclasses.replace(self, platform="gpu")
    fn, args = step._lowering(state, batches)
    return lower_for_cuda(fn, *args), step.notes


class PassStep:
  """All of a pass's metrics for one batch, in one jitted call (no dropout).

  Random ops draw from a key fixed per batch of the pass (the batch's index folded into a
  fixed key): an evaluation draws the same values each time it runs, and its batches draw
  different ones.

  Its lowering rules are those of the platform its arguments live on (the run's
  device), not JAX's default backend: a `--device cpu` run on a GPU host keeps the
  CPU's rules in its passes.
  """

  def __init__(self, graphs: dict[str, Graph], precision: str, platform: str | None = None,
               fp8_only: tuple = ()):
    self.graphs = graphs
    self.precision = precision
    self.fp8_only = fp8_only  # the run's `:fp8` globs, as its train step's
    self.platform = platform  # None: the platform of the devices its arguments live on
    self.notes: list = []  # what lowering rules chose, as the train step's notes
    self._fns: dict[str, Callable] = {}
    self._exec = None

  def _fn(self, platform: str):
    if platform not in self._fns:
      self._fns[platform] = jax.jit(functools.partial(self._metrics, platform))
    return self._fns[platform]

  def _metrics(self, platform, params, batch, index):
    rng = jax.random.fold_in(jax.random.key(0), index)
    ctx = LowerCtx(self.precision, rng, False, self.notes, platform, fp8_only=self.fp8_only)
    return {name: run_graph(g, params, batch, ctx)["out"].astype(jnp.float32)
            for name, g in self.graphs.items()}

  def platform_of(self, params, batch) -> str:
    """The platform whose rules lower the pass for these arguments: the one given, else
    that of the devices the arguments (or their abstract shardings) name, else that of
    JAX's default device."""
    if self.platform is not None:
      return self.platform
    for x in jax.tree_util.tree_leaves((params, batch)):
      sharding = getattr(x, "sharding", None)
      if sharding is not None:
        return next(iter(sharding.device_set)).platform
    default = jax.config.jax_default_device
    if default is not None and not isinstance(default, str):
      return default.platform
    return jax.default_backend()

  def compile(self, params, batch):
    """Compiles the pass for abstract inputs; later calls use the executable."""
    index = jax.ShapeDtypeStruct((), jnp.int32)  # abstract: no executable to make a 0
    self._exec = self._fn(self.platform_of(params, batch)).lower(params, batch,
                                                                 index).compile()
    return self._exec

  def lowered_for_cuda(self, params, batch):
    """The pass as a CUDA run lowers it, on any machine: the jax Lowered."""
    from sexpgpu.lower.cuda_target import lower_for_cuda
    return lower_for_cuda(self._fn("gpu"), params, batch, jnp.int32(0))

  def __call__(self, params, batch, index=0):
    """The metrics of batch number `index` of the pass (its random draws' key)."""
    index = np.int32(index)  # passed as is: jnp.int32 would compile a convert_element_type
    if self._exec is not None:
      return self._exec(params, batch, index)
    return self._fn(self.platform_of(params, batch))(params, batch, index)


def trained_only(optimizer: optax.GradientTransformation, trainable: frozenset | None
                 ) -> optax.GradientTransformation:
  """`optimizer` whose state holds the trained parameters only: its `init` takes every
  parameter and keeps those in `trainable`; its `update` takes the trained ones (the step's
  gradients are theirs alone). `optimizer` itself when every parameter trains."""
  if trainable is None:
    return optimizer
  return optax.GradientTransformation(
      lambda params: optimizer.init({k: v for k, v in params.items() if k in trainable}),
      optimizer.update)


def init_state(params: dict, optimizer: optax.GradientTransformation) -> dict:
  """The train state: parameters, optimizer state, step and skipped-step counter."""
  # one executable for the whole optimizer state, not one op-by-op dispatch (and compile,
  # on a cold cache) for each of its zero buffers: 10 for adamw's; the counters are put,
  # not converted (jnp.int32(0) compiles a convert_element_type)
  return {"params": params, "opt": jax.jit(optimizer.init)(params),
          "step": jax.device_put(np.int32(0)), "skipped": jax.device_put(np.int32(0))}

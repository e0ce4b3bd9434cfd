"""The train state and the steps of one compiled experiment, built in one place.

`run`, `check --print plan|hlo`, the Python API and the tests all take their
abstract state, train steps and pass steps from `build()`, so the step that is
planned is the step that runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu.ir.shapes import np_dtype
from sexpgpu.lower import fp8
from sexpgpu.lower.init import compile_init, compile_init_soon, init_params
from sexpgpu.lower.optim import make_optimizer, rate_numbers
from sexpgpu.lower.fsdp import ShardedTrainStep, share
from sexpgpu.lang.mesh import check_devices, is_mesh
from sexpgpu.lower.layouts import DATA_AXES, find_pairs, make_mesh, param_specs
from sexpgpu.ir.lora import SUFFIXES, base_of, trained
from sexpgpu.lower.step import Diag, PassStep, TrainStep, init_state, trained_only


@dataclasses.dataclass
class Training:
  """What one run trains with: its steps by (stage, degree), pass steps and state shapes.

  Attributes:
    c: the Compiled experiment.
    place: the run's Placement (devices, mesh), or None for abstract use only.
    node_gradients: "f32" or "bf16" (the sum between nodes).
    diags: the diagnostics the step computes.
    pass_steps: pass name → PassStep.
    sequence_parallel: whether a mesh with `tensor` splits the activations between its pairs
      on the sequence (on; off only to compare, as tests and plans do).
  """

  c: Any
  place: Any = None
  node_gradients: str = "f32"
  diags: tuple[Diag, ...] = ()
  pass_steps: dict = dataclasses.field(default_factory=dict)
  # Megatron's sequence parallel between the tensor pairs (lower/fsdp.py), on whenever the
  # mesh is `tensor` alone (as torchtitan's tensor-parallel plan always splits its norms on
  # the sequence): it changes no number, only the collectives and the activations a device
  # holds. Not yet with an axis that splits the batch too (fsdp:2,tensor:2): the ranks' vmap
  # leaves that axis unnamed, so the pairs' shard_map gathered the batch to every device
  # (4x the bytes of the plain pairs); named (vmap's spmd_axis_name), JAX 0.10 fails to
  # lower the jvp of the shard_map (sdy.manual_computation's operand shapes)
  sequence_parallel: bool = True

  def __post_init__(self):
    run = self.c.exp.run
    self.steps = int(run["steps"])
    self.k = int(run["microbatches"])
    self.seed = int(run["seed"])
    self.precision = str(run["precision"])
    self.on_nan = str(run["on-nan"])
    self.ranks = self.place.ranks if self.place is not None else 1
    # Sharding only means something over several devices: on one it is `replicate`.
    self.sharding = str(run.get("sharding", "replicate")) if self.ranks > 1 else "replicate"
    # a mesh of named axes (lower/layouts.py), checked against the devices here
    self.mesh = None
    if is_mesh(run.get("sharding", "")) and self.place is not None:
      # over nodes the devices are in node-major order (open_devices), so the axes written
      # first span the nodes (`fsdp:2,tensor:2` on 2 nodes of 2: fsdp across, tensor within)
      self.mesh = check_devices(str(run["sharding"]), self.place.ranks)
      # the partitioner places a mesh's collectives, in f32; the bf16 sum between nodes with
      # its carried error is fsdp's, hsdp's and replicate's (it needs a `node` axis)
      self.node_gradients = "f32"
    self._steps: dict[tuple[int, int], TrainStep] = {}
    self.trainable = trainable(self.c)
    self.fp8_only = fp8.patterns(run)  # `:fp8`'s globs (held to the loss by compile_file)
    self._init_soon = None  # (stage, the future of its initial state's executable)

  def trained(self, params: dict) -> dict:
    """The trained ones of `params` (`:trainable`, LoRA's adapters; all without them)."""
    if self.trainable is None:
      return params
    return {k: v for k, v in params.items() if k in self.trainable}

  @property
  def carried(self) -> bool:
    """Whether each device keeps a rounding-error carry (bf16 sums between nodes)."""
    return (self.place is not None and self.place.multiprocess
            and self.node_gradients == "bf16")

  def optimizer(self, stage: int = 0, numbers: dict | None = None):
    """The stage's optax transformation and learning-rate schedule (weight decay by each
    parameter's role in the stage's graph), its state of the trained parameters only; the
    rates made of `numbers` (the step's traced arguments) when given, else of their own."""
    opt, sched = make_optimizer(self.c.stages[stage].exp.optimizer, self.steps,
                                self.c.stages[stage].graph, numbers)
    return trained_only(opt, self.trainable), sched

  def step(self, stage: int, degree: int) -> TrainStep:
    """The stage's train step at a stacking degree (built once, then kept)."""
    key = (stage, degree)
    if key not in self._steps:
      opt, sched = self.optimizer(stage)
      place = self.place
      args = (self.c.stages[stage].graph, opt, sched, self.precision, self.k, degree, self.seed,
              self.on_nan, self.diags, place.mesh if place else None, self.node_gradients,
              place.first.platform if place else None)
      # the rates' numbers are arguments of the step: another rate or --steps, the same
      # executable (a sweep over rates compiles its step once)
      tuned = dict(recipe=functools.partial(self.optimizer, stage),
                   rates=rate_numbers(self.c.stages[stage].exp.optimizer, self.steps))
      if self.sharding == "replicate":
        self._steps[key] = TrainStep(*args, trainable=self.trainable, fp8_only=self.fp8_only,
                                     **tuned)
      else:
        stacks = {path: len(p.stack) for path, p in self.c.params.items()}
        layout, held, graph = None, {}, self.c.stages[stage].graph
        if self.mesh is not None:  # each parameter's spec from the stage's graph
          layout = adapter_specs(param_specs(graph, self.c.params, self.mesh), self.c.params)
          sizes = dict(self.mesh)
          if sizes.get("expert", 1) > 1 or sizes.get("tensor", 1) > 1:
            pairs = find_pairs(graph)
            held["dispatch"] = pairs.dispatch if sizes.get("expert", 1) > 1 else {}
            if self.sequence_parallel and sizes.get("tensor", 1) > 1 and not any(
                sizes.get(a, 1) > 1 for a in DATA_AXES):
              held.update(ends=frozenset(pairs.ends), starts=frozenset(pairs.starts),
                          inner=pairs.inner)
          args = args[:9] + (make_mesh(place.devices, self.mesh),) + args[10:]
        self._steps[key] = ShardedTrainStep(*args, sharding=self.sharding, stacks=stacks,
                                            layout=layout, trainable=self.trainable,
                                            fp8_only=self.fp8_only, **tuned, **held)
    return self._steps[key]

  def place_state(self, state: dict, stage: int = 0) -> dict:
    """A host or device state put where the run keeps it: replicated, or sharded."""
    if self.sharding == "replicate":
      return self.place.replicate(state)
    step = self.step(stage, self.k // self.ranks)
    shardings = step.state_shardings(state)
    if not self.place.multiprocess:
      return jax.device_put(state, shardings)

    def put(x, sharding):  # every process holds the same host values: each takes its part
      if getattr(x, "sharding", None) == sharding:
        return x
      host = self.place.host(x) if isinstance(x, jax.Array) else np.asarray(x)
      return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree_util.tree_map(put, state, shardings)

  def place_abstract(self, state: dict, stage: int = 0) -> dict:
    """Abstract state carrying the shardings the run's state will have."""
    if self.place is None:
      return state
    if self.sharding == "replicate":
      return {k: (v if k == "carry" else self.place.abstract(v)) for k, v in state.items()}
    return self.step(stage, self.k // self.ranks)._place_state(state)

  def share(self, state: dict, stage: int = 0) -> dict:
    """The state as one device holds it (ShapeDtypeStructs of its shards)."""
    if self.sharding == "replicate":
      return state
    step = self.step(stage, self.k // self.ranks)
    return share(step._place_state(state))

  def split_over(self, stage: int = 0) -> int:
    """How many devices the state is split over: every rank (fsdp), a node's (hsdp)."""
    if self.sharding == "replicate":
      return 1
    return self.ranks if self.mesh is not None else self.step(stage, self.k // self.ranks).n

  def specs(self, stage: int = 0) -> dict:
    """Each parameter's PartitionSpec on the run's mesh ({} when replicated)."""
    if self.sharding == "replicate":
      return {}
    step = self.step(stage, self.k // self.ranks)
    return {path: step.param_spec(path, tuple(p.full_shape))
            for path, p in self.c.params.items()}

  def replicated(self, stage: int = 0) -> list[str]:
    """Parameters that stay whole on every device under fsdp/hsdp (no axis fits)."""
    if self.sharding == "replicate":
      return []
    step = self.step(stage, self.k // self.ranks)
    state = self.abstract_state(stage)
    return [path for path, p in state["params"].items()
            if step.param_spec(path, tuple(p.shape)) == jax.sharding.PartitionSpec()]

  def abstract_state(self, stage: int = 0) -> dict:
    """The train state as ShapeDtypeStructs: nothing is initialized or allocated."""
    opt, _ = self.optimizer(stage)
    state = jax.eval_shape(lambda: init_state(init_params(self.seed, self.c.params), opt))
    if self.carried:  # rounding-error carries for the bf16 sum between nodes: one per
      # device replicated, one per node sharded (split over the node's devices)
      rows = self.ranks if self.sharding == "replicate" else self.place.nodes
      state["carry"] = jax.tree_util.tree_map(
          lambda p: jax.ShapeDtypeStruct((rows,) + p.shape, jnp.float32),
          self.trained(state["params"]))
    return state

  def _initial(self, stage: int):
    """The function that makes the stage's initial state: parameters, optimizer state and
    counters, jitted as one executable (lower/init.py's compile_init)."""
    opt, _ = self.optimizer(stage)

    def initial_state():
      return init_state(init_params(self.seed, self.c.params), opt)
    return initial_state

  def prepare_init(self, stage: int = 0) -> None:
    """Starts compiling the replicated initial state in a thread (init_state waits for it),
    so that it builds while the plan compiles the steps."""
    if self.sharding == "replicate" and self.place is not None:
      first = self.place.first
      self._init_soon = (stage, compile_init_soon(self._initial(stage), first.platform, first))

  def init_state(self, stage: int = 0) -> dict:
    """The initial train state, placed on the run's devices."""
    place = self.place
    if self.sharding != "replicate":  # each device initializes only its shards
      abstract = self.abstract_state(stage)
      shardings = self.step(stage, self.k // self.ranks).state_shardings(abstract)

      shardings.pop("carry", None)
      state = compile_init(self._initial(stage), place.first.platform,
                           out_shardings=shardings)()
    else:
      soon, self._init_soon = self._init_soon, None  # run once: its executable is not kept
      made = (soon[1].result() if soon is not None and soon[0] == stage else
              compile_init(self._initial(stage), place.first.platform, place.first))
      with jax.default_device(place.first):
        state = place.replicate(made())
    if self.carried:
      state["carry"] = self.zero_carry(stage)
    return state

  def zero_carry(self, stage: int = 0) -> dict:
    """The bf16 sums' rounding-error carries at zero, placed as the run keeps them: a row
    a device (replicate) or a row a node split over its devices (fsdp, hsdp)."""
    carry = self.abstract_state(stage)["carry"]
    if self.sharding == "replicate":
      n = len(self.place.local_devices)
      return {k: self.place.shard(np.zeros((n,) + v.shape[1:], np.float32), self.ranks)
              for k, v in carry.items()}
    step = self.step(stage, self.k // self.ranks)
    shardings = step.state_shardings({"params": {}, "carry": carry})["carry"]
    return jax.jit(lambda: {k: jnp.zeros(v.shape, v.dtype) for k, v in carry.items()},
                   out_shardings=shardings)()

  def abstract_batches(self, loader: str, lead: tuple = ()) -> dict:
    """A loader's batch as ShapeDtypeStructs, with leading axes `lead` (e.g. (K,))."""
    return {f: jax.ShapeDtypeStruct(lead + sh, jnp.dtype(np_dtype(dt)))
            for f, (dt, sh) in self.c.fields[loader].items()}


def trainable(c) -> frozenset | None:
  """The parameters a run of `c` trains (ir/lora.py's `trained`: `:trainable`'s patterns and
  LoRA's adapters), or None when it trains every one.

  Raises:
    SxError: E-RUN-002 at `:trainable` for a pattern that matches no parameter.
  """
  spec = c.exp.run.get("trainable")
  return trained(c.params, None if spec is None else spec.get("patterns"),
                 None if spec is None else spec.loc)


def adapter_specs(layout: dict, params: dict) -> dict:
  """`layout` with each LoRA adapter split as its base weight is (torchtitan's rule): A
  [.., in, rank] on the base's input axis, B [.., rank, out] on its output axis, the stacked
  axes as the base's and the rank whole. So a column half's B is split as its columns and
  adds to them where they lie; a row half's A sums over the rows' split as they do."""
  from jax.sharding import PartitionSpec as P
  out = dict(layout)
  for path, p in params.items():
    base = base_of(path)
    if base is None or base not in params:
      continue
    spec = tuple(layout.get(base, P()))
    spec += (None,) * (len(params[base].full_shape) - len(spec))
    k = len(p.stack)
    own = (spec[k], None) if path.endswith(SUFFIXES[0]) else (None, spec[k + 1])
    out[path] = P(*(spec[:k] + own))
  return out


def build(c, place=None, node_gradients: str = "f32", diagnostics: bool = True) -> Training:
  """The Training of a compiled experiment: the one place its steps are wired.

  Args:
    c: the Compiled experiment (run/compile.py).
    place: the run's Placement, or None to build abstract steps without devices.
    node_gradients: "f32" or "bf16", the sum between nodes.
    diagnostics: whether the step computes the selected diagnostics.
  """
  diags = ()
  if diagnostics:
    diags = tuple(Diag(n, d.kind, d.arg, d.reduce) for n, d in
                  ((n, c.exp.diagnostics[n]) for n in c.diagnostics))
  precision = str(c.exp.run["precision"])
  passes = {p: PassStep(gs, precision, fp8_only=fp8.patterns(c.exp.run))
            for p, gs in c.passes.items()}
  return Training(c, place, node_gradients, diags, passes)

"""`:sharding auto`: the layouts a device count allows, each one's memory a device and step
time predicted, the best chosen (measured when the best two are within 5%) and remembered.

The model, per candidate mesh (axes data, fsdp, expert, tensor, laid out in that order so
that `tensor` is innermost, inside a node when it can be) and with or without remat of the
repeated blocks:

- memory a device: each parameter's bytes over the mesh sizes its PartitionSpec splits it
  on (lower/layouts.py's `param_specs`), optimizer states in the same proportion, f32
  gradient sums, and one microbatch's activations (the values the backward reads), of which
  `tensor` splits the part inside Megatron's pairs (0.7 of it, as Korthikanti et al. 2022
  count a transformer layer's: 24 of 34 bytes a token and width) and remat keeps each
  repeated block's input and one block's values;
- step time: the step's FLOPs (forward, backward, and a second forward of the repeated
  blocks under remat) over the devices' peak, plus each collective's bytes over the link its
  group crosses (links.py), with nothing overlapped: the gradients' all-reduce over `data`,
  fsdp's all-gathers of the parameters (forward and backward, each microbatch) and
  reduce-scatter of the gradients, tensor's all-reduce of each pair's output (forward and
  backward) and of the vocabulary-split embedding, expert's all-to-alls (dispatch and
  combine, forward and backward). Ring costs: an all-reduce moves 2(n−1)/n of its bytes,
  an all-gather, reduce-scatter or all-to-all (n−1)/n. On a GPU of links.py's table,
  run/planning/gpu_cost.py's model sets the compute and each collective's exposed seconds instead.

On a run's own devices the plan's memory is confirmed by the memory plan (plan.py, compiled
for abstract values) for the best candidates until two fit, those within 5% are timed on the
devices, and the choice is remembered in choices.json. On paper (`check --target cuda
--devices N`) the table's published figures stand in and nothing is compiled.
"""

from __future__ import annotations

import dataclasses
import math

from sexpgpu.devices import memory as mem
from sexpgpu.errors import SxError
from sexpgpu.ir.graph import walk
from sexpgpu.ir.opdef import LEAVES, OpTable
from sexpgpu.lower.flops import saved_inputs
from sexpgpu.ir.shapes import np_dtype
from sexpgpu.lang.mesh import AUTO, is_auto
from sexpgpu.run.links import Hardware

SHOWN = 6  # dropped layouts listed one a line; the rest are counted
LAYOUT_MODEL = 2  # kept with each remembered choice: a choice an older model made is redone
ORDER = ("data", "fsdp", "expert", "tensor")  # outermost first: tensor inside a node
CLOSE = 0.05
TENSOR_SHARE = 24 / 34  # of a layer's activations, the part inside Megatron's pairs
# The activations a step keeps for its backward: the inputs its backward reads (lower/flops.py's
# SAVES: products, nonlinearities, normalizations), each counted once through the views
# (`views`), which XLA keeps no copy of; what XLA fuses away (sums, views) is not kept.
VIEWS = OpTable("view", "sexpgpu/run/planning/layout_plan.py", complete=False)
VIEWS.register("the same values, another shape or dtype", "reshape", "transpose", "broadcast",
               "expand", "squeeze", "cast")


@dataclasses.dataclass
class Collective:
  """One kind of collective over one mesh axis in a step: bytes a device sends, how many."""

  axis: str
  kind: str
  nbytes: float  # the collective's data a device (all of them: `count` calls)
  count: int
  crosses: str  # "within" or "across" nodes
  seconds: float = 0.0


@dataclasses.dataclass
class Candidate:
  """One layout: its mesh, remat, predicted memory and time, and why it was dropped."""

  mesh: tuple[tuple[str, int], ...]
  remat: bool
  memory: float = 0.0
  parts: dict = dataclasses.field(default_factory=dict)
  compute: float = 0.0
  update: float = 0.0  # the optimizer's pass over the state a device holds
  collectives: list = dataclasses.field(default_factory=list)
  dropped: str | None = None
  planned: float | None = None  # the compiled memory plan's bytes, when it was compiled
  measured: float | None = None
  # dropped because the microbatches do not divide over its data-parallel ranks, and it
  # would fit were they to: the refusal is then the microbatches', not the memory's
  fits_but_k: bool = False
  k_memory: float = 0.0  # then its memory a device, as estimated
  terms: dict | None = None  # a GPU's step time by term (run/planning/gpu_cost.py), seconds

  @property
  def ranks(self) -> int:
    """Its data-parallel ranks (data × fsdp × expert), over which the microbatches divide."""
    return math.prod(s for a, s in self.mesh if a != "tensor")

  @property
  def text(self) -> str:
    """The `:sharding` value: `replicate` when every axis is `data`, else the mesh."""
    axes = [(a, s) for a, s in self.mesh if s > 1]
    if all(a == "data" for a, _ in axes):
      return "replicate"
    return ",".join(f"{a}:{s}" for a, s in axes)

  @property
  def name(self) -> str:
    return self.text + (" +remat" if self.remat else "")

  @property
  def comm(self) -> float:
    return sum(c.seconds for c in self.collectives)

  @property
  def time(self) -> float:
    return self.compute + self.update + self.comm


@dataclasses.dataclass
class LayoutChoice:
  """What the plan chose, how (model, measured, remembered, only), and every candidate."""

  chosen: Candidate
  how: str
  candidates: list
  hardware: Hardware
  flops: float  # the step's model FLOPs (no remat), for MFU
  tokens: int  # tokens a step
  devices: int
  nodes: int
  remat_knob: bool

  def mfu(self, cand: Candidate | None = None) -> float:
    """Model FLOPs over the devices' peak time, at the predicted (or measured) step time."""
    cand = cand or self.chosen
    t = cand.measured or cand.time
    return self.flops / (self.devices * self.hardware_peak * t) if t else 0.0

  hardware_peak: float = 0.0

  def lines(self) -> list[str]:
    """The report's lines: the choice, its runners-up, and why the rest were dropped."""
    c = self.chosen
    how = {"model": "the cost model", "measured": "measured at the first steps, the model "
           "within 5% could not separate them", "timed": "each timed at the first steps (on host "
           "devices sharing the machine's cores the cost model cannot rank layouts)",
           "remembered": "measured by an earlier run of "
           "this graph on these devices (choices.json)", "only": "the only one that fits"}[
               self.how]
    out = [f"  layout      {c.name}: {how} ({self.hardware.name}, {self.hardware.source}; "
           f"{self.devices} devices" + (f", {self.nodes} nodes" if self.nodes > 1 else "")
           + ")"]
    if c.remat and not self.remat_knob:
      out.append("    the chosen layout needs remat: write (repeat … :remat true) in the .sx")
    for cand in self.ranked()[:4]:
      out.append(f"    {'chosen' if cand is c else 'runner-up':<9} {_row(cand, self)}")
    dropped = [x for x in self.candidates if x.dropped]
    # the closest misses first: those that fit least badly, then those a size refuses
    dropped.sort(key=lambda x: (not x.memory, x.memory))
    for cand in dropped[:SHOWN]:
      out.append(f"    dropped   {cand.name} — {cand.dropped}")
    if len(dropped) > SHOWN:
      rest = dropped[SHOWN:]
      big = sum(1 for x in rest if x.dropped.startswith("does not fit"))
      out.append(f"    dropped   {len(rest)} more: {big} do not fit, {len(rest) - big} do not "
                 "divide a size or the microbatches")
    return out

  def ranked(self) -> list[Candidate]:
    """The candidates that fit, the chosen first, then the timed by their time, then the rest
    by predicted time."""
    fit = [x for x in self.candidates if not x.dropped]
    return [self.chosen] + sorted((x for x in fit if x is not self.chosen),
                                  key=lambda x: (x.measured is None, x.measured or x.time))

  def collective_lines(self, cand: Candidate | None = None) -> list[str]:
    """Each collective of the chosen layout's step: axis, kind, bytes, count, link, time."""
    cand = cand or self.chosen
    return [f"    {x.axis:<7}{x.kind:<15}×{x.count:<5} {mem.human(x.nbytes):>10} {x.crosses:<7}"
            f"{_ms(x.seconds)}" for x in cand.collectives] or ["    none"]


def _ms(s: float) -> str:
  return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def _row(c: Candidate, choice: LayoutChoice) -> str:
  memory = mem.human(c.planned if c.planned is not None else c.memory)
  how = "plan" if c.planned is not None else "model"
  meas = f", measured {_ms(c.measured)}" if c.measured else ""
  return (f"{c.name} — {memory} a device ({how}), model {_ms(c.time)} "
          f"(compute {_ms(c.compute)}, update {_ms(c.update)}, collectives {_ms(c.comm)}), MFU "
          f"{100 * choice.mfu(c):.0f}%{meas}")


# --- the candidates -------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def meshes(devices: int, experts: bool) -> list[tuple[tuple[str, int], ...]]:
  """Every (data, fsdp, expert, tensor) whose sizes multiply to `devices` (expert only when
  the graph has expert weights)."""
  out = []
  for t in _divisors(devices):
    for x in (_divisors(devices // t) if experts else [1]):
      for f in _divisors(devices // t // x):
        d = devices // t // x // f
        out.append(tuple((a, s) for a, s in zip(ORDER, (d, f, x, t))))
  return out


def _fails_sizes(mesh, pairs) -> str | None:
  """Why a mesh does not divide a size the split rules split, or None."""
  sizes = dict(mesh)
  for axis, split in (("tensor", pairs.sizes), ("expert", pairs.expert_sizes)):
    n = sizes.get(axis, 1)
    if n > 1 and not split:
      return f"no {'Megatron pair' if axis == 'tensor' else 'expert weight'} in the graph " \
             f"for {axis} to split"
    for size, what in split if n > 1 else ():
      if size % n:
        return f"{axis}:{n} does not divide {what} ({size})"
  return None


# --- the model ------------------------------------------------------------------------------

def _nbytes(node) -> int:
  return math.prod(node.shape) * np_dtype(node.dtype).itemsize if node.dtype != "tuple" else 0


def _graph_facts(graph, pairs) -> dict:
  """What the model reads from the graph once: activations inside and outside repeats, the
  pairs' reduced outputs and embeddings' outputs, expert operands, each times its trips."""
  facts = {"values": 0, "repeat_values": 0, "repeat_kept": 0, "pair_out": [], "embed_out": [],
           "head_in": [], "expert_in": [], "repeats": 0}
  seen: set = set()

  def visit(roots, times: int, inside: bool):
    for node in walk(roots):
      if node.op == "repeat":
        n = int(node.attr("n"))
        facts["repeats"] += 1
        before = facts["values"]
        visit([node.attr("body").output], times * n, True)
        facts["repeat_values"] += facts["values"] - before
        facts["repeat_kept"] += times * n * _nbytes(node)  # each block's input, kept
        continue
      if node.op in LEAVES:
        continue
      for x in saved_inputs(node):  # what the backward reads
        while getattr(x, "op", None) in VIEWS:
          x = x.inputs[0]
        if getattr(x, "op", "param") not in LEAVES and (x.uid, times) not in seen:
          seen.add((x.uid, times))
          facts["values"] += times * _nbytes(x)
      ins = node.inputs
      if node.uid in pairs.rows:
        facts["pair_out"].append((times, times * _nbytes(node)))
      elif node.uid in pairs.heads:
        facts["head_in"].append((times, times * _nbytes(ins[0])))
      if node.uid in pairs.embeds:
        facts["embed_out"].append((times, times * _nbytes(node)))
      if node.uid in pairs.dispatch:
        other = pairs.dispatch[node.uid][0]
        facts["expert_in"].append((times, times * (_nbytes(ins[other]) + _nbytes(node))))
  visit(graph.nodes(), 1, False)
  return facts


def _link(mesh, axis: str, hw: Hardware, nodes: int) -> tuple[str, tuple[float, float]]:
  """Which link a group along `axis` crosses: devices are numbered with the last axis
  fastest, a node holds `per_node` consecutive devices."""
  if nodes <= 1:
    return "within", hw.within
  sizes = dict(mesh)
  stride = math.prod(sizes[a] for a in ORDER[ORDER.index(axis) + 1:] if a in sizes)
  span = stride * sizes[axis]
  per_node = math.prod(sizes.values()) // nodes
  return ("across", hw.across) if span > per_node else ("within", hw.within)


_MOVED = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
          "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n}


def _collective(mesh, axis, kind, moved: tuple[float, int], hw, nodes) -> Collective | None:
  """The collective a step runs over `axis` of `mesh`, moving (bytes, calls), or None."""
  nbytes, count = moved
  n = dict(mesh).get(axis, 1)
  if n <= 1 or count == 0:
    return None
  crosses, (bw, lat) = _link(mesh, axis, hw, nodes)
  secs = _MOVED[kind](n) * nbytes / bw + count * lat
  return Collective(axis, kind, nbytes, count, crosses, secs)


def estimate(c, cand: Candidate, hw: Hardware, nodes: int, facts: dict, state) -> Candidate:
  """Fills a candidate's memory a device, compute seconds and collectives.

  Args:
    c: the Compiled experiment (its microbatches a step, K, and its precision: bf16 halves
      the activations' bytes).
    cand: the candidate (mesh, remat).
    hw: the devices and links.
    nodes: how many nodes the devices span.
    facts: `_graph_facts` of the train graph.
    state: the abstract train state (ShapeDtypeStructs).
  """
  import jax
  microbatches, precision = int(c.exp.run["microbatches"]), str(c.exp.run["precision"])
  from sexpgpu.lower.flops import forward_flops, train_flops
  from sexpgpu.lower.layouts import param_specs
  graph = c.stages[0].graph
  sizes = dict(cand.mesh)
  devices = math.prod(sizes.values())
  specs = param_specs(graph, c.params, cand.mesh) if cand.text != "replicate" else {}

  def split(path) -> tuple[int, int]:  # (by tensor and expert, by every axis)
    spec = tuple(specs.get(path, ()))
    axes = [a for s in spec if s for a in ((s,) if isinstance(s, str) else s)]
    model = math.prod(sizes[a] for a in axes if a in ("tensor", "expert"))
    return model, math.prod(sizes[a] for a in axes)

  params = state["params"]
  p_all = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  o_all = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state["opt"]))
  p_dev = p_model = g_model = 0.0
  for path, x in params.items():
    model, every = split(path)
    p_dev += x.size * x.dtype.itemsize / every
    p_model += x.size * x.dtype.itemsize / model
    g_model += x.size * 4 / model
  g_dev = g_model * p_dev / max(p_model, 1)
  o_dev = o_all * p_dev / max(p_all, 1)
  act_scale = 0.5 if precision in ("bf16", "fp8") else 1.0
  acts = facts["values"]
  if cand.remat and facts["repeats"]:
    # each block's input is kept; one block's values live again while it is recomputed
    acts = (acts - facts["repeat_values"] + facts["repeat_kept"]
            + facts["repeat_values"] / _blocks(graph))
  t = sizes.get("tensor", 1)
  acts = act_scale * acts * ((1 - TENSOR_SHARE) + TENSOR_SHARE / t)
  cand.parts = {"parameters": p_dev, "optimizer states": o_dev, "gradients": g_dev,
                "activations": acts}
  cand.memory = sum(cand.parts.values())
  flops = train_flops(graph, microbatches)
  if cand.remat and facts["repeats"]:
    flops += forward_flops(graph) * microbatches
  cand.compute = flops / devices / hw.peak_at(precision)
  # the update reads the parameters, gradients and optimizer states a device holds and
  # writes the parameters and states back: memory-bound, and the same on every device of a
  # replicated layout (what splitting the state saves in time, not only in bytes)
  cand.update = (2 * (p_dev + o_dev) + g_dev) / hw.hbm
  # each data rank (data × fsdp × expert) runs K / ranks microbatches
  ranks = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
  k_dev = max(1, microbatches // ranks)
  a = act_scale
  f = sizes.get("fsdp", 1)
  leaves = len(params)
  def total(key):  # (bytes, calls) of a list of (trips, bytes)
    return sum(b for _, b in facts[key]), sum(n for n, _ in facts[key])

  pair, embed, head, expert = (total(k) for k in ("pair_out", "embed_out", "head_in",
                                                  "expert_in"))
  gathered = a * p_model  # params are f32; a bf16 run gathers them as bf16
  cols = [
      _collective(cand.mesh, "data", "all-reduce", (g_model / f, leaves), hw, nodes),
      _collective(cand.mesh, "fsdp", "all-gather", (2 * k_dev * gathered, 2 * k_dev * leaves),
                  hw, nodes),
      _collective(cand.mesh, "fsdp", "reduce-scatter", (g_model, leaves), hw, nodes),
      _collective(cand.mesh, "tensor", "all-reduce",
                  (a * k_dev * (2 * pair[0] + embed[0] + head[0]),
                   k_dev * (2 * pair[1] + embed[1] + head[1])), hw, nodes),
      _collective(cand.mesh, "expert", "all-to-all", (a * k_dev * 2 * expert[0],
                                                      k_dev * 4 * expert[1]), hw, nodes),
  ]
  cand.collectives = [x for x in cols if x is not None]
  from sexpgpu.run.planning import gpu_cost
  if hw.name in gpu_cost.GPUS:  # a GPU: achievable rates, overlap and launches
    gpu_cost.charge(cand, graph, hw, microbatches, precision, c.exp.run.get("fp8"))
  return cand


def _blocks(graph) -> int:
  """How many repeated blocks the graph runs (a repeat's n, summed)."""
  return sum(int(n.attr("n")) for n in graph.nodes() if n.op == "repeat") or 1


def candidates(c, devices: int, nodes: int, hw: Hardware, free: float, remats=None) -> tuple:
  """Every layout the device count allows, estimated, those that cannot run dropped.

  Args:
    c: the Compiled experiment.
    devices, nodes: the devices the run spans (a mesh over nodes puts its first axes across
      them: `_link` says which link each axis crosses).
    hw: the devices and links.
    free: bytes a device may use.
    remats: the remat settings to consider (default: both when the graph repeats a block).

  Returns:
    (candidates, facts): every Candidate, dropped ones with their reason.
  """
  from sexpgpu.lower.layouts import find_pairs
  from sexpgpu.run.training import build
  graph = c.stages[0].graph
  pairs = find_pairs(graph)
  facts = _graph_facts(graph, pairs)
  state = build(c).abstract_state()
  k = int(c.exp.run["microbatches"])
  if remats is None:
    remats = (False, True) if facts["repeats"] else (False,)
  grid = meshes(devices, bool(pairs.experts))
  out = []
  for mesh in grid:
    for remat in remats:
      cand = Candidate(mesh, remat)
      why = _fails_sizes(mesh, pairs)
      if why is None and k % cand.ranks:
        why = (f"the {k} microbatches do not divide over its {cand.ranks} data-parallel ranks")
        probe = estimate(c, Candidate(mesh, remat), hw, nodes, facts, state)
        cand.fits_but_k, cand.k_memory = probe.memory <= free, probe.memory
      if why is not None:
        cand.dropped = why
        out.append(cand)
        continue
      estimate(c, cand, hw, nodes, facts, state)
      if cand.memory > free:
        cand.dropped = f"does not fit: {mem.human(cand.memory)} of {mem.human(free)}"
      out.append(cand)
  return out, facts


def pick(cands: list, measured: bool = False) -> tuple[Candidate | None, list]:
  """The fastest candidate that fits, and those within 5% of it (to measure)."""
  fit = sorted((x for x in cands if not x.dropped), key=lambda x: (x.time, x.remat, x.text))
  if not fit:
    return None, []
  best = fit[0]
  return best, [x for x in fit[:2] if x.time <= best.time * (1 + CLOSE)]


@dataclasses.dataclass(frozen=True)
class Fleet:
  """The devices a layout is planned on: their hardware and links (None: not known), the
  bytes a device may use, the nodes they span."""

  hw: Hardware | None = None
  free: float = 0.0
  nodes: int = 1


def refuse(cands: list, where: str, c=None, devices_flag: str = "--devices",
           fleet: Fleet = Fleet()) -> SxError:
  """The error when no candidate is left: E-DP-003 when a layout that would fit is dropped
  only because the microbatches do not divide over its data-parallel ranks (the fix names
  :microbatches and the device counts that divide them), else E-MEM-001.

  Args:
    cands: every candidate, each dropped with its reason.
    where: the setting the choice came from (`--set sharding=auto`).
    c: the Compiled experiment (for the microbatches and the device counts that divide).
    devices_flag: what sets the device count: `--devices` on paper, SEXPGPU_DEVICES in a run.
    fleet: the devices, the bytes a device may use and the nodes they span (for the counts
      that fit).
  """
  blocked = [x for x in cands if x.fits_but_k]
  if blocked and c is not None:
    return _refuse_microbatches(c, blocked, where, devices_flag, fleet)
  fits = [x for x in cands if x.memory]
  small = min(fits, key=lambda x: x.memory) if fits else None
  return SxError("E-MEM-001", "no layout of :sharding auto fits: "
                 + "; ".join(f"{x.name} — {x.dropped}" for x in cands[:6] if x.dropped),
                 where=where, fix=(f"the smallest is {small.name} at {mem.human(small.memory)} a "
                                   "device: more devices, remat, or a smaller batch or model"
                                   if small else "more devices, or a smaller model"))


def _refuse_microbatches(c, blocked, where, devices_flag, fleet: Fleet) -> SxError:
  k = int(c.exp.run["microbatches"])
  blocked = sorted(blocked, key=lambda x: (x.ranks, x.k_memory))
  best = blocked[0]
  more = best.ranks * -(-k // best.ranks)  # the least multiple of its ranks above k
  devices = math.prod(s for _, s in best.mesh)
  counts = dividing_counts(c, k, devices, fleet)
  fewer = (f", or {devices_flag} " + " or ".join(f"{n} ({x.name})" for n, x in counts)
           if counts else "")
  return SxError(
      "E-DP-003", f"no layout of :sharding auto on {devices} devices divides the {k} "
      "microbatches over its data-parallel ranks; those that would fit were they to divide: "
      + ", ".join(f"{x.name} ({x.ranks} ranks, {mem.human(x.k_memory)} a device)"
                  for x in blocked[:4]) + (f" and {len(blocked) - 4} more" if len(blocked) > 4
                                           else ""),
      where=where,
      fix=f"--set microbatches={more} ({best.name} then runs {more // best.ranks} on each of "
          f"its {best.ranks} data-parallel ranks){fewer}")


def dividing_counts(c, k: int, devices: int, fleet: Fleet, most: int = 3) -> list:
  """The largest device counts below `devices` (a multiple of the fleet's nodes) with a
  layout whose data-parallel ranks divide the `k` microbatches (and that fits, given the
  fleet's hardware): up to `most` (count, candidate) pairs."""
  from sexpgpu.lower.layouts import find_pairs
  from sexpgpu.run.training import build
  graph = c.stages[0].graph
  pairs = find_pairs(graph)
  facts, state = _graph_facts(graph, pairs), build(c).abstract_state()
  hw, free, nodes = fleet.hw, fleet.free, fleet.nodes
  out = []
  for n in range(devices - 1, 0, -1):
    if n % nodes or len(out) == most:
      continue
    for mesh in meshes(n, bool(pairs.experts)):
      cand = Candidate(mesh, False)
      if _fails_sizes(mesh, pairs) is None and k % cand.ranks == 0:
        if hw is not None:
          estimate(c, cand, hw, nodes, facts, state)
          if cand.memory > free:
            continue
        out.append((n, cand))
        break
  return out


# --- on paper -------------------------------------------------------------------------------

def paper(c, gpu: str, devices: int, nodes: int = 1) -> LayoutChoice:
  """The plan for `devices` GPUs of the table over `nodes` nodes, from the graph alone.

  Raises:
    SxError: E-MEM-001 when no layout fits the card; E-KNOB-003 when `:sharding` is a
      fixed mesh that does not divide a size.
  """
  from sexpgpu.lower.flops import train_flops
  from sexpgpu.run import links
  hw = links.gpu(gpu)
  hw = dataclasses.replace(hw, per_node=devices // nodes)
  free = hw.memory - mem.RESERVE
  sharding = str(c.exp.run.get("sharding", "replicate"))
  cands, _ = candidates(c, devices, nodes, hw, free)
  if not is_auto(sharding):  # a fixed layout on paper: only it
    want = "replicate" if sharding == "replicate" else sharding
    mine = [x for x in cands if x.text == want or (sharding == "fsdp" and x.text ==
                                                   f"fsdp:{devices}")]
    if not mine:
      raise SxError("E-KNOB-003", f":sharding {sharding} is not a layout of {devices} devices "
                    "the plan knows", where=f"--set sharding={sharding}",
                    fix=f"--set sharding=auto, or a mesh whose sizes multiply to {devices}")
    cands = mine
  best, close = pick(cands)
  if best is None:
    raise refuse(cands, "--set sharding=auto", c, "--devices", Fleet(hw, free, nodes))
  k = int(c.exp.run["microbatches"])
  return LayoutChoice(best, "only" if len([x for x in cands if not x.dropped]) == 1 else "model",
                      cands, hw, train_flops(c.stages[0].graph, k), tokens_a_step(c) * k, devices,
                      nodes, "remat" in c.selection.knobs,
                      hardware_peak=hw.peak_at(str(c.exp.run["precision"])))


def tokens_a_step(c) -> int:
  """Tokens one microbatch trains on (the loader's `tokens` field), else its rows."""
  fields = c.fields[c.stages[0].data]
  dt, shape = fields.get("tokens", next(iter(fields.values())))
  return math.prod(shape) if "tokens" in fields else (shape[0] if shape else 1)


def paper_text(c, choice: LayoutChoice, gpu: str) -> str:
  """`check --target cuda --gpu G --devices N`: the plan a run there would make."""
  c_ = choice.chosen
  t = c_.time
  tokens = choice.tokens / t / choice.devices
  lines = [f"plan on paper: {c.slug} on {choice.devices} × {gpu.upper()}"
           + (f" over {choice.nodes} nodes" if choice.nodes > 1 else "")
           + f" ({c.exp.run['precision']}, {int(c.exp.run['microbatches'])} microbatches of "
           f"{choice.tokens // int(c.exp.run['microbatches'])} tokens a step; from the graph, "
           "nothing compiled)"]
  lines += choice.lines()
  lines.append(f"  memory      {mem.human(c_.memory)} a device of "
               f"{mem.human(choice.hardware.memory)}: " + ", ".join(f"{k} {mem.human(v)}" for k, v in c_.parts.items()))
  lines.append("  collectives (a step, a device; ring bytes; " + ("time exposed, at NCCL's bus "
               "bandwidth)" if c_.terms else "nothing overlapped)"))
  lines += choice.collective_lines()
  if c_.terms:
    from sexpgpu.run.planning.gpu_cost import terms_line
    lines.append(f"  step time   {terms_line(c_)} (a device)")
  lines.append(f"  estimate    step {_ms(t)}, {tokens:,.0f} tokens/s a GPU, MFU "
               f"{100 * choice.mfu():.0f}% (model FLOPs {choice.flops:.3g} a step over "
               f"{choice.hardware.peak_at(str(c.exp.run['precision'])) / 1e12:.0f} TFLOP/s "
               "peak; an estimate, not a measurement)")
  return "\n".join(lines) + "\n"


__all__ = ["AUTO", "Candidate", "Fleet", "LayoutChoice", "candidates", "estimate", "meshes", "paper",
           "paper_text", "pick", "refuse", "tokens_a_step"]

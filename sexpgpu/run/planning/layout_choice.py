"""`:sharding auto` on a run's own devices: layout_plan.py's candidates, the best confirmed
by the compiled memory plan until two fit, the two timed on the devices when their
predictions are within 5%, node 0 deciding for every node, the choice remembered in
choices.json and written into the experiment before its Training is built.

On XLA host devices every layout that fits is timed (up to HOST_TIMED): their compute and
their collectives share the machine's cores, so the cost model, right about GPUs' FLOPs and
links, cannot rank them (measured: it under-predicts a replicated step at a wide shape 4x,
a tensor-split one 2x, and the waits of devices at each collective are most of the gap)."""

from __future__ import annotations

import dataclasses
import os
import time

from sexpgpu.devices import memory as mem
from sexpgpu.lang.mesh import is_auto
from sexpgpu.run.planning.layout_plan import (LAYOUT_MODEL, Candidate, Fleet, LayoutChoice,
                                              candidates, pick, refuse, tokens_a_step)

HOST_TIMED = 6  # layouts timed at most on host devices (a compile and a few steps each)


def _with_sharding(c, text: str):
  """A view of the Compiled experiment whose `:sharding` is `text` (the run's dict is not
  touched): its exp is copied with another run dict."""
  from sexpgpu.reader.forms import Symbol
  exp = dataclasses.replace(c.exp, run=dict(c.exp.run, sharding=Symbol(text)))
  return dataclasses.replace(c, exp=exp)


def _memory_plan(c, place, text: str, cache_dir: str):
  """The compiled memory plan of a layout (plan.choose at the largest stacking degree)."""
  from sexpgpu.run.planning import plan
  from sexpgpu.run.training import build
  cc = _with_sharding(c, text)
  training = build(cc, place)
  k = training.k
  state = training.abstract_state()
  batches = training.abstract_batches(c.stages[0].data, (k,))
  return plan.choose(training, 0, k // training.ranks, state, batches,
                     plan.Setting(cache_dir)), training


# Timing layouts: after a first step each, ROUNDS rounds of STEPS steps a layout.
ROUNDS, STEPS = 3, 2


def _time(trainings: dict, planned: dict, c, place, free: float) -> dict:
  """Each layout's fastest step on zero batches, {text: seconds}: after a first step each
  (warm), ROUNDS rounds in a rotating order of STEPS steps a layout, so that a burst of
  other work on the machine falls on every layout alike. When their memory plans' bytes
  (`planned`, by text) together exceed `free`, one layout at a time, each freed before the
  next."""
  import jax
  import numpy as np
  from sexpgpu.ir.shapes import np_dtype as npd
  fields = c.fields[c.stages[0].data]

  def start(training):
    k = training.k
    host = {f: np.zeros((k,) + sh, npd(dt)) for f, (dt, sh) in fields.items()}
    return [training.step(0, k // training.ranks), training.init_state(), place.shard(host, k)]

  def run(live, text, n):
    step, state, batches = live
    for _ in range(n):
      t = time.perf_counter()
      state, m = step(state, batches)
      jax.block_until_ready(m)
      best[text] = min(best.get(text, float("inf")), time.perf_counter() - t)
    live[1] = state

  best: dict = {}
  texts = list(trainings)
  together = sum(planned.values()) <= free
  if not together:
    for text in texts:
      live = start(trainings[text])
      run(live, text, 1)
      best.pop(text)  # the first step may have waited on memory or a lazy compile
      run(live, text, ROUNDS * STEPS)
      del live
    return best
  lives = {text: start(trainings[text]) for text in texts}
  for text in texts:
    run(lives[text], text, 1)
  best.clear()
  for r in range(ROUNDS):
    for text in texts[r % len(texts):] + texts[:r % len(texts)]:
      run(lives[text], text, STEPS)
  return best


def resolve(c, place, cache_dir: str, log=None) -> LayoutChoice | None:
  """Chooses the layout of `:sharding auto` on the run's devices and writes it into the
  experiment (`c.exp.run["sharding"]`) before its Training is built; None when `:sharding`
  is not auto.

  Raises:
    SxError: E-MEM-001 when no layout fits.
  """
  if not is_auto(str(c.exp.run.get("sharding", ""))):
    return None
  from sexpgpu import env
  from sexpgpu.lower.flops import device_peak, train_flops
  from sexpgpu.reader.forms import Symbol
  from sexpgpu.run import links
  from sexpgpu.run.planning import plan
  devices, nodes = place.ranks, place.nodes
  k = int(c.exp.run["microbatches"])
  flops = train_flops(c.stages[0].graph, k)
  precision = str(c.exp.run["precision"])
  if devices == 1:
    c.exp.run["sharding"] = Symbol("replicate")
    one = Candidate((("data", 1),), False)
    return LayoutChoice(one, "only", [one], links.GPUS["H100"], flops, tokens_a_step(c) * k, 1, 1,
                        False, hardware_peak=0.0)
  free = mem.free_bytes_of(place.first, env.get("SEXPGPU_MEMORY")) - mem.reserve_for(place.first)
  hw = links.host(list(place.devices), cache_dir, free)
  if place.first.platform != "cpu":
    hw = dataclasses.replace(hw, peak=device_peak(place.first, "bf16") or hw.peak)
  current = [bool(n.attr("remat")) for n in c.stages[0].graph.nodes() if n.op == "repeat"]
  remats = (any(current),)  # a run builds the graph as written: its repeat's :remat
  cands, _ = candidates(c, devices, nodes, hw, free, remats)
  name = plan.device_name(place.first, devices)
  cache = plan.ChoiceCache(os.path.join(cache_dir, "choices.json"))
  remembered = cache.layout(c.graph_fingerprint, name, LAYOUT_MODEL)
  how = "model"
  host = place.first.platform == "cpu" and nodes == 1
  wanted = HOST_TIMED if host else 2  # the best two that fit are what a measurement needs
  # the memory plan, compiled, confirms the best candidates until those to time fit
  fitting, built = [], {}
  known = [x for x in cands if x.text == remembered and not x.dropped]
  for cand in known or sorted((x for x in cands if not x.dropped), key=lambda x: x.time):
    if len(fitting) == wanted:
      break
    p, built[cand.text] = _memory_plan(c, place, cand.text, cache_dir)
    cand.planned = p.plan.total
    if not p.plan.fits:
      cand.dropped = f"does not fit by the memory plan: {p.plan.text()}"
      continue
    fitting.append(cand)
  best, close = pick([x for x in cands if x in fitting or x.dropped])
  if best is None:
    raise refuse(cands, "--set sharding=auto", c, "SEXPGPU_DEVICES naming",
                 Fleet(hw, free, nodes))
  if known and not known[0].dropped:
    best, how = next(x for x in cands if x.text == remembered and not x.dropped), "remembered"
  elif len([x for x in cands if not x.dropped]) == 1:
    how = "only"
  elif (host and len(fitting) > 1) or (len(close) == 2 and nodes == 1):
    timed = fitting if host else close
    # each Training keeps the step its memory plan compiled
    seconds = _time({x.text: built[x.text] for x in timed}, {x.text: x.planned for x in timed},
                    c, place, free)
    for cand in timed:
      cand.measured = seconds[cand.text]
    best = min(timed, key=lambda x: x.measured)
    how = "timed" if host else "measured"
    cache.put_layout(c.graph_fingerprint, name, best.text, LAYOUT_MODEL,
                     {x.text: x.measured for x in timed})
  else:
    cache.put_layout(c.graph_fingerprint, name, best.text, LAYOUT_MODEL, None)
  if nodes > 1:  # each node's link timings and choices.json may differ: node 0 decides
    from sexpgpu.devices.nodes import follow_node_0
    chosen = follow_node_0("layout", best.text)
    best = next(x for x in cands if x.text == chosen)
  c.exp.run["sharding"] = Symbol(best.text)
  choice = LayoutChoice(best, how, cands, hw, flops, tokens_a_step(c) * k, devices, nodes,
                        "remat" in c.selection.knobs, hardware_peak=hw.peak_at(precision))
  if log is not None:
    for line in choice.lines():
      log(line)
  return choice


__all__ = ["resolve"]

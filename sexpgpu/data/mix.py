"""The `mix` loader: each record drawn from one of several loaders by weight."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sexpgpu.data import base
from sexpgpu.data.spec import LoaderDef, LoaderSpec, form_error, key

# Records per block of component choices; counts are kept per block.
BLOCK = 4096


class MixLoader(base.Loader):
  """`(mix (0.7 LOADER) (0.3 LOADER) :batch B [:stream K])`.

  Record r's component is drawn from a generator seeded by (run seed,
  stream, r // 4096), so the choices, and how many records each component
  gave before any position, are a pure function of the position. A
  component hands out its own records in order (component c's k-th record
  is its record k); components without `:batch` take the mix's. The state
  lists each component's records consumed; they follow from the mix's
  position and are recomputed from it on `set_state`.
  """

  kind = "mix"

  def __init__(self, spec: LoaderSpec, args: dict[str, Any], ctx: base.Context):
    super().__init__()
    self.spec = spec
    self.batch_size, self.stream = args["batch"], args["stream"]
    self.seed = ctx.seed
    weights, specs = self._components(spec, args["components"])
    self.subs = [ctx.make(_with_batch(s, self.batch_size)) for s in specs]
    self.weights = np.asarray(weights) / np.sum(weights)
    self.cum_weights = np.cumsum(self.weights)
    self.cum_weights[-1] = 1.0
    self.fields = self._fields()
    self._prefix = [np.zeros(len(self.subs), np.int64)]

  @staticmethod
  def _components(spec: LoaderSpec, comps: Any) -> tuple[list[float], list[LoaderSpec]]:
    ok = isinstance(comps, (list, tuple)) and len(comps) > 0 and all(
        isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], LoaderSpec)
        and isinstance(c[0], (int, float)) and not isinstance(c[0], bool) and c[0] > 0
        for c in comps)
    if not ok:
      raise form_error(spec, "`mix` expects (WEIGHT LOADER) pairs with positive weights",
                       "write (mix (0.7 (markov ...)) (0.3 (copy ...)) :batch 8)")
    return [float(c[0]) for c in comps], [c[1] for c in comps]

  def _fields(self) -> base.Fields:
    first = self.subs[0]
    per_record = {k: (s[1:], d) for k, (s, d) in first.fields.items()}
    for sub in self.subs[1:]:
      other = {k: (s[1:], d) for k, (s, d) in sub.fields.items()}
      if other != per_record:
        show = lambda f: ", ".join(f"{k} {base.type_name(s, d)}" for k, (s, d) in f.items())
        raise form_error(self.spec, f"mix components give different records: `{first.spec.name}`"
                         f" {show(per_record)} vs `{sub.spec.name}` {show(other)}",
                         "give every component the same fields with the same per-record shapes")
    return {k: ((self.batch_size,) + s, d) for k, (s, d) in per_record.items()}

  def _choices(self, block: int) -> np.ndarray:
    u = base.rng(base.TAG_MIX, self.seed, self.stream, block).random(BLOCK)
    return np.searchsorted(self.cum_weights, u, side="right")

  def counts_before(self, record: int) -> np.ndarray:
    """How many of the records before `record` each component gave."""
    block, within = divmod(record, BLOCK)
    while len(self._prefix) <= block:
      k = len(self._prefix) - 1
      counts = np.bincount(self._choices(k), minlength=len(self.subs))
      self._prefix.append(self._prefix[-1] + counts)
    partial = np.bincount(self._choices(block)[:within], minlength=len(self.subs))
    return self._prefix[block] + partial

  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch, each record from its drawn component; pure in i."""
    start, b = i * self.batch_size, self.batch_size
    first, last = start // BLOCK, (start + b - 1) // BLOCK
    choice = np.concatenate([self._choices(k) for k in range(first, last + 1)])
    choice = choice[start - first * BLOCK:][:b]
    offsets = self.counts_before(start)
    out = {k: np.empty(s, d) for k, (s, d) in self.fields.items()}
    for c, sub in enumerate(self.subs):
      sel = choice == c
      if sel.any():
        part = sub.take(int(offsets[c]), int(sel.sum()))
        for k in out:
          out[k][sel] = part[k]
    return out

  def state(self) -> dict[str, Any]:
    """The mix's position and each component's records consumed."""
    counts = self.counts_before(self.position * self.batch_size)
    return {"kind": self.kind, "position": self.position,
            "components": [{"loader": s.spec.name, "kind": s.kind, "records": int(n)}
                           for s, n in zip(self.subs, counts)]}

  def describe(self) -> dict[str, Any]:
    """Kind, field types, records (None: endless) and the weighted components."""
    return {**super().describe(),
            "components": [{"weight": float(w), **s.describe()}
                           for w, s in zip(self.weights, self.subs)]}


def _with_batch(spec: LoaderSpec, batch: int) -> LoaderSpec:
  if "batch" in spec.args:
    return spec
  return dataclasses.replace(spec, args={**spec.args, "batch": batch})


MIX = LoaderDef("mix", "a weighted mixture of other loaders",
                (key("components"), key("batch", required=True), key("stream")), MixLoader)

"""A run's reference copies (ir/reference.py): never saved, filled again at a resume.

A cold start draws each copy as the parameter it copies (lower/init.py), a warm start copies
the loaded value (models/warm.py). A checkpoint holds the trained model alone and, in its
meta, the digest of the copies; a resume reads the starting parameters again (`:init-from`,
or the seed) and refuses with E-REF-001 when their digest is not the one the run started with.
"""

from __future__ import annotations

import hashlib

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.ir.reference import is_reference, references

META_KEY = "reference_digest"  # the checkpoint meta's digest of the reference copies


def copies(c) -> dict[str, str]:
  """The experiment's reference copies: copy path → the trained parameter it copies."""
  return references(c.params)


def without(state: dict) -> dict:
  """`state` (concrete or abstract) with its parameters less the reference copies."""
  if not any(is_reference(k) for k in state.get("params", {})):
    return state
  return dict(state, params={k: v for k, v in state["params"].items() if not is_reference(k)})


def digest(values: dict) -> str:
  """sha256 over each copy's path, dtype, shape and bytes (host arrays), in path order."""
  h = hashlib.sha256()
  for path in sorted(values):
    a = np.ascontiguousarray(np.asarray(values[path]))
    h.update(f"{path}\0{a.dtype.str}\0{a.shape}\0".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def state_digest(state: dict, place) -> str | None:
  """The digest of a placed state's reference copies (None without copies)."""
  refs = {k: v for k, v in state["params"].items() if is_reference(k)}
  if not refs:
    return None
  host = getattr(place, "host", None) if place is not None else None
  return digest({k: (host(v) if host else np.asarray(v)) for k, v in refs.items()})


def start_values(c, training) -> dict[str, np.ndarray]:
  """The copies' values as the run started: its `:init-from` read again (the ones it lacks
  under `:init-partial` drawn as declared), else each parameter drawn from the seed.

  Raises:
    SxError: E-INIT-001 and E-CKPT-003 as the warm start raises them (models/warm.py).
  """
  import jax
  from sexpgpu.lower.init import init_params
  from sexpgpu.models import warm
  refs = copies(c)
  value = warm.source_of(c)
  if not value:  # the whole table, as a cold start draws it: the same program, the same bits
    made = init_params(training.seed, c.params)
    return {r: np.asarray(jax.device_get(made[r])) for r in refs}
  loaded, what = warm.load(c, value)
  missing = warm.check(c, loaded, what, bool(c.exp.run.get("init-partial")))
  start = {k: loaded[k] for k in c.params if k in loaded}
  if missing:  # drawn as the warm start draws them
    start.update(jax.device_get(init_params(training.seed, {k: c.params[k] for k in missing})))
  return {r: np.asarray(start[b]) for r, b in refs.items()}


def resumed(c, training, step_dir: str) -> dict[str, np.ndarray]:
  """The copies' values for a resume from `step_dir`, checked against its meta's digest
  ({} without copies, nothing read).

  Raises:
    SxError: E-REF-001 when the starting parameters read again are not those the run
      started from (the `:init-from` source changed since), or the checkpoint holds no
      digest of them.
  """
  if not copies(c):
    return {}
  from sexpgpu.ckpt import read_meta
  meta = read_meta(step_dir)
  values = start_values(c, training)
  got, want = digest(values), meta.get(META_KEY)
  if got != want:
    source = str(c.exp.run.get("init-from") or "") or f"the seed {training.seed}"
    said = (f"its digest {want[:12]}…" if want else "no digest of them")
    raise SxError("E-REF-001", f"the reference model's parameters read again from {source} "
                  f"(digest {got[:12]}…) are not the ones the run started from: the checkpoint "
                  f"holds {said}", where=step_dir,
                  fix=f"restore {source} as it was when the run started (the checkpoint's meta "
                  f"holds its digest under {META_KEY}), or start a new run without --resume")
  return values


def with_values(state: dict, values: dict) -> dict:
  """A restored `state` with the reference copies put back (host arrays, placed later)."""
  if not values:
    return state
  return dict(state, params={**state["params"], **values})

"""Warm start: a run's first parameters, by path, from a checkpoint, a .safetensors file or a
Hugging Face folder (`:init-from`); the optimizer, the step and the loaders start fresh.

Every parameter is checked against the source before any initializer runs: E-INIT-001 lists
each one that is missing, extra or of another shape or dtype, with both sides, and each one
that holds NaN or infinity (there is no keyword to take those: `sexpgpu import
--allow-nonfinite` makes a checkpoint of such a folder, and `--resume` starts from it).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.ir.ops import DTYPES, dtype_name
from sexpgpu.ir.lora import base_of
from sexpgpu.ir.reference import is_reference, references
from sexpgpu.models import source

FIX = ("start from a checkpoint of this model, or set :init-partial true to initialize the "
       "missing parameters as declared")


def source_of(c) -> str:
  """The run's :init-from ("" when it starts cold)."""
  return str(c.exp.run.get("init-from") or "")


def _local(value: str, c) -> str:
  """A relative path as given (from the working folder), else beside the experiment file."""
  if value.startswith(("s3://", "gs://")) or os.path.isabs(value) or os.path.exists(value):
    return value
  beside = os.path.join(os.path.dirname(os.path.abspath(c.program.path)), value)
  return beside if os.path.exists(beside) else value


def load(c, value: str) -> tuple[dict[str, np.ndarray], str]:
  """The source's parameters by this experiment's paths, and a description of the source.

  Raises:
    SxError: E-INIT-001 for a source that cannot be read or does not fit the twin;
      E-CKPT-003 for an unreadable checkpoint folder.
  """
  from sexpgpu.models import twin
  where = ":init-from"
  if value.startswith("hf:"):
    folder = _local(value[3:], c)
    params = source.twin_params(
        c, folder, where, ":init-from hf:",
        lambda g, problems: SxError("E-INIT-001", f"{value} does not fit this {g.kind}: "
                                    + "; ".join(problems), where=where, fix=FIX))
    return params, f"hf:{folder}"
  if value.endswith(".safetensors"):
    path = _local(value, c)
    if not os.path.isfile(path):
      raise SxError("E-INIT-001", f"no file {path}", where=where,
                    fix="give a .safetensors file written by sexpgpu export")
    tensors, meta = source.read_safetensors(path)
    if meta.get("format") in ("pt", "flax"):  # a twin's tensors, by its names
      g = twin.find(c.params, c.stages[0].graph, ":init-from")
      params, problems = twin.from_twin(g, tensors, path)
      if problems:
        raise SxError("E-INIT-001", f"{path} does not fit this {g.kind}: "
                      + "; ".join(problems), where=where, fix=FIX)
      return params, path
    step = meta.get("step")
    return tensors, path + (f" (step {step} of {meta.get('slug')})" if step else "")
  step_dir = source.step_dir_of(_local(value, c), None, c.slug)
  params, meta = source.checkpoint_params(step_dir)
  return params, f"{step_dir} (step {meta.get('step')} of {meta.get('slug')})"


def _type(dtype, shape) -> str:
  return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


def check(c, loaded: dict[str, np.ndarray], what: str, partial: bool) -> list[str]:
  """The parameters to initialize as declared (the missing ones, with `partial`; LoRA's
  adapters missing from the source always).

  Raises:
    SxError: E-INIT-001 listing every missing (unless `partial`), extra or mismatched
      parameter, both sides; then each one that holds NaN or infinity.
  """
  missing = sorted(p for p in c.params if p not in loaded and not is_reference(p))
  extra = sorted(p for p in loaded if p not in c.params)
  wrong = []
  for path, p in sorted(c.params.items()):
    if path in loaded:
      v = loaded[path]
      want = np.dtype(DTYPES[p.dtype])
      if tuple(v.shape) != tuple(p.full_shape) or np.dtype(v.dtype) != want:
        wrong.append(f"{path}: {_type(v.dtype, v.shape)} there, "
                     f"{_type(want, p.full_shape)} here")
  # LoRA's adapters are new beside a warm-started base: initialized as declared (B at zero)
  adapters = {p for p in missing if base_of(p) in c.params}
  lines = [f"{p}: {_type(DTYPES[c.params[p].dtype], c.params[p].full_shape)} here, missing "
           "there" for p in ([] if partial else missing) if p not in adapters]
  lines += [f"{p}: {_type(loaded[p].dtype, loaded[p].shape)} there, no such parameter here"
            for p in extra]
  lines += wrong
  if lines:
    raise SxError("E-INIT-001", f"the warm start from {what} does not fit "
                  f"{len(lines)} parameter{'s' if len(lines) != 1 else ''}:\n    "
                  + "\n    ".join(lines), where=":init-from", fix=FIX)
  source.refuse_nonfinite({p: loaded[p] for p in c.params if p in loaded},
                          f"the warm start from {what}", ":init-from",
                          fix="start from a checkpoint from before the values went non-finite; "
                          "to train from them anyway, sexpgpu import --allow-nonfinite a "
                          "Hugging Face folder and run with --resume")
  return missing


def start_state(c, training, stage: int, log: Callable[[str], None] = lambda s: None) -> dict:
  """The run's initial train state: `training.init_state(stage)` when it starts cold, else
  the loaded parameters (the missing ones initialized, under :init-partial) with a fresh
  optimizer, placed as the run keeps its state.

  Raises:
    SxError: E-INIT-001 (before any initializer runs).
  """
  value = source_of(c)
  if not value:
    return training.init_state(stage)
  import jax.numpy as jnp
  from sexpgpu.lower.init import init_params
  from sexpgpu.lower.step import init_state
  loaded, what = load(c, value)
  missing = check(c, loaded, what, bool(c.exp.run.get("init-partial")))
  params = {k: jnp.asarray(loaded[k], DTYPES[p.dtype]) for k, p in c.params.items()
            if k in loaded}
  if missing:
    params.update(init_params(training.seed, {k: c.params[k] for k in missing}))
  # the reference model's copies (ir/reference.py): the starting values, in buffers of their own
  params.update({r: jnp.array(params[b], copy=True) for r, b in references(c.params).items()})
  log(f"init-from: {len(loaded)} parameters from {what}"
      + (f"; initialized as declared: {', '.join(missing)}" if missing else ""))
  opt, _ = training.optimizer(stage)
  state = training.place_state(init_state(params, opt), stage)
  if training.carried:
    state["carry"] = training.zero_carry(stage)
  return state

"""`defgenerate` during training: F's outputs every :every steps, written as files beside the
metrics stream, sent to its targets as images, and told in a progress line.

Everything a program can get wrong (F not a function of no arguments, a parameter only F
would create, a trained function it reaches ambiguously) is found before step 0, where the
graphs are built; each is compiled once, at its first use, and reads the parameters as they
are, with the key of its :seed each time (the same noise at every step, so the pictures show
what training changed), so the training steps and their numbers are the same with or
without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time

import numpy as np

from sexpgpu.errors import SxError
from sexpgpu.models import generate
from sexpgpu.run import output


@dataclasses.dataclass
class _Generator:
  decl: object  # front.experiment.GenerateDecl
  program: generate.Program


class Generators:
  """The experiment's defgenerate programs with an :every, ready to run during training."""

  def __init__(self, c):
    """Builds each program's graph (its errors before any initializer).

    Raises:
      SxError: E-GEN-001, E-PARAM-001 or E-RUN-002 at the defgenerate that names F.
    """
    self.c = c
    self.items: list[_Generator] = []
    self.told_no_folder = False
    for d in c.exp.generates.values():
      if not d.every:
        continue  # after training only, with `sexpgpu generate`
      try:
        self.items.append(_Generator(d, generate.Program(c, d.fn)))
      except SxError as e:
        if e.location is not None:
          raise
        raise SxError(e.code, f"defgenerate {d.name}: {e.message}", location=d.loc,
                      fix=e.fix.replace("--fn", ":fn")) from None

  def due(self, step: int, at_end: bool) -> bool:
    """Whether a program runs after `step`."""
    return any(step > 0 and (step % g.decl.every == 0 or at_end) for g in self.items)

  def run(self, ctx, params, step: int, at_end: bool, resumed_at) -> None:
    """Each program due at `step`: its outputs written beside the metrics stream, a
    `generate` event naming them (its targets show the grids as images), a progress line.

    Args: ctx: the RunContext (its placement, and where the numbers go); params: the
    parameters as the run keeps them; step, at_end: the step just trained, and whether it
    is the last; resumed_at: the step a resume starts at, or None.
    """
    place, progress = ctx.place, ctx.out.progress
    metrics, log = ctx.out.metrics, ctx.out.log
    for g in self.items:
      d = g.decl
      if step == 0 or step == resumed_at or not (step % d.every == 0 or at_end):
        continue
      progress.set_status("evaluating", step)
      # host copies: a program reads whole parameters, whatever the run's sharding
      prm = {k: np.asarray(place.host(params[k])) for k in g.program.graph.params}
      g.program.compile(prm)  # once: the samples a second are the program's, not XLA's
      t = time.perf_counter()
      outputs = g.program(prm, d.seed)
      dt = time.perf_counter() - t
      with self._folder(metrics, d.name, log) as (folder, keep):
        files, grids = _write(folder, d.name, step, outputs) if folder else ([], {})
        metrics.emit("generate", step=step, name=d.name, fn=d.fn, seed=d.seed,
                     outputs={k: list(v.shape) for k, v in outputs.items()},
                     files=files if keep else [], images=grids, **{"time/generate": dt})
      files = files if keep else []
      first = next(iter(outputs.values()))
      values = {f"{d.name}/samples-per-s": (first.shape[0] if first.ndim else 1) / max(dt, 1e-9)}
      log(output.progress_line(d.name, step, values, progress))
      shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items())
      log(f"{d.name}: {shapes}; " + (", ".join(files) if files else "no files"))

  @contextlib.contextmanager
  def _folder(self, metrics, name: str, log):
    """Where a program's files go, and whether they stay: beside the metrics stream; without
    a local stream, a temporary folder the targets (W&B, MLflow) read the grids from while
    the event is sent, removed after; None without any target."""
    folder = metrics.folder()
    if folder is not None:
      yield folder, True
      return
    if not self.told_no_folder:  # once a run
      self.told_no_folder = True
      log(f"{name}: its outputs are not kept as files: give --metrics jsonl:PATH or "
          "tensorboard:DIR to write them (and their images) beside the metrics stream")
    if metrics.describe() is None:
      yield None, False
      return
    with tempfile.TemporaryDirectory(prefix="sexpgpu-generate-") as tmp:
      yield tmp, False


def _write(folder: str, name: str, step: int, outputs) -> tuple[list[str], dict]:
  """The .npz (and PNG grids) of one program's outputs under `folder`
  (`generate/NAME/step-N.npz`), and the grids by output."""
  stem = os.path.join(folder, "generate", name, f"step-{step}")
  try:
    files = generate.write(outputs, stem + ".npz")
  except SxError as e:
    raise SxError(e.code, f"defgenerate {name}: {e.message}", where=folder,
                  fix="give --metrics a jsonl file or TensorBoard folder you can write, "
                  "with room for the samples beside it") from None
  pngs = [f for f in files if f.endswith(".png")]
  keys = [k for k, v in outputs.items() if generate.is_images(v)]
  return files, dict(zip(keys, pngs))

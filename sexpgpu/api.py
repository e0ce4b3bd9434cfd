"""The Python API for notebooks: compile an experiment, inspect it, call it, run it."""

from __future__ import annotations

import dataclasses
from typing import Any

from sexpgpu.errors import SxError
from sexpgpu.ir.graph import Graph
from sexpgpu.ir.printer import print_graph
from sexpgpu.front.values import Closure


@dataclasses.dataclass
class State:
  """The train state as plain pytrees."""

  params: dict
  opt_state: Any
  step: int


class Experiment:
  """A compiled selection of an `.sx` experiment (see `compile`)."""

  def __init__(self, compiled):
    self._c = compiled

  @property
  def slug(self) -> str:
    return self._c.slug

  @property
  def knobs(self) -> dict:
    """{name: Knob(value, source)}."""
    return dict(self._c.selection.knobs)

  @property
  def params(self) -> dict:
    """The parameter table: path → Param (shape, dtype, init, count)."""
    return dict(self._c.params)

  @property
  def ir(self) -> str:
    """The printed IR of the loss and every pass metric."""
    return self._c.ir_text()

  @property
  def fingerprint(self) -> str:
    return self._c.fingerprint

  def init(self, seed: int | None = None) -> State:
    """Initial parameters and optimizer state (seed defaults to the run's)."""
    from sexpgpu.lower.init import init_params
    from sexpgpu.run.training import build
    training = build(self._c)
    params = init_params(training.seed if seed is None else int(seed), self._c.params)
    opt, _ = training.optimizer()
    return State(params, opt.init(params), 0)

  def call(self, name: str, params: dict, *args, precision: str | None = None):
    """Calls the experiment's function `name` with these parameters and array arguments.

    The function opens its scope as it does when the loss calls it, so its parameter
    paths are the ones in `params`.
    """
    import jax
    import numpy as np

    from sexpgpu.ir.ops import LowerCtx, dtype_name
    from sexpgpu.lower.interp import run_graph
    env = self._c.exp.env
    try:
      fn = env.lookup(name)
    except KeyError:
      raise SxError("E-NAME-001", f"the experiment has no function `{name}`",
                    where=f"call({name!r})", fix="name a defn of the experiment") from None
    if not isinstance(fn, Closure):
      raise SxError("E-TYPE-001", f"`{name}` is not a function", where=f"call({name!r})",
                    fix="name a defn of the experiment")
    arrays = [np.asarray(a) if not hasattr(a, "dtype") else a for a in args]
    b = self._c.exp.builder()
    b.params = dict(self._c.params)
    b._reset()
    b.allow_new_params = False
    ins = [b._intern("input", (), (("field", f"arg{i}"),), dtype_name(a.dtype), tuple(a.shape),
                     None) for i, a in enumerate(arrays)]
    b.chain = [name]
    out = b.apply(fn, list(ins), {}, None, open_scope=True)
    graph = Graph(name, {f"arg{i}": n for i, n in enumerate(ins)}, {"out": out}, dict(b.used))
    ctx = LowerCtx(precision or str(self._c.exp.run["precision"]), None, False)
    f = jax.jit(lambda p, xs: run_graph(graph, p, xs, ctx)["out"])
    return f({k: params[k] for k in graph.params},
             {f"arg{i}": a for i, a in enumerate(arrays)})

  def run(self, steps: int | None = None, device: str = "cpu", metrics: str | None = None,
          status: str | None = None, checkpoint_dir: str | None = None,
          resume: str | None = None, quiet: bool = True, pipeline: bool = True,
          profile: str | None = None, profile_dir: str | None = None):
    """Trains in this process and returns the Summary (`.eval`, `.train_loss`, ...).

    Args:
      steps: replaces defrun :steps.
      device, metrics, status, checkpoint_dir, resume: as `sexpgpu run`'s flags.
      quiet: no lines on standard error.
      pipeline: draw batches ahead in a thread and read each step's metrics one step late
        (False: draw, step and read in turn; the same numbers, bitwise).
      profile: `A..B`, the steps to trace with jax.profiler (`--profile`).
      profile_dir: where the trace goes (`--profile-dir`).
    """
    from sexpgpu.run.compile import compile_file
    from sexpgpu.run.loop import RunOptions, run_compiled
    c = self._c
    if steps is not None:
      c = compile_file(c.program.path, c.selection.variant,
                       [(k, _text(v)) for k, v in c.selection.sets], {"steps": steps},
                       ",".join(c.diagnostics) or None, program=c.program)
    from sexpgpu.run.env import stacking_from_env
    from sexpgpu.run.profile import parse_range
    span = parse_range(profile, "profile") if profile is not None else None
    return run_compiled(c, RunOptions(c.program.path, device, metrics, status, checkpoint_dir,
                                      resume, stacking_from_env(), False, quiet, span,
                                      profile_dir, pipeline))


def _text(v: Any) -> str:
  from sexpgpu.lang.select import format_value
  return format_value(v)


def compile(path: str, variant: str | None = None, set: dict | None = None,
            diagnostics: str | None = None) -> Experiment:
  """Compiles an experiment file for one selection.

  Args:
    path: the `.sx` file.
    variant: a defvariant name.
    set: knob overrides, {name: value} (values as Python values or strings).
    diagnostics: "a,b" or "all".

  Raises:
    SxError: any compile error.
  """
  from sexpgpu.lang.blame import guarded
  from sexpgpu.run.compile import compile_file
  sets = [(k, _text(v) if not isinstance(v, str) else v) for k, v in (set or {}).items()]
  # as the CLI does: an error in the standard library is placed at the user's knob
  return Experiment(guarded(path, variant, sets, None, diagnostics,
                            lambda: compile_file(path, variant, sets, None, diagnostics)))


def compile_text(source: str, name: str = "experiment.sx", variant: str | None = None,
                 set: dict | None = None, base_dir: str | None = None) -> Experiment:
  """Compiles a string as an experiment (requires resolve from base_dir or the cwd)."""
  from sexpgpu.run.compile import compile_source
  sets = [(k, _text(v) if not isinstance(v, str) else v) for k, v in (set or {}).items()]
  return Experiment(compile_source(source, name, base_dir, variant=variant, sets=sets))

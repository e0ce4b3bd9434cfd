"""The Python API for notebooks: compile an experiment, inspect it, call it, run it, sample it,
export it.

    exp = sexpgpu.compile("configs/tiny-lm.sx", variant="smoke")
    run = exp.run(steps=40)                  # a Run: .eval, .train_loss, .params ...
    exp.sample(run.params, "3 1 4", tokens=8)
    exp.export(run.params, "tiny.safetensors")
    params = exp.load("latest", checkpoint_dir="runs")   # a checkpoint's parameters
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.ir.graph import Graph
from sexpgpu.front.values import Closure


@dataclasses.dataclass
class State:
  """The train state as plain pytrees."""

  params: dict
  opt_state: Any
  step: int


@dataclasses.dataclass(frozen=True)
class Sample:
  """A continuation (what `Experiment.sample` returns).

  Attributes:
    ids: the token ids written after the prompt.
    text: those tokens as text with the experiment's tokenizer, else the ids joined by spaces.
    prompt_ids: the prompt as token ids.
    path: "incremental" (a KV cache) or "recompute" (the window every token).
    tokens_per_s: how fast the tokens came, compiling not counted.
  """

  ids: list
  text: str
  prompt_ids: list
  path: str
  tokens_per_s: float

  def __str__(self) -> str:
    return self.text


class Run:
  """A finished training run (what `Experiment.run` returns).

  It has the run's summary as attributes (`steps`, `train_loss`, `eval`, `counters`,
  `checkpoint`, `stopped_by`, `exit_code`, `goodput`, `as_dict()`), and `params`, the
  trained parameters.
  """

  def __init__(self, summary, experiment: "Experiment"):
    self.summary = summary
    self._exp = experiment
    self._params: dict | None = None

  def __getattr__(self, name: str):
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self.summary, name)

  def __dir__(self):
    fields = [f.name for f in dataclasses.fields(self.summary) if f.name != "read_params"]
    return sorted(set(super().__dir__()) | set(fields) | {"as_dict"})

  def __repr__(self) -> str:
    return (f"Run({self.summary.slug}: {self.summary.steps} steps, train_loss "
            f"{self.summary.train_loss}, eval {self.summary.eval})")

  @property
  def params(self) -> dict:
    """The parameters as they were at the run's last step: a pytree, {`.sx` path: numpy array},
    the paths `Experiment.params` lists (read to the host on first use, then kept)."""
    if self._params is None:
      if self.summary.read_params is None:
        raise SxError("E-FORM-001", "this run's parameters were not kept", where="Run.params",
                      fix="read them from its checkpoint: Experiment.load(run.checkpoint)")
      self._params = self.summary.read_params()
    return self._params

  def sample(self, prompt, **settings) -> Sample:
    """`Experiment.sample(self.params, prompt, ...)`: a continuation by the trained model."""
    return self._exp.sample(self.params, prompt, **settings)

  def export(self, out: str, **how) -> list[str]:
    """`Experiment.export(self.params, out, ...)`, stamped with the run's last step."""
    return self._exp.export(self.params, out, step=self.summary.steps, **how)


class Experiment:
  """A compiled selection of an `.sx` experiment (see `compile`): its knobs, parameter table,
  IR; `init`, `call`, `run`, `load`, `sample`, `export`."""

  def __init__(self, compiled):
    self._c = compiled

  def __repr__(self) -> str:
    return f"Experiment({self._c.slug}: {len(self._c.params)} parameters)"

  @property
  def slug(self) -> str:
    """The selection's slug: the file's stem, the variant and the knobs set."""
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
    """The hash a checkpoint of this selection records (`--resume` checks it)."""
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
                    where=f"call({name!r})",
                    fix=did_you_mean(name, [n for n in env.names() if isinstance(env.lookup(n), Closure)])
                    or "name a defn of the experiment") from None
    if not isinstance(fn, Closure):
      raise SxError("E-TYPE-001", f"`{name}` is not a function", where=f"call({name!r})",
                    fix=f"call a defn; `{name}` is {type(fn).__name__}")
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
    from sexpgpu.lower.fp8 import patterns
    ctx = LowerCtx(precision or str(self._c.exp.run["precision"]), None, False,
                   fp8_only=patterns(self._c.exp.run))
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
    from sexpgpu.run.flags import stacking_from_env
    from sexpgpu.run.profile import parse_range
    span = parse_range(profile, "profile") if profile is not None else None
    summary = run_compiled(c, RunOptions(c.program.path, device, metrics, status,
                                         checkpoint_dir, resume, stacking_from_env(), False,
                                         quiet, span, profile_dir, pipeline))
    return Run(summary, self)

  def load(self, checkpoint: str, checkpoint_dir: str | None = None) -> dict:
    """The parameters of a checkpoint of this experiment, as `sexpgpu export` reads them.

    Args:
      checkpoint: a step folder, a run folder (its newest step), an s3:// one, or
        "latest" (with `checkpoint_dir`).
      checkpoint_dir: where "latest" looks (default SEXPGPU_CHECKPOINT_DIR).

    Returns:
      A pytree {`.sx` path: numpy array}, the paths `params` lists.

    Raises:
      SxError: E-CKPT-001/003 when there is no such complete checkpoint, E-CKPT-002 when it
        is another experiment's.
    """
    return self._restore(checkpoint, checkpoint_dir)[0]

  def _restore(self, checkpoint: str, checkpoint_dir: str | None) -> tuple[dict, dict]:
    from sexpgpu import env
    from sexpgpu.models import source
    where = checkpoint_dir if checkpoint_dir is not None else env.get("SEXPGPU_CHECKPOINT_DIR")
    step_dir = source.step_dir_of(str(checkpoint), where, self._c.slug)
    params, meta = source.checkpoint_params(step_dir)
    source.check_experiment(self._c, meta, step_dir)
    return params, meta

  def _weights(self, params, checkpoint_dir: str | None) -> tuple[dict, dict]:
    """Parameters given as a pytree, or read from a checkpoint named by a string."""
    if isinstance(params, str):
      return self._restore(params, checkpoint_dir)
    if not isinstance(params, dict):
      raise SxError("E-FORM-001", f"parameters are a {type(params).__name__}",
                    where="params", fix="pass run.params, exp.load(CKPT) or a checkpoint path")
    missing = sorted(set(self._c.params) - set(params))
    if missing:
      raise SxError("E-FORM-001", f"the parameters lack {len(missing)} of the experiment's: "
                    + ", ".join(missing[:3]), where="params",
                    fix="pass run.params or exp.load(CKPT) of this experiment")
    return params, {}

  def sample(self, params, prompt, tokens: int = 200, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, fn: str | None = None,
             tokenizer: str | None = None, checkpoint_dir: str | None = None,
             window: str | None = None) -> Sample:
    """A continuation of a prompt, as `sexpgpu sample` writes it.

    Args:
      params: the parameters (`Run.params`, `load(...)`), or a checkpoint to read them from.
      prompt: text (with the text loader's tokenizer or `tokenizer`), token ids as
        "3 1 4", or a list of ids.
      tokens: how many tokens to write.
      temperature: 0 is greedy.
      top_k: keep the k likeliest tokens (0: all).
      top_p: keep the likeliest tokens holding this mass.
      seed: the sampling seed.
      fn: the function of tokens that returns logits (default: the one a defsample
        names, else the only candidate).
      tokenizer: a tokenizer.json (default: the text loader's cache's; UTF-8 bytes for a
        model on a `bytes` loader).
      checkpoint_dir: where a checkpoint "latest" is looked for.
      window: "recompute" slides the window past a position table or an attention window
        (`--window recompute`); None decodes incrementally where the model allows.

    Returns:
      A Sample (`.text`, `.ids`).

    Raises:
      SxError: as `sexpgpu sample` (E-SAMPLE-001 for no such function, E-FORM-001 for a
        token outside the vocabulary or a character the tokenizer lacks, E-SAMPLE-002 for
        a continuation past a position table or window without `window="recompute"`).
    """
    from sexpgpu.models import sample, source
    if window not in (None, "recompute"):
      raise SxError("E-FORM-001", f"window is {window!r}; it takes \"recompute\" or None",
                    where="window", fix='pass window="recompute" to slide the window, or '
                    "leave it out")
    weights, _ = self._weights(params, checkpoint_dir)
    fn = fn or source.default_fn(self._c)
    tok = sample.tokenizer_of(self._c, tokenizer)
    if isinstance(prompt, (list, tuple)):
      ids = [int(i) for i in prompt]
    else:
      ids = (sample.encode_prompt(tok, prompt) if tok is not None
             else sample.parse_ids(str(prompt)))
    settings = sample.Settings(int(tokens), float(temperature), int(top_k), float(top_p),
                               int(seed))
    sample.check_settings(settings, name=lambda field: field)  # as the keyword is named here
    result = sample.generate(self._c, fn, weights, ids, settings, window)
    text = tok.decode(result.ids) if tok is not None else " ".join(map(str, result.ids))
    return Sample(result.ids, text, ids, result.path, result.tokens_per_s)

  def export(self, params, out: str, format: str = "safetensors",  # noqa: A002 (the flag)
             tokenizer: str | None = None, step: int | None = None,
             checkpoint_dir: str | None = None) -> list[str]:
    """Writes parameters as `sexpgpu export` does.

    Args:
      params: the parameters (`Run.params`, `load(...)`), or a checkpoint to read them from.
      out: a .safetensors file, or the folder of an hf model.
      format: "safetensors" or "hf" (a transformers folder, for a gpt2 or llama).
      tokenizer: a tokenizer.json for the hf folder (default: the text loader's).
      step: the step to record in the metadata (a checkpoint's own by default).
      checkpoint_dir: where a checkpoint "latest" is looked for.

    Returns:
      The files written.

    Raises:
      SxError: E-EXPORT-001 when hf is asked of a model that is no gpt2 or llama;
        E-FORM-001 for an unknown format or an unwritable place.
    """
    from sexpgpu.models import export, sample
    if format not in export.FORMATS:
      raise SxError("E-FORM-001", f"format {format!r} is not one of "
                    f"{', '.join(export.FORMATS)}", where="export(format=...)",
                    fix="write format=\"safetensors\" or format=\"hf\"")
    weights, meta = self._weights(params, checkpoint_dir)
    if step is not None:
      meta = {**meta, "step": int(step)}
    if tokenizer is None and format == "hf":
      tokenizer = sample.tokenizer_path(self._c)
    return export.export(self._c, {k: weights[k] for k in self._c.params}, meta, out, format,
                         tokenizer=tokenizer)


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

  Returns:
    The Experiment.

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
  """Compiles a string as an experiment.

  Args:
    source: the `.sx` text.
    name: the file name its errors and slug use.
    variant: a defvariant name.
    set: knob overrides, {name: value}.
    base_dir: where `require` and relative paths resolve (default: the working folder).

  Returns:
    The Experiment.

  Raises:
    SxError: any compile error.
  """
  from sexpgpu.run.compile import compile_source
  sets = [(k, _text(v) if not isinstance(v, str) else v) for k, v in (set or {}).items()]
  return Experiment(compile_source(source, name, base_dir, variant=variant, sets=sets))

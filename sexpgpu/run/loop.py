"""The training loop: set up, plan, initialize or restore, loop, finish.

It reads top to bottom in `_train`. Two things keep the device busy: the next steps'
batches are drawn and placed in a background thread (run/feed.py), and a step's metrics
are read one step late, after the next step has been dispatched (run/stepping.py's
`Steps.step`); the loop flushes the runner first at a pass, a checkpoint, a signal, a
curriculum check and the last step, so what is printed, saved and written is what a loop
that waited on every step would have written. The helpers read the run through one
RunContext (run/context.py): the experiment, the options, its Training and its Outputs.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import jax

from sexpgpu.env import parse_nodes
from sexpgpu.errors import SxError
from sexpgpu.models.warm import start_state
from sexpgpu.run import output, reports, saving, setup, signals
from sexpgpu.run.planning import plan
from sexpgpu.run.compile import (Compiled, cache_dir, release_after_compiles,
                                 release_freed_memory)
from sexpgpu.run.context import Outputs, RunContext
from sexpgpu.run.backend import CompileCounter
from sexpgpu.run.feed import Feed
from sexpgpu.run.passes import Passes
from sexpgpu.run.progress import CompileLine, Progress, Summary
from sexpgpu.run.evaluating import Evaluators
from sexpgpu.run.generating import Generators
from sexpgpu.run.sampling import Samplers
from sexpgpu.run.saving import Saver
# The name tests and benchmarks import from here: whether a CPU run keeps host memory.
from sexpgpu.run.stepping import NonFinite, Steps, Stop, node_left
from sexpgpu.track import StatusFile


@dataclasses.dataclass
class RunOptions:
  """What `sexpgpu run` was asked: flags already merged with the environment."""

  file: str
  device: str = "cpu"
  metrics: str | None = None
  status: str | None = None
  checkpoint_dir: str | None = None
  resume: str | None = None
  stacking: int | None = None
  json: bool = False
  quiet: bool = False  # the API: no standard error lines
  profile: tuple[int, int] | None = None  # steps A..B to trace
  profile_dir: str | None = None
  pipeline: bool = True  # batches drawn ahead and metrics read one step late
  metrics_where: str = "--metrics"  # the flag or variable `metrics` came from, for errors


def run_compiled(compiled: Compiled, opts: RunOptions) -> Summary:
  """Trains a compiled experiment in this process and returns its Summary.

  Raises:
    SxError: any error of the run, after the status file says `failed`.
  """
  t_begin = time.perf_counter()
  # Node variables are read before anything starts a JAX backend (E-DP-005).
  nodes_cfg = parse_nodes(os.environ, opts.device)
  node = nodes_cfg.rank if nodes_cfg else 0
  counter = CompileCounter.install(cache_dir())
  release_after_compiles()
  progress = Progress.begin(compiled.slug, int(compiled.exp.run["steps"]),
                            StatusFile(opts.status if node == 0 else None),  # node 0 writes it
                            compiled.passes)
  line = None if opts.quiet else CompileLine.start()  # on a terminal only
  try:
    return _train(compiled, opts, nodes_cfg, counter, progress, t_begin)
  except SxError as e:
    progress.failed(e.code, e.message)
    raise
  finally:
    if line is not None:
      line.close()
    gc.unfreeze()  # a notebook may compile and run again in this process


def _train(c, o: RunOptions, nodes_cfg, counter, progress: Progress, t_begin: float) -> Summary:
  """Set up, plan, initialize or restore, loop (draw, step, passes, checkpoint), finish."""
  log = (lambda line: None) if o.quiet else output.err
  node = nodes_cfg.rank if nodes_cfg else 0

  # --- set up: devices, checkpoints, metrics, the steps -------------------------------------
  place, rdv, open_s = setup.open_backend(c, o, nodes_cfg, progress, log)
  store, resume_dir, resume_text = setup.open_checkpoints(c, o, node)
  metrics = setup.open_metrics(c, o, place, node, resume_text, log)
  t_setup = time.perf_counter()
  training = setup.build_training(c, place, nodes_cfg, rdv, resume_dir, progress)
  run = RunContext(c, o, training, Outputs(progress, metrics, log))
  saver = Saver(store, run, rdv)
  with saver, signals.deferred() as sig, setup.retries_noted(metrics):
    samplers, evaluators, generators = Samplers(c), Evaluators(c), Generators(c)  # errors first
    # --- plan: every step compiled for abstract values; nothing initialized before it fits
    choice = _plan(run, resume_dir, store is not None)

    # --- initialize or restore ------------------------------------------------------------
    if resume_dir is not None:
      state, start = saving.resume(run, resume_dir)
    else:  # cold, or warm from :init-from
      state, start = start_state(c, training, progress.stage, log), 0
    feed = Feed(c, place, training.k, progress.steps, ahead=o.pipeline)
    passes = Passes(run, samplers, evaluators,
                    resumed_at=start if resume_dir is not None else None, generators=generators)
    profile = setup.open_profile(c, o)
    stop = Stop(sig, place.multiprocess)
    runner = Steps(run, feed, profile, rdv, stop)
    _freeze_the_compiler()
    step0_s = time.perf_counter() - t_setup

    # --- the loop -------------------------------------------------------------------------
    step = start
    feed.start(progress.stage, start)
    passes.first(state, start, feed, stop)  # then a signal waits for a step boundary
    progress.set_status("running", step)
    try:
      while step < progress.steps and not stop.here():
        # The loader is behind: read the last step now, so its time is not the wait's.
        if not feed.ready() and runner.flush():
          break
        batches, info = feed.get()
        if choice.how == "measure":  # the first step's batches time each stacking degree
          choice = reports.measured(choice, training, progress.stage, state, batches, metrics)
        st = training.step(progress.stage, choice.degree)
        # host sync inside: the previous step's numbers are read as this one runs
        state = runner.step(st, state, batches, info, step + 1)
        step += 1
        at_end = step == progress.steps
        due_pass, due_ckpt = passes.due(step, at_end), saver.due(step)
        # What follows needs this step's numbers, or several nodes must agree on a stop now.
        if not o.pipeline or at_end or due_pass or due_ckpt or stop.needs_numbers():
          runner.flush()
        if stop.signum is not None:
          break
        if due_pass and passes.run(state, step, at_end, feed.lock) and passes.advance(step):
          feed.restart(progress.stage, step)
        if at_end:
          break
        if due_ckpt:
          saver.save(step, state, choice.degree, feed.states, wait=False)
        progress.set_status("running", step, force=False)
      runner.flush()
    except jax.errors.JaxRuntimeError as e:
      node_left(rdv, e, step + 1, progress.last_ckpt)  # E-DP-007 when a node left; else raised
    except NonFinite as e:  # the last finite state is checkpointed, then E-NUM-001
      feed.rewind()
      saver.save(e.step - 1, e.state, choice.degree, feed.states, wait=True)
      raise e.error(c.program.path) from None
    finally:
      feed.close()
      runner.close()
    feed.rewind()  # batches drawn ahead and not trained on are drawn again

    # --- finish ---------------------------------------------------------------------------
    saver.finish(step, state, choice.degree, feed.states, step > start or resume_dir is None)
    goodput = reports.finish(run, counter, {"begin": t_begin, "open": open_s, "step0": step0_s},
                             (start, step), profile, choice)
    return _summarize(run, stop, step, goodput, state)


def _freeze_the_compiler() -> None:
  """The compiler's objects live as long as the run: they are kept out of the collector's
  scans, so a collection in the step loop walks only what the loop itself allocates; the
  memory the compiles freed goes back to the OS."""
  gc.collect()
  gc.freeze()
  release_freed_memory()


def _plan(run: RunContext, resume_dir: str | None, saves: bool):
  """The stacking Choice and the memory plan for the stage the run starts at (a resume's,
  with its stacking), from abstract values; the lowering, memory and stacking reports."""
  c, training, progress = run.c, run.training, run.out.progress
  progress.stage, fixed = saving.resumed_plan(c, training.place, resume_dir, run.o.stacking)
  state = training.abstract_state(progress.stage)
  shapes = training.abstract_batches(c.stages[progress.stage].data, (training.k,))
  choice = plan.choose(training, progress.stage, fixed, state, shapes,
                       plan.Setting(cache_dir(), saves, training.place.multiprocess))
  reports.annotate(run, choice)
  return choice


def _summarize(run: RunContext, stop: Stop, step: int, goodput: float, state) -> Summary:
  """The summary: the status `done` or `stopped`, the metrics stream's last event, the
  `done:` block (or nothing, under --json: the CLI prints the summary), a stop's line.
  `state` is the one the run ended with: the summary reads its parameters to the host when
  asked (Run.params in the API), not before."""
  c, o, place = run.c, run.o, run.place
  progress, metrics, log = run.out.progress, run.out.metrics, run.out.log
  progress.base.update(goodput=goodput, stopped_by=stop.name)
  summary = Summary(step, progress.train_loss, dict(progress.last_pass), dict(progress.counters),
                    progress.stage, metrics.summary_path(), o.status, c.slug, stop.name,
                    progress.last_ckpt, stop.exit_code, goodput,
                    lambda: {k: place.host(v) for k, v in state["params"].items()})
  progress.set_status("stopped" if stop.signum else "done", step)
  metrics.emit("summary", **{n: v for n, v in summary.as_dict().items() if n != "kind"})
  metrics.close()
  if not o.json:
    for line in output.done_lines(step, progress.train_loss, summary.eval, summary.counters):
      log(line)
  if stop.signum:
    log(stop.line(step, progress.steps, progress.last_ckpt, o.checkpoint_dir is not None))
  return summary

"""The compile pipeline: read, select, evaluate, open loaders, build every graph."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from sexpgpu import env
from sexpgpu.data import LoaderSpec, make_loader
from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.front.experiment import Experiment, LoaderDecl, evaluate
from sexpgpu.ir.graph import Body, Graph, Param, type_str, walk
from sexpgpu.ir.ops import dtype_name
from sexpgpu.ir.printer import fingerprint, print_graph
from sexpgpu.ir import lora
from sexpgpu.ir.rewrite import rewrite
from sexpgpu.ir import mup
from sexpgpu.lang.program import Program, load_program, load_text
from sexpgpu.lang.select import (NOT_IN_FINGERPRINT, Selection, format_value, run_slug_stem,
                                  select)
from sexpgpu.paths import cache_dir  # noqa: F401  (run/ imports it from here too)


def loader_spec(decl: LoaderDecl) -> LoaderSpec:
  args = dict(decl.args)
  if "components" in args:
    args["components"] = [(w, loader_spec(d)) for w, d in args["components"]]
  return LoaderSpec(decl.name, decl.kind, args, decl.base_dir, decl.location)


@dataclasses.dataclass
class Stage:
  """A curriculum stage as compiled: its loader, experiment (knobs bound) and loss graph."""

  name: str
  index: int
  data: str
  exp: Experiment
  graph: Graph
  when: Any


@dataclasses.dataclass
class Compiled:
  """Everything built from one selection, before any device work.

  Attributes:
    exp: the experiment of stage 0.
    stages: one per curriculum stage (one stage when there is no curriculum).
    passes: pass name → {metric name → graph}.
    params: the parameter table, by path.
    fields: loader name → {field: (dtype, shape)}.
    fingerprint: hash of the printed IR and the trajectory knobs.
    graph_fingerprint: hash of the printed IR and record shapes only.
    graph_seconds: time to read, build and lower to JAX.
  """

  program: Program
  selection: Selection
  exp: Experiment
  stages: list[Stage]
  passes: dict[str, dict[str, Graph]]
  params: dict[str, Param]
  fields: dict[str, dict[str, tuple[str, tuple[int, ...]]]]
  loaders: dict[str, Any]
  fingerprint: str
  graph_fingerprint: str
  graph_seconds: float
  diagnostics: list[str]
  regions: list = dataclasses.field(default_factory=list)
  patterns: bool = True

  @property
  def slug(self) -> str:
    return self.selection.slug

  def ir_text(self) -> str:
    parts = [print_graph(s.graph) for s in self.stages if s.index == 0 or s.graph is not
             self.stages[0].graph]
    for name, graphs in self.passes.items():
      parts.extend(print_graph(g) for g in graphs.values())
    return "\n\n".join(parts)


def compile_file(path: str, variant: str | None = None, sets: list[tuple[str, str]] = (),
                 overrides: dict | None = None, diagnostics: str | None = None,
                 program: Program | None = None) -> Compiled:
  """Compiles an experiment file (or an already loaded program) for one selection.

  Raises:
    SxError: any compile error.
  """
  t0 = time.perf_counter()
  program = program or load_program(path)
  stem = run_slug_stem()
  selection = select(program, variant, list(sets), overrides, stem)
  exp = evaluate(program, selection)
  selected = _select_diagnostics(exp, diagnostics)
  taps = {exp.diagnostics[d].arg for d in selected if exp.diagnostics[d].kind == "tap"}
  seed = int(exp.run["seed"])
  loaders, fields = {}, {}
  for name, decl in exp.loaders.items():
    training = name == exp.data or any(s.data == name for s in exp.curriculum)
    ld = make_loader(loader_spec(decl), seed=seed, cache_dir=cache_dir(),
                     shuffle_default=training)
    loaders[name] = ld
    fields[name] = {f: (dtype_name(dt), tuple(sh)) for f, (sh, dt) in ld.fields.items()}
  check_batches(exp, loaders)  # check refuses what run would
  stages = _stages(program, selection, exp, fields, taps)
  for st in stages:
    check_sizes(st.graph)
    check_vocabulary(st.graph, st.data, loaders[st.data], exp.loaders[st.data].location)
  patterns = env.get("SEXPGPU_PATTERNS") != "off"
  regions: list = []
  adapters = exp.run.get("lora")  # LoRA's adapters (ir/lora.py), before the patterns
  for st in stages:
    st.graph, found = rewrite(lora.apply(st.graph, adapters), patterns)
    if st.index == 0:
      regions = found
  passes = {}
  builder = stages[0].exp.builder()
  builder.params = dict(stages[0].graph.params)
  for pname, p in exp.passes.items():
    graphs = {}
    for mname, fn in p.metrics:
      g, out = builder.build(f"{pname}/{mname}", fn, fields[p.data], allow_new_params=False)
      _check_scalar(out, f"metric {mname} of pass {pname}", p.loc, builder)
      check_sizes(g)
      check_vocabulary(g, p.data, loaders[p.data], exp.loaders[p.data].location)
      graphs[mname] = rewrite(lora.apply(g, adapters, strict=False), patterns)[0]
    passes[pname] = graphs
  mup.apply_stages(stages, passes, exp.optimizer)  # μP's initializers and output multiplier
  from sexpgpu.lower.fp8 import check_patterns
  check_patterns([s.graph for s in stages], exp.run)  # :fp8's globs, for every command
  params = dict(stages[0].graph.params)
  ir = "\n\n".join(print_graph(s.graph, with_locs=False) for s in stages)
  ir += "".join("\n\n" + print_graph(g, with_locs=False) for gs in passes.values()
                for g in gs.values())
  # an op written in Python is its file: what it computes is not in the printed IR
  ir += "".join(f"\n\n{d}\n{program.sources[d]}" for d in program.python)
  knobs = "\n".join(f"{k}={format_value(v.value)}" for k, v in sorted(selection.knobs.items())
                    if k not in NOT_IN_FINGERPRINT)
  if exp.run.get("trainable") is not None:  # what trains is the trajectory (and the state's tree)
    knobs += "\ntrainable=" + " ".join(exp.run["trainable"].get("patterns"))
  if exp.run.get("fp8") is not None:  # which products run in float8 is the trajectory too
    knobs += "\nfp8=" + " ".join(exp.run["fp8"].get("patterns"))
  shapes = "\n".join(f"{n}:{sorted(f.items())}" for n, f in sorted(fields.items()))
  return Compiled(program, selection, exp, stages, passes, params, fields, loaders,
                  fingerprint(ir + "\n" + knobs), fingerprint(ir + "\n" + shapes),
                  time.perf_counter() - t0, selected, regions, patterns)


def release_freed_memory() -> bool:
  """Gives the heap's free pages back to the OS (glibc's malloc_trim); True when it ran.

  XLA's compiles (the plan's steps and passes, the initial state) free most of what they
  allocate, but glibc keeps freed memory in its arenas, one for each thread that
  allocated: 260 MB of a cold start's 605 MB of resident memory after the plan of
  configs/shakespeare-char.sx, 44 of a warm one's 322 (benchmarks/README.md). Returned
  once before the loop, it is not counted in the run's resident memory from then on, and
  the loop's own allocations reuse what is left. Elsewhere than glibc it does nothing.
  """
  import ctypes
  import ctypes.util
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return False
  if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "malloc_trim"):
    return False
  libc.malloc_trim(0)
  return True


# A compile this long frees enough (tens of MB: LLVM's modules, XLA's passes) to be worth a
# trim at its end (release_after_compiles); a small one is left alone.
TRIM_AFTER_COMPILE_S = 0.5
_trimming = False


def release_after_compiles() -> None:
  """From now on in this process, each XLA compile that ran TRIM_AFTER_COMPILE_S or longer
  gives what it freed back to the OS when it ends (release_freed_memory): the next compile
  then starts from the memory the run holds, not on top of what the last one left in the
  arenas."""
  global _trimming
  if _trimming:
    return
  import jax

  def on_duration(name, secs, **kw):
    if name == "/jax/core/compile/backend_compile_duration" and secs >= TRIM_AFTER_COMPILE_S:
      release_freed_memory()
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  _trimming = True


def check_batches(exp, loaders: dict) -> None:
  """Refuses a pass that reads more microbatches than its loader's split holds whole: past
  them its loader wraps round, and the pass would average records it has already read.

  An endless loader (a Markov chain, a task, a mix) has no such bound: its :batches is
  bounded by front.experiment.MAX_PASS_BATCHES alone, and a long pass says how far it is
  (run/passes.py's PASS_PROGRESS_SECONDS).

  Raises:
    SxError: E-LOAD-005 at the pass's `:batches` (or its defpass, when `:batches` is not
      written), both counts named.
  """
  for name, p in exp.passes.items():
    loader = loaders[p.data]
    whole = loader.whole_batches()
    if whole is None or p.batches <= whole:
      continue
    decl = exp.loaders[p.data]
    raise SxError("E-LOAD-005", f"defpass {name} reads :batches {p.batches} microbatches of "
                  f"{loader.batch_size} from loader `{p.data}`, whose split holds "
                  f"{loader.records} records: {whole} whole microbatches",
                  location=p.batches_loc or p.loc,
                  fix=f":batches {whole} reads the split of `{p.data}` once; for more, give "
                  "the loader a larger file or :split",
                  notes=[("loader", str(decl.location))])


def compile_source(text: str, name: str = "experiment.sx", base_dir: str | None = None,
                   **kw) -> Compiled:
  """Compiles a string as an experiment."""
  return compile_file(name, program=load_text(text, name, base_dir), **kw)


def _select_diagnostics(exp: Experiment, diagnostics: str | None) -> list[str]:
  if not diagnostics:
    return []
  names = list(exp.diagnostics) if diagnostics == "all" else [
      d.strip() for d in diagnostics.split(",") if d.strip()]
  for n in names:
    if n not in exp.diagnostics:
      raise SxError("E-NAME-001", f"no diagnostic `{n}`", where=f"--diagnostics {diagnostics}",
                    fix=did_you_mean(n, exp.diagnostics) or (
                        "defined: " + ", ".join(exp.diagnostics) if exp.diagnostics
                        else "this experiment defines no diagnostic"))
  return names


# A tensor's extent and a repeat's count reach the step as int32; no tensor of ELEMENT_LIMIT
# elements fits any device (XLA aborts the process on an extent product past int64).
EXTENT_LIMIT = 2**31
ELEMENT_LIMIT = 2**48


def check_sizes(graph: Graph) -> None:
  """Refuses a graph with an extent or a repeat count past int32, or a tensor past any
  device, before anything is lowered or allocated (XLA would abort, JAX overflow).

  Raises:
    SxError: E-SHAPE-001 at the `.sx` place of the first such value.
  """
  todo, seen = list(graph.outputs.values()), set()
  while todo:
    for node in walk(todo):
      seen.add(node.uid)
      count = node.attr("n")
      if node.op == "repeat" and isinstance(count, int) and count >= EXTENT_LIMIT:
        raise SxError("E-SHAPE-001", f"a repeat of {count} times: more than the "
                      f"{EXTENT_LIMIT - 1} a step can count", location=node.loc,
                      fix="repeat fewer times (a layer count below 2^31)")
      elements = 1
      for d in node.shape:
        elements *= int(d)
      if any(int(d) >= EXTENT_LIMIT for d in node.shape) or elements >= ELEMENT_LIMIT:
        raise SxError("E-SHAPE-001", f"a tensor of type {type_str(node.dtype, node.shape)} at {node.op}: "
                      f"{elements} elements, an extent or a size no step can hold (extents "
                      f"below 2^31, fewer than 2^48 elements)", location=node.loc,
                      fix="give the sizes that make this shape (knobs, :width, :vocab) "
                      "smaller values")
    todo = [b.output for n in walk(todo) for _, b in n.attrs if isinstance(b, Body)
            and b.output.uid not in seen]


# Ops that move or reshape a batch's token ids without changing them.
_SAME_IDS = ("slice", "reshape", "transpose", "cast")
# op → (the input holding token ids, the input whose size bounds them, the axis of that size)
_ID_USES = {"take": (1, 0, 0), "cross-entropy": (1, 0, -1),
            "chunked-cross-entropy": (2, 1, -1)}


def check_vocabulary(graph: Graph, data: str, loader: Any, where: Any = None) -> None:
  """Refuses a model smaller than the vocabulary of the loader that feeds it, at compile time.

  Where a loader states its vocabulary (markov's `:vocab`, a token file's `:vocab`, a text
  cache's tokenizer) and its token ids reach an embedding (`take`) or a cross-entropy's
  targets unchanged, the table's rows and the logits' width must hold every id: a token
  past them would make the loss NaN at the first step, not an error that says why.

  Args:
    graph: a loss or metric graph built on the loader's fields.
    data: the loader's name (for the message).
    loader: the opened loader; its `vocab` attribute, when an int, bounds its ids.
    where: the loader's `.sx` place, named in a note.

  Raises:
    SxError: E-LOAD-003 at the op's `.sx` place, naming both sizes.
  """
  vocab = getattr(loader, "vocab", None)
  if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
    return
  for node in graph.nodes():
    use = _ID_USES.get(node.op)
    if use is None or len(node.inputs) <= max(use[:2]):
      continue
    ids, bound, axis = node.inputs[use[0]], node.inputs[use[1]], use[2]
    field = _field_of(ids)
    size = getattr(bound, "shape", ())
    # a loader's vocabulary bounds its token ids, not its :segments or :positions
    if field != "tokens" or not size or size[axis] >= vocab:
      continue
    what = (f"its embedding table has {size[axis]} rows" if node.op == "take"
            else f"its logits have {size[axis]} classes")
    raise SxError("E-LOAD-003", f"loader `{data}` gives `{field}` ids up to {vocab - 1} "
                  f"(a vocabulary of {vocab}), but the model's {node.op} takes fewer: {what}",
                  location=node.loc, notes=[("loader", str(where))] if where else (),
                  fix=f"give the model a vocabulary of {vocab} (the loader's), or the loader "
                  f"a :vocab of {size[axis]}")


def _field_of(node: Any) -> str | None:
  """The batch field whose ids `node` holds unchanged, or None."""
  while getattr(node, "op", None) in _SAME_IDS:
    if node.op == "cast" and not node.dtype.startswith(("i", "u")):
      return None
    node = node.inputs[0]
  if getattr(node, "op", None) == "input":
    return node.attr("field")
  return None


def _check_scalar(out: Any, what: str, loc, builder) -> None:
  from sexpgpu.front.build import describe, is_tensor
  if not is_tensor(out) or out.shape != () or out.dtype not in ("f32", "bf16", "f16"):
    raise SxError("E-RUN-002", f"the {what} must return a float scalar; it returned "
                  f"{describe(out)}", location=loc,
                  fix="reduce it with (mean ...) or (cross-entropy ...)")


def _stages(program, selection, exp, fields, taps) -> list[Stage]:
  b = exp.builder(taps)
  graph, out = b.build("loss", exp.loss, fields[exp.data])
  _check_scalar(out, "loss", exp.run_loc, b)
  stages = [Stage(exp.curriculum[0].name if exp.curriculum else "main", 0, exp.data, exp, graph,
                  None)]
  for i, st in enumerate(exp.curriculum[1:], start=1):
    sub_exp = exp
    if st.sets:
      knobs = dict(selection.knobs)
      from sexpgpu.lang.select import Knob, coerce
      for k, v, loc in st.sets:
        knobs[k] = Knob(coerce(v, knobs[k].value, k, loc), "stage")
      sub_exp = evaluate(program, dataclasses.replace(selection, knobs=knobs))
    data = st.data or stages[-1].data
    sb = sub_exp.builder(taps)
    g, out = sb.build("loss", sub_exp.loss, fields[data])
    _check_scalar(out, "loss", sub_exp.run_loc, sb)
    for path, p in g.params.items():
      q = graph.params.get(path)
      if q is None or q.full_shape != p.full_shape:
        raise SxError("E-CURR-001", f"stage {st.name} changes parameter {path} "
                      f"({'absent' if q is None else list(q.full_shape)} → {list(p.full_shape)})",
                      location=st.loc, fix="a stage may change data and knobs that keep every "
                      "parameter's shape (learning rate, dropout, ...)")
    missing = set(graph.params) - set(g.params)
    if missing:
      path = sorted(missing)[0]
      raise SxError("E-CURR-001", f"stage {st.name} drops parameter {path}", location=st.loc,
                    fix="a stage must keep every parameter")
    stages.append(Stage(st.name, i, data, sub_exp, g, st.when))
  return stages

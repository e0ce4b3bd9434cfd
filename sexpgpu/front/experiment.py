"""Top-level forms evaluated under a selection: the experiment's declarations."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from sexpgpu.data import KINDS as LOADERS, keywords as loader_keywords, takes_file
from sexpgpu.data.spec import LoaderSpec, bind_args
from sexpgpu.errors import Loc, SxError, did_you_mean
from sexpgpu.front.build import Builder, as_init, describe, is_tensor, parse_params, static_shape
from sexpgpu.front import optimizers, pyops, tuning
from sexpgpu.front import asserts  # noqa: F401  (registers assert and its predicates)
from sexpgpu.front import keywords as kw
from sexpgpu.front.namespaces import std_namespaces
from sexpgpu.front.prims import BUILTINS, DTYPE_VALUES
from sexpgpu.front.values import Closure, Env, ParamRef, Spec
from sexpgpu.ir import mup
from sexpgpu.lang.forms import CLAUSES, FORMS, MAX_PASS_BATCHES, reads
from sexpgpu.lang.program import Program, literal_value, split_keywords
from sexpgpu.lang.select import RUN_KNOBS, Selection
from sexpgpu.reader import Atom, Form, Keyword, List, Symbol, Vector
from sexpgpu.reader.forms import head_symbol


class _LoaderKeywords(Mapping):
  """Each loader kind's `:keyword`s, read from its declaration (sexpgpu.data.KINDS) when
  asked, so that a kind declared there is a kind here."""

  def __getitem__(self, kind: str) -> tuple[str, ...]:
    if kind not in LOADERS:
      raise KeyError(kind)
    return loader_keywords(kind)

  def __iter__(self):
    return iter(LOADERS)

  def __len__(self) -> int:
    return len(LOADERS)


LOADER_KINDS = _LoaderKeywords()
DIAG_KINDS = ("grad-norm", "param-norm", "update-ratio", "tap")
REDUCERS = ("mean", "max", "min", "sum", "rms")


@dataclasses.dataclass(frozen=True)
class LoaderDecl:
  """A `defloader`: what sexpgpu.data.LoaderSpec is made from."""

  name: str
  kind: str
  args: dict
  base_dir: str
  location: Loc


@dataclasses.dataclass
class PassDecl:
  """A `defpass`: its loader, cadence, microbatches a run and metrics; `batches_loc` is where
  `:batches` is written (None when it is not), where a split too small for it is told."""

  name: str
  data: str
  every: int | None
  batches: int
  metrics: list[tuple[str, Any]]
  loc: Loc
  batches_loc: Loc | None = None


MAX_PASS_BATCHES = MAX_PASS_BATCHES  # the most microbatches a pass reads (lang/forms.py)


@dataclasses.dataclass
class SampleDecl:
  """A `defsample`: continuations of fixed prompts written to the metrics during training."""

  name: str
  fn: str  # the function of tokens [b t] that returns logits [b t vocab]
  prompts: tuple[str, ...]  # text (with the experiment's tokenizer) or token ids "3 1 4"
  tokens: int
  every: int
  temperature: float
  top_k: int
  top_p: float
  seed: int
  loc: Loc


@dataclasses.dataclass(frozen=True)
class GenerateDecl:
  """A `defgenerate`: a program of the trained functions, F of no arguments, run by
  `sexpgpu generate` from a checkpoint with the key of :seed."""

  name: str
  fn: str
  every: int
  seed: int
  loc: Loc


@dataclasses.dataclass
class EvalDecl:
  """A `defeval`: downstream tasks scored by log-likelihood during training."""

  name: str
  fn: str  # the function of tokens [b t] that returns logits [b t vocab]
  tasks: tuple[tuple[str, Loc], ...]  # .jsonl files (resolved against the .sx file's folder)
  every: int
  batch: int
  limit: int | None  # the first documents of each task, else all
  tokenizer: str | None  # a tokenizer.json, else the text loader's cache's
  loc: Loc


@dataclasses.dataclass
class StageDecl:
  name: str
  data: str | None
  when: Form | None
  sets: list[tuple[str, Any, Loc]]
  loc: Loc


@dataclasses.dataclass
class DiagDecl:
  name: str
  every: int
  kind: str
  arg: str | None
  reduce: str
  loc: Loc


@dataclasses.dataclass
class Experiment:
  """One selected experiment, its top level evaluated (no graph built yet).

  Attributes:
    program, selection: what it was made from.
    env: the global bindings (functions, defs, knobs).
    loaders, passes, curriculum, diagnostics: declarations.
    loss: the run's loss function; data: its loader's name.
    optimizer: a Spec of kind "optimizer".
    run: the run knobs' values (steps, microbatches, seed, precision, ...).
  """

  program: Program
  selection: Selection
  env: Env
  loaders: dict[str, LoaderDecl]
  passes: dict[str, PassDecl]
  samples: dict[str, SampleDecl]
  evals: dict[str, EvalDecl]
  curriculum: list[StageDecl]
  diagnostics: dict[str, DiagDecl]
  loss: Closure
  data: str
  optimizer: Spec
  run: dict[str, Any]
  run_loc: Loc
  generates: dict[str, GenerateDecl] = dataclasses.field(default_factory=dict)
  # every top-level form's declarations by form and name (a form without a name: its value)
  found: dict[str, Any] = dataclasses.field(default_factory=dict)

  def builder(self, selected_taps=frozenset()) -> Builder:
    return Builder(self.env, selected_taps,
                   {k: d.loc for k, d in self.program.knobs.items()})


def global_env(knobs: dict[str, Any]) -> Env:
  env = Env(None, dict(BUILTINS))
  env.vars.update(DTYPE_VALUES)
  return Env(env, dict(knobs))


@dataclasses.dataclass
class TopLevel:
  """What a top-level form's reader sees, `reader(top, form, env)` (lang/forms.py; `env` the
  namespace its name goes to): the builder, the global environment, the program and the
  selection, and what the forms read so far made (`found`: form → name → declaration, or
  form → value for a form without a name)."""

  b: Builder
  env: Env
  program: Program
  selection: Selection
  found: dict[str, Any] = dataclasses.field(default_factory=dict)

  def of(self, form: str) -> dict[str, Any]:
    """The declarations of the top-level form `form` read so far, by name."""
    return self.found.setdefault(form, {})


def evaluate(program: Program, selection: Selection) -> Experiment:
  """Evaluates the top-level forms under the selection's knob values, each through its
  declaration's reader (lang/forms.py's FORMS).

  Raises:
    SxError: any E-NAME, E-FORM, E-TYPE, E-RUN or E-CURR found at the top level.
  """
  knobs = {k: v.value for k, v in selection.knobs.items()}
  env = global_env({k: v for k, v in knobs.items() if k in program.knobs})
  # the one gate of the Python it requires: refused before any runs (pyops.trusting)
  env.parent.vars.update(pyops.load_all(program))
  spaces, qualified = std_namespaces(program, env)
  b = Builder(env, knob_locs={k: d.loc for k, d in program.knobs.items()})
  top = TopLevel(b, env, program, selection)
  # in order, those declared `after` (defrun: it names the others' declarations) last
  for form in sorted(program.forms, key=lambda f: FORMS[head_symbol(f)].after):
    fdef = FORMS[head_symbol(form)]
    if fdef.defines is None:
      top.found[fdef.name] = fdef.reader(top, form, env)
      continue
    name = str(form.items[1].value)
    lib = program.namespace_of(form)  # a std library's definitions go to its own namespace
    fenv = spaces[lib] if lib else env
    value = top.of(fdef.name)[name] = fdef.reader(top, form, fenv)
    if fdef.binds:
      fenv.vars[name] = value
    if lib and name in fenv.vars:
      qualified[f"{lib}/{name}"] = fenv.vars[name]
  loaders, passes, samples = top.of("defloader"), top.of("defpass"), top.of("defsample")
  evals, generates, diags = top.of("defeval"), top.of("defgenerate"), top.of("defdiagnostic")
  curriculum = top.found.get("defcurriculum") or []
  loss, data, optimizer, run, run_loc = top.found["defrun"]
  for st in curriculum:
    if st.data is not None and st.data not in loaders:
      raise SxError("E-NAME-001", f"stage {st.name}: no loader `{st.data}`", location=st.loc,
                    fix=did_you_mean(st.data, loaders) or "define it with defloader")
  for kind, decls in (("defsample", samples), ("defeval", evals)):
    for name in decls:
      if name in passes:
        raise SxError("E-NAME-002", f"`{name}` names both a defpass and a {kind}",
                      location=decls[name].loc)
  for name in evals:
    if name in samples:
      raise SxError("E-NAME-002", f"`{name}` names both a defsample and a defeval",
                    location=evals[name].loc)
  return Experiment(program, selection, env, loaders, passes, samples, evals, curriculum, diags,
                    loss, data, optimizer, run, run_loc, generates, top.found)


@reads("def")
def _def(top: TopLevel, form: List, env: Env) -> Any:
  name = str(form.items[1].value)
  if len(form.items) != 3:
    raise SxError("E-FORM-001", "def takes a name and a value", location=form.loc,
                  fix=f"(def {name} EXPR)")
  value = top.b.eval(form.items[2], env)
  if is_tensor(value):
    raise SxError("E-TYPE-001", f"def {name} is a tensor: def binds static values only",
                  location=form.items[2].loc, fix="compute tensors inside a defn")
  return value


@reads("defn")
def _defn(top: TopLevel, form: List, env: Env) -> Closure:
  name = str(form.items[1].value)
  if len(form.items) < 4 or not isinstance(form.items[2], Vector):
    raise SxError("E-FORM-001", f"defn {name} needs a parameter vector and a body",
                  location=form.loc, fix=f"(defn {name} [x] BODY)")
  params, kwparams = parse_params(form.items[2])
  return Closure(name, params, kwparams, form.items[3:], env, form.loc)


@reads("defparam")
def _defparam(top: TopLevel, form: List, env: Env) -> ParamRef:
  b, name = top.b, str(form.items[1].value)
  if len(form.items) < 3:
    raise SxError("E-FORM-001", f"defparam {name} needs a shape", location=form.loc,
                  fix=f"(defparam {name} [vocab width] :init (normal 0.02))")
  shape = static_shape(b.eval(form.items[2], env), form.items[2])
  kws = kw.keys(form, 3)
  init = as_init(b.eval(kws["init"], env), kws["init"]) if "init" in kws else as_init(
      BUILTINS["zeros"], form)
  dtype = str(b.eval(kws["dtype"], env)) if "dtype" in kws else FORMS["defparam"].key(
      "dtype").default
  return ParamRef(name, shape, init, dtype, form.loc)


@reads("defloader")
def _loader(top: TopLevel, form: List, env: Env) -> LoaderDecl:
  name = str(form.items[1].value)
  if len(form.items) != 3 or not isinstance(form.items[2], List):
    raise SxError("E-FORM-001", f"defloader {name} takes one (KIND ARGS...) form",
                  location=form.loc, fix=f"(defloader {name} (markov :vocab 32 :seq 17 :batch 4 :seed 7))")
  return _loader_spec(top.b, name, form.items[2], env, top.program, top.of("defloader"))


def _loader_spec(b: Builder, name: str, spec: List, env: Env, program: Program,
                 known: dict) -> LoaderDecl:
  kind = head_symbol(spec)
  if kind not in LOADER_KINDS:
    raise SxError("E-FORM-001", f"loader {name}: unknown kind `{kind}`", location=spec.loc,
                  fix=(did_you_mean(str(kind), LOADER_KINDS) + " " if kind else "")
                  + "kinds: " + " ".join(LOADER_KINDS))
  pos, kws, locs = split_keywords(spec, 1, LOADER_KINDS[kind], f"loader kind {kind}")
  decl = LOADERS[kind]
  # a "names" keyword's symbols are field names, a "choice" keyword's symbol a name
  # (`:pack docs`, `:dtype u16`), not variables
  args = {k: (_field_names(f) if decl.key(k).kind == "names" else _symbol_name(f)
              if decl.key(k).kind == "choice" else kw.static(b, f, env, f"loader {name} :{k}"))
          for k, f in kws.items()}
  if "components" in decl.required:
    comps = []
    for p in pos:
      if not (isinstance(p, List) and len(p.items) == 2):
        raise SxError("E-FORM-001", "mix takes (WEIGHT LOADER) pairs", location=p.loc,
                      fix="(mix (0.7 web) (0.3 books))")
      w = kw.static(b, p.items[0], env, "a mix weight")
      sub = p.items[1]
      if isinstance(sub, Atom) and isinstance(sub.value, Symbol):
        sub_decl = known.get(str(sub.value))
        if sub_decl is None:
          raise SxError("E-NAME-001", f"no loader `{sub.value}`", location=sub.loc,
                        fix=did_you_mean(str(sub.value), known) or "define it with defloader")
      else:
        sub_decl = _loader_spec(b, f"{name}.{len(comps)}", sub, env, program, known)
      comps.append((float(w), sub_decl))
    args["components"] = comps
  elif takes_file(kind):
    if len(pos) != 1:
      raise SxError("E-FORM-001", f"loader {name}: {kind} takes one file path",
                    location=spec.loc, fix=f'({kind} "data.bin" ...)')
    path = kw.static(b, pos[0], env, "a file path")
    if not isinstance(path, str) or isinstance(path, Symbol):
      raise SxError("E-TYPE-001", f"loader {name}: the file is a string", location=pos[0].loc,
                    fix=f'({kind} "data.bin" ...)')
    args["path"] = path
    if "fields" in args:
      args["fields"] = [str(f) for f in args["fields"]]
  elif pos:
    raise SxError("E-FORM-001", f"loader {name}: {kind} takes keyword arguments only",
                  location=pos[0].loc, fix=f"({kind} :seq 16 :batch 4 ...)")
  if "dtype" in args:
    args["dtype"] = str(args["dtype"])
  # the loader's own checks of its keywords, from its declaration, as make_loader runs them
  bind_args(LoaderSpec(name, str(kind), args, program.base_dir, spec.loc), decl)
  return LoaderDecl(name, str(kind), args, program.base_dir, spec.loc)


def _symbol_name(form: Form) -> Any:
  """`:pack docs` names a packing, `:dtype u16` a dtype: the symbol is a name, not a variable."""
  if isinstance(form, Atom) and isinstance(form.value, Symbol):
    return str(form.value)
  return form.value if isinstance(form, Atom) else str(form)


def _field_names(form: Form) -> list[str]:
  """`:fields [x y]` names fields: the symbols are names, not variables."""
  if isinstance(form, Vector) and all(isinstance(i, Atom) and isinstance(i.value, (str, Keyword))
                                      for i in form.items):
    return [str(i.value) for i in form.items]
  raise SxError("E-FORM-001", ":fields is a vector of field names", location=form.loc,
                fix=":fields [x y]")


@reads("defpass")
def _pass(top: TopLevel, form: List, env: Env) -> PassDecl:
  b, name, kws = top.b, str(form.items[1].value), kw.keys(form)
  kw.need(form, kws)
  data = kw.loader_name(kws["data"], top.of("defloader"))
  every = kw.value(top.b, form, kws, "every", env)
  batches = kw.value(top.b, form, kws, "batches", env)
  if batches > MAX_PASS_BATCHES:
    raise SxError("E-TYPE-001", f"defpass {name}: :batches {batches} is past the most a pass "
                  f"reads, {MAX_PASS_BATCHES} (its batch index is an int32)",
                  location=kws["batches"].loc,
                  fix=f":batches from 1 to {MAX_PASS_BATCHES}, such as :batches 100")
  if not isinstance(kws["metrics"], Vector):
    raise SxError("E-FORM-001", ":metrics is a vector of functions", location=kws["metrics"].loc,
                  fix=":metrics [loss accuracy]")
  metrics = []
  for m in kws["metrics"].items:
    fn = b.eval(m, env)
    if not isinstance(fn, Closure):
      raise SxError("E-TYPE-001", f"metric `{m}` is not a function of the batch",
                    location=m.loc, fix="(defn accuracy [batch] ...)")
    metrics.append((str(m), fn))
  return PassDecl(name, data, every, int(batches), metrics, form.loc,
                  kws["batches"].loc if "batches" in kws else None)


@reads("defgenerate")
def _generate(top: TopLevel, form: List, env: Env) -> GenerateDecl:
  kws = kw.keys(form)
  name, fn = _model_pass(top, form, env, kws,
                         "name a defn of no arguments that returns what it generates")
  every = kw.value(top.b, form, kws, "every", env)
  seed = kw.value(top.b, form, kws, "seed", env)
  return GenerateDecl(name, fn.name, every, seed, form.loc)


def _model_pass(top: TopLevel, form: List, env: Env, kws: dict, fn_fix: str
                ) -> tuple[str, Closure]:
  """A defsample's, defeval's or defgenerate's name and :fn (a named defn), each keyword its
  declaration requires among its `kws` (else its declared example as the fix)."""
  name, kind = str(form.items[1].value), head_symbol(form)
  kw.need(form, kws)
  fn = top.b.eval(kws["fn"], env)
  if not isinstance(fn, Closure) or fn.name is None:
    raise SxError("E-TYPE-001", f"{kind} {name} :fn `{kws['fn']}` is not a function",
                  location=kws["fn"].loc, fix=fn_fix)
  return name, fn


@reads("defsample")
def _sample(top: TopLevel, form: List, env: Env) -> SampleDecl:
  b, kws = top.b, kw.keys(form)
  name, fn = _model_pass(top, form, env, kws, "name a defn of tokens [b t] that returns logits")
  prompts = kw.static(b, kws["prompts"], env, ":prompts")
  if (not isinstance(prompts, tuple) or not prompts
      or not all(isinstance(p, str) and p.strip() for p in prompts)):
    raise SxError("E-TYPE-001", f"defsample {name} :prompts must be a vector of non-empty "
                  f"strings; found {describe(prompts)}", location=kws["prompts"].loc,
                  fix=':prompts ["Once upon" "The"] (token ids as "3 1 4" without a tokenizer)')
  tokens, every, temperature, top_k, top_p, seed = (
      kw.value(top.b, form, kws, k, env)
      for k in ("tokens", "every", "temperature", "top-k", "top-p", "seed"))
  return SampleDecl(name, fn.name, tuple(prompts), tokens, every, temperature, top_k, top_p,
                    seed, form.loc)


@reads("defeval")
def _eval(top: TopLevel, form: List, env: Env) -> EvalDecl:
  b, base_dir, kws = top.b, top.program.base_dir, kw.keys(form)
  name, fn = _model_pass(
      top, form, env, kws,
      "name a defn of tokens [b t] that returns logits (with :segments and :positions "
      "keywords its requests are packed)")
  tasks_form = kws["tasks"]
  paths = kw.static(b, tasks_form, env, ":tasks")
  if (not isinstance(paths, tuple) or not paths
      or not all(isinstance(p, str) and p.strip() for p in paths)):
    raise SxError("E-TYPE-001", f"defeval {name} :tasks must be a vector of .jsonl paths; "
                  f"found {describe(paths)}", location=tasks_form.loc,
                  fix=':tasks ["data/choice.jsonl" "data/cloze.jsonl"]')
  items = tasks_form.items if isinstance(tasks_form, Vector) else [tasks_form] * len(paths)
  tasks = tuple((os.path.join(base_dir, p), getattr(f, "loc", tasks_form.loc))
                for p, f in zip(paths, items))
  every, batch, limit = (kw.value(top.b, form, kws, k, env) for k in ("every", "batch", "limit"))
  tokenizer = None
  if "tokenizer" in kws:
    tokenizer = kw.static(b, kws["tokenizer"], env, ":tokenizer")
    if not isinstance(tokenizer, str) or not tokenizer:
      raise SxError("E-TYPE-001", f"defeval {name} :tokenizer must be a path; found "
                    f"{describe(tokenizer)}", location=kws["tokenizer"].loc,
                    fix=':tokenizer "cache/tokenizer.json"')
    tokenizer = os.path.join(base_dir, tokenizer)
  return EvalDecl(name, fn.name, tasks, every, batch, limit, tokenizer, form.loc)


@reads("defdiagnostic")
def _diagnostic(top: TopLevel, form: List, env: Env) -> DiagDecl:
  name, kws = str(form.items[1].value), kw.keys(form)
  of = kws.get("of")
  kind = head_symbol(of) if of is not None else None
  if kind not in DIAG_KINDS:
    raise SxError("E-FORM-001", f"defdiagnostic {name} needs :of (KIND ...)",
                  location=(of or form).loc, fix="kinds: (grad-norm [PREFIX]) (param-norm [PREFIX]) "
                  "(update-ratio [PREFIX]) (tap NAME)")
  arg = None
  if len(of.items) > 1:
    a = of.items[1]
    arg = str(a.value) if isinstance(a, Atom) else str(a)
  if kind == "tap" and arg is None:
    raise SxError("E-FORM-001", "(tap NAME) names the tap", location=of.loc,
                  fix="(tap attention/entropy)")
  reduce = str(literal_value(kws["reduce"])) if "reduce" in kws else FORMS[
      "defdiagnostic"].key("reduce").default
  if reduce not in REDUCERS:
    raise SxError("E-FORM-001", f"unknown reducer `{reduce}`", location=kws["reduce"].loc,
                  fix="reducers: " + " ".join(REDUCERS))
  every = kw.value(top.b, form, kws, "every", env)
  return DiagDecl(name, int(every), kind, arg, reduce, form.loc)


@reads("defcurriculum")
def _curriculum(top: TopLevel, form: List, env: Env) -> list[StageDecl]:
  if top.found.get("defcurriculum"):
    raise SxError("E-NAME-002", "defcurriculum is defined twice", location=form.loc,
                  fix="write every stage in one defcurriculum")
  stages, selection = [], top.selection
  for st in form.items[1:]:
    if head_symbol(st) not in FORMS["defcurriculum"].clauses or len(st.items) < 2:
      raise SxError("E-FORM-001", "defcurriculum holds (stage NAME ...) forms", location=st.loc,
                    fix="(stage long :data train-long :when (< eval/loss 2.2) :set (lr 1e-3))")
    name = str(st.items[1])
    _, kws, _ = split_keywords(st, 2, CLAUSES["stage"].keys, "stage")
    data = str(kws["data"]) if "data" in kws else None
    sets = []
    if "set" in kws:
      s = kws["set"]
      pairs = [s] if isinstance(s, List) and s.items and not isinstance(s.items[0], List) else (
          list(s.items) if isinstance(s, (List, Vector)) else [])
      for p in pairs:
        if not (isinstance(p, List) and len(p.items) == 2):
          raise SxError("E-FORM-001", "a stage's :set is (KNOB VALUE)", location=p.loc,
                        fix=":set (lr 1e-3)")
        knob = str(p.items[0])
        if knob not in selection.knobs:
          raise SxError("E-KNOB-001", f"stage {name} sets unknown knob `{knob}`",
                        location=p.items[0].loc, fix=did_you_mean(knob, selection.knobs) or
                        "declare it with defknob")
        sets.append((knob, literal_value(p.items[1]), p.loc))
    if stages and "when" not in kws:
      raise SxError("E-FORM-001", f"stage {name} needs :when", location=st.loc,
                    fix=":when (< eval/loss 2.2)")
    stages.append(StageDecl(name, data, kws.get("when"), sets, st.loc))
  return stages


@reads("defrun")
def _run(top: TopLevel, form: List, env: Env):
  b, selection, loaders = top.b, top.selection, top.of("defloader")
  kws = kw.keys(form, 1)
  for req in FORMS["defrun"].required:
    if req not in kws:
      raise SxError("E-RUN-002", f"defrun has no :{req}", location=form.loc,
                    fix="(defrun :loss loss :data train :steps 100 :optimizer (adamw :lr 1e-3))")
  loss = b.eval(kws["loss"], env)
  if not isinstance(loss, Closure):
    raise SxError("E-RUN-002", ":loss must be a function of the batch", location=kws["loss"].loc,
                  fix="(defn loss [batch] ...) and :loss loss")
  data = kw.loader_name(kws["data"], loaders)
  optimizer = b.eval(kws["optimizer"], env)
  if not isinstance(optimizer, Spec) or optimizer.kind != "optimizer":
    raise SxError("E-RUN-002", ":optimizer must be an optimizer", location=kws["optimizer"].loc,
                  fix=f"{optimizers.names_text()}, e.g. (adamw :lr 1e-3)")
  run = {k: selection.value(k) for k in RUN_KNOBS}
  run["eval-every"] = selection.value("eval-every")
  for k, v in run.items():
    if k in ("precision", "on-nan", "sharding"):
      run[k] = str(v)
  run["trainable"] = tuning.trainable(b, kws.get("trainable"), env)
  run["lora"] = tuning.lora(b, kws.get("lora"), env)
  run["fp8"] = tuning.fp8(b, kws.get("fp8"), env, run["precision"])
  optimizer = mup.settle(optimizer, run, kws, lambda f: b.eval(f, env), form.loc)  # μP
  return loss, data, optimizer, run, form.loc


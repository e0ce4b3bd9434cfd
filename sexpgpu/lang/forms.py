"""The language's forms, declared once: each top-level form, special form and defrun key with
its keywords (kind, range, default, one doc line) and its reader.

`lang/program.py` reads FORMS to check and collect the top level (and runs the readers of the
forms it settles itself: require, defknob, defvariant); `front/experiment.py` evaluates every
other top-level form through `FORMS[head].reader`, registered beside the reader with
`@reads(NAME)`; `tools/langdoc.py` writes docs/language.md from these declarations. A new
top-level form is one `FormDef` with its reader (tests/test_form_table.py declares one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Key:
  """What a form's keyword accepts.

  Attributes:
    doc: one line for docs/language.md (empty: the form's row says it).
    kind: "int" and "number" are read and range-checked from this declaration (lo, hi,
      default: front/keywords.py's `value`); the others say what the form's reader reads:
      "fn" (a named defn), "fns" (a vector of them), "loader" (a defloader's name),
      "optimizer", "strings", "path", "name" (a symbol read as written), "bool",
      "patterns" (globs over parameter paths), "vector", "form" (read by its reader) or
      "any"; "knob" is a run knob (its default, choices and minimum in lang/select.py's
      RUN_KNOBS, RUN_CHOICES and RUN_MIN, since `--set` reads them too).
    default: the value when the keyword is absent (None: absent).
    lo, hi: an int's or number's range, both ends included (None: unbounded).
    required: the form needs it.
  """

  doc: str = ""
  kind: str = "any"
  default: Any = None
  lo: Any = None
  hi: Any = None
  required: bool = False


@dataclasses.dataclass(frozen=True)
class FormDef:
  """One form of the language.

  Attributes:
    name: the head symbol.
    written: how it is written, for the reference.
    doc: one line for the reference.
    keywords: (keyword, Key) in the order the reference lists them and the reader reads them.
    phase: "load" (expanded while files are read: require), "select" (collected into the
      program before knobs are bound: defknob, defvariant) or "evaluate" (read by front's
      evaluator under the selection).
    defines: the namespace its NAME (second item) is defined in, "value" or "variant";
      None for a form without a name.
    binds: an evaluated form whose value is bound to its name (def, defn, defloader, ...).
    std_spaced: a standard library keeps the name in its own namespace (def, defn, defparam).
    count: "one" (exactly one per experiment: E-RUN-001), "at-most-one", or None.
    after: read after every other top-level form (defrun names their declarations).
    example: the form written right, `{name}` for its name: the fix of a missing keyword.
    clauses: the CLAUSES written inside it (defcurriculum's stage).
    keys_doc: for a form whose every keyword has its doc line, the paragraph that opens its
      own section of the reference (defrun's); the others' keywords are listed together.
    reader: what reads it: `(state, form, ...) → value`, its arguments set by its phase
      (program.py's loader and collector, front/experiment.py's evaluator).
  """

  name: str
  written: str
  doc: str
  keywords: tuple[tuple[str, Key], ...] = ()
  phase: str = "evaluate"
  defines: str | None = "value"
  binds: bool = False
  std_spaced: bool = False
  count: str | None = None
  after: bool = False
  example: str = ""
  clauses: tuple[str, ...] = ()
  keys_doc: str = ""
  reader: Callable | None = None

  @property
  def keys(self) -> tuple[str, ...]:
    """The keywords it takes, in order."""
    return tuple(k for k, _ in self.keywords)

  @property
  def required(self) -> tuple[str, ...]:
    """The keywords it needs, in order."""
    return tuple(k for k, key in self.keywords if key.required)

  def key(self, name: str) -> Key:
    """The declaration of keyword `name`."""
    return dict(self.keywords)[name]


def _i(default=None, lo=0, hi=None, required=False, doc=""):
  return Key(doc, "int", default, lo, hi, required)


def _f(default, lo, hi=None, doc=""):
  return Key(doc, "number", default, lo, hi)


def _k(kind, required=False, default=None, doc=""):
  return Key(doc, kind, default, required=required)


# The most microbatches a pass reads: its batch index reaches the step as an int32 (the key
# of its random ops folds it in). A finite split bounds it further (run/passes.check_batches).
MAX_PASS_BATCHES = 2**31 - 1

_RUN_KNOB_DOCS = (
    ("steps", "training steps (required here or by --steps)"),
    ("microbatches", "microbatches summed into one optimizer step (default 1)"),
    ("seed", "the run's seed, 0 or more (default 0)"),
    ("precision", "f32 (default), bf16, or fp8 (bf16, and the products of hidden matrices in "
     "float8 with current scaling: e4m3 forward, e5m2 gradients; GPUs of compute "
     "capability 8.9 or newer)"),
    ("checkpoint-every", "steps between checkpoints; 0 only at the end (default 0)"),
    ("keep", "checkpoints kept (default 3)"),
    ("on-nan", "stop (default: E-NUM-001) or skip a step whose loss is not finite"),
    ("sharding", "replicate (default: a full copy a device), fsdp (parameters, gradients and "
     "optimizer state split over every device of every node; each process writes "
     "its own shards of a checkpoint), hsdp (split within a node, copied across), "
     "a mesh, \"fsdp:2,tensor:2\" (axes data, fsdp, tensor, expert: tensor "
     "parallel from the ops' split rules, sequence parallel between the pairs under "
     "tensor alone, expert parallel for MoE weights), or auto (the plan chooses the "
     "mesh and says why)"),
    ("init-from", "a warm start: parameters by path from a checkpoint folder (or s3://), a "
     ".safetensors file or hf:DIR; optimizer, step and loaders fresh (also "
     "--init-from, SEXPGPU_INIT_FROM; --resume wins)"),
    ("init-partial", "true: parameters that :init-from lacks are initialized as declared "
     "(default false: E-INIT-001)"),
)

_DEFRUN_KEYS = (
    ("loss", _k("fn", True, doc="the loss function of the batch (a float scalar)")),
    ("data", _k("loader", True, doc="the training loader")),
    ("optimizer", _k("optimizer", True, doc="an optimizer, such as (adamw :lr 1e-3)")),
) + tuple((k, Key(doc, "knob")) for k, doc in _RUN_KNOB_DOCS) + (
    # ir/mup.py's KEYS, read by mup.settle
    ("parametrization", _k("name", doc="standard (default: the model as written) or mup: μP's "
                           "init scales, learning-rate factors (Adam's or SGD's) and 1/m on "
                           "the readout's logits, from each parameter's role and m = width / "
                           ":base-width (`check --print params` shows them; a name or a knob, "
                           "not a --set knob)")),
    ("base-width", _k("any", doc="under :parametrization mup, the width (the readout's fan-in) "
                      "at which μP is the model as written: where the learning rate was "
                      "tuned")),
    ("trainable", _k("patterns", doc="a vector of glob patterns over parameter paths, such as "
                     "[\"*/lm_head/*\"]: only those parameters get gradients and optimizer "
                     "state, the others are constants of the step (`check --print params` "
                     "marks each trained or frozen)")),
    ("fp8", _k("patterns", doc="under :precision fp8, a vector of glob patterns over "
               "parameter paths, such as [\"*/mlp/*\"]: only the products whose weight one "
               "names run in float8 (a matmul's, or a two-operand einsum's such as an MoE's "
               "experts; the readout too, when named), instead of every hidden matrix's; a "
               "pattern naming no product's weight is E-RUN-002, one naming a product FP8 "
               "does not take E-PREC-002, :fp8 under another precision E-RUN-002 (the "
               "lowering report lists the products)")),
    ("lora", _k("form", doc="(lora :rank R :alpha A :dropout D :targets [\"*/q_proj/w\" ...]): "
                "a low-rank adapter beside each matmul whose weight a target names, x·W + "
                "(A/R)·(x·a)·b, a with a fan-in init and b zeros, at `PATH.lora_a` and "
                "`PATH.lora_b`, stacked as the weight; only the adapters train unless "
                "`:trainable` names more (default :alpha 2·rank, :dropout 0)")),
)

_TOP = (
    FormDef("require", '(require "lib/blocks.sx") | (require std/nn) | (require "my_ops.py")',
            "load another file once (relative to the requiring file) or a std library file; "
            "a `.py` file's `@sexpgpu.op`s join the language, the file run as the experiment "
            "compiles, with the user's rights: `run` runs those in the experiment's folder or "
            "below, anything else (another folder, `check`, `bundle`, a bundle's run) only "
            "with --trust-python or SEXPGPU_TRUST_PYTHON=1, else E-OP-002 lists each file "
            "and its sha256 before any runs; `check --print requires` lists them and runs "
            "none", phase="load", defines=None),
    FormDef("defknob", '(defknob NAME DEFAULT ["doc"] [:choices [...]] [:min X] [:max Y])',
            "a named setting, overridable by --set and variants; its type is its default's",
            (("choices", _k("vector")), ("min", _k("any")), ("max", _k("any"))),
            phase="select"),
    FormDef("defvariant", "(defvariant NAME (KNOB VALUE) ...)",
            "a named set of knob values (--variant NAME)", phase="select", defines="variant"),
    FormDef("def", "(def NAME EXPR)", "a static value computed from knobs", binds=True,
            std_spaced=True),
    FormDef("defn", '(defn NAME [PARAMS :kw DEFAULT ...] ["doc"] BODY...)',
            "a function; keyword parameters with defaults follow the positional ones; a "
            "string first in a body of more forms is its doc line (std's are the reference's)",
            binds=True, std_spaced=True),
    FormDef("defparam", "(defparam NAME SHAPE :init INIT [:dtype f32])",
            "a parameter shared by name wherever it is used (tied embeddings)",
            (("init", _k("form")), ("dtype", _k("name", default="f32"))), binds=True,
            std_spaced=True),
    FormDef("defloader", "(defloader NAME (KIND ARGS...))", "a data source; the kinds are below",
            binds=True),
    FormDef("defpass", "(defpass NAME :data L :every N :batches B :metrics [F ...])",
            "an evaluation pass: each metric a function of the batch returning a scalar",
            (("data", _k("loader", True)), ("every", _i()), ("batches", _i(1, 1, MAX_PASS_BATCHES)),
             ("metrics", _k("fns", True))),
            example="(defpass {name} :data valid :every 10 :batches 4 :metrics [loss])"),
    FormDef("defsample", '(defsample NAME :fn F :prompts ["text" ...] :every N [:tokens 32] '
            "[:temperature 0] [:top-k 0] [:top-p 1] [:seed 0])",
            "continuations of the prompts while training, as `sample` events and a "
            "progress line; F maps tokens [b t] to logits [b t vocab]; prompts are "
            "text with a text loader's tokenizer (UTF-8 for a bytes loader's model), else "
            "token ids (\"3 1 4\")",
            (("fn", _k("fn", True)), ("prompts", _k("strings", True)), ("tokens", _i(32, 1)),
             ("every", _i(None, 1, required=True)), ("temperature", _f(0.0, 0.0)),
             ("top-k", _i(0)), ("top-p", _f(1.0, 0.0, 1.0)), ("seed", _i(0))),
            example='(defsample {name} :fn lm :prompts ["Once upon"] :tokens 64 :every 500)'),
    FormDef("defeval", '(defeval NAME :fn F :tasks ["T.jsonl" ...] :every N [:batch 8] '
            "[:limit K] [:tokenizer FILE])",
            "downstream tasks scored while training, as `eval` events, a progress line "
            "and the summary's NAME/TASK/acc, acc_norm (multiple choice: {\"context\", "
            "\"choices\", \"gold\"}) or bits_per_byte ({\"text\"}), as "
            "lm-evaluation-harness scores them; requests packed into rows when F takes "
            ":segments and :positions; `sexpgpu eval` scores a checkpoint",
            (("fn", _k("fn", True)), ("tasks", _k("strings", True)),
             ("every", _i(None, 1, required=True)), ("batch", _i(8, 1)), ("limit", _i(None, 1)),
             ("tokenizer", _k("path"))),
            example='(defeval {name} :fn lm :tasks ["data/choice.jsonl"] :every 500)'),
    FormDef("defgenerate", "(defgenerate NAME :fn F :every N [:seed 0])",
            "a program of the trained functions (F of no arguments: loops as scan or "
            "repeat, random draws from the key of :seed) that `sexpgpu generate FILE "
            "--resume CKPT -o OUT` runs, writing .npz and, for images [b h w c] with c "
            "1 or 3, a PNG grid; a function the loss calls keeps its trained "
            "parameters whoever calls it; during training it runs every :every steps "
            "and at the last, its outputs written beside the metrics stream "
            "(generate/NAME/step-N.npz and .png), shown as images in TensorBoard, W&B "
            "and MLflow, with a `generate` event and a progress line",
            (("fn", _k("fn", True)), ("every", _i(None, 1, required=True)), ("seed", _i(0))),
            example="(defgenerate {name} :fn sample-images :every 500 :seed 0)"),
    FormDef("defcurriculum", "(defcurriculum (stage NAME :data L :when STEP :set [(KNOB V) ...]) "
            "...)", "stages that change the data or knobs that keep every parameter's shape",
            defines=None, count="at-most-one", clauses=("stage",)),
    FormDef("defdiagnostic", "(defdiagnostic NAME :of (KIND [ARG]) :every N :reduce R)",
            "a sampled measurement: grad-norm, param-norm, update-ratio or tap",
            (("every", _i(1, 1)), ("of", _k("form")), ("reduce", _k("name", default="mean")))),
    FormDef("defrun", "(defrun :loss F :data L :steps N :optimizer (adamw :lr 1e-3) ...)",
            "the run; exactly one per experiment", _DEFRUN_KEYS, defines=None, count="one",
            after=True, keys_doc="`:loss`, `:data` and `:optimizer`, and the run's own knobs "
            "(each also a `--set` knob; `:steps` may name a defknob):"),
)
# Every top-level form, in the order the reference and the errors list them.
FORMS: dict[str, FormDef] = {f.name: f for f in _TOP}

# The clauses written inside a top-level form, with their keywords: a defcurriculum's stage.
CLAUSES: dict[str, FormDef] = {
    "stage": FormDef("stage", "(stage NAME :data L :when STEP :set [(KNOB V) ...])",
                     "one stage of a defcurriculum",
                     (("data", _k("name")), ("when", _k("form")), ("set", _k("form")))),
}

# The special forms: evaluated by front/build.py's Builder (its `_sf_NAME` method).
SPECIALS: dict[str, FormDef] = {f.name: f for f in (
    FormDef("let", "(let [a E1 [b c] E2] BODY...)", "sequential bindings; a vector destructures"),
    FormDef("if", "(if C A B)", "C is static: the branch not taken is never built"),
    FormDef("fn", "(fn [PARAMS] BODY...)", "an anonymous function (closures allowed, no scope)"),
    FormDef("repeat", "(repeat N F X :remat B :as NAME)",
            "apply F N times with N stacked parameter sets (a scan); :remat recomputes",
            (("remat", _k("bool")), ("as", _k("name")))),
    FormDef("param", "(param NAME SHAPE :init INIT :dtype D :role R)",
            "a trained parameter of the current scope; :role settles a role the graph does "
            "not decide (embedding readout hidden expert conv norm bias other)",
            (("init", _k("form")), ("dtype", _k("name")), ("role", _k("name")))),
    FormDef("tap", "(tap NAME X)", "X itself, recorded for a diagnostic that selects NAME"),
    FormDef("get", "(get BATCH :field) | (get VECTOR I)",
            "a field of a record batch, or an element"),
    FormDef("or", "(or A B ...)", "static or"),
    FormDef("and", "(and A B ...)", "static and"),
    FormDef("not", "(not A)", "static not"),
    FormDef("do", "(do E1 ... EN)", "evaluate in order, the last is the value"),
)}


def reads(name: str) -> Callable[[Callable], Callable]:
  """Registers the decorated function as top-level form `name`'s reader (its declaration
  above, replaced with the reader set).

  Raises:
    AssertionError: no form `name` is declared, or another function reads it already.
  """
  def register(fn: Callable) -> Callable:
    fdef = FORMS.get(name)
    if fdef is None:
      raise AssertionError(f"reads({name!r}): no top-level form {name} is declared in "
                           "sexpgpu/lang/forms.py")
    old = fdef.reader
    if old is not None and (old.__module__, old.__qualname__) != (fn.__module__,
                                                                   fn.__qualname__):
      raise AssertionError(f"form {name} is read by {old.__qualname__} already")
    FORMS[name] = dataclasses.replace(fdef, reader=fn)
    return fn
  return register


def top_names() -> str:
  """`require, defknob, ...`: the top-level forms, for a fix."""
  return ", ".join(FORMS)


def std_spaced(head: str | None) -> bool:
  """Whether a std library keeps the name a top-level `head` form defines in its own
  namespace (def, defn, defparam)."""
  fdef = FORMS.get(head) if head is not None else None
  return fdef is not None and fdef.std_spaced

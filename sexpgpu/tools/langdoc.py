"""`docs/language.md`, generated from the code's tables: forms, loaders, passes, run, std, ops.

The forms, their keywords and defrun's keys are read from their declarations
(lang/forms.py), the ops from theirs (ir/ops.py), the optimizers from front/optimizers.py;
the loaders, builtins and std functions that are not declared with a doc line yet need
their one-line meaning here. `python -m sexpgpu.tools.langdoc` rewrites the page, and
tests/test_docs.py fails when a name has no meaning or the page differs from what this
module generates.
"""

from __future__ import annotations

import os
import sys

from sexpgpu.reader import Atom, Keyword, List, Symbol, Vector, read_text
from sexpgpu.front import optimizers
from sexpgpu.ir import mup
from sexpgpu.lang.forms import CLAUSES, FORMS, SPECIALS

DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "language.md")

LOADER_KEYWORDS = {
    "vocab": "token vocabulary size", "seq": "tokens per record", "batch": "records per microbatch",
    "seed": "the data's own seed", "branching": "successors per Markov state",
    "stream": "an independent stream of the same source (0, 1, ...)",
    "shuffle": "shuffle records (default: true for training, false for passes)",
    "split": "[FROM TO] fractions of the records, such as [0 0.9]; text: of the documents or "
             "of the tokens (:split-by)",
    "split-by": "text: what :split counts, \"tokens\" (cut within documents: one book split "
                "90/10, nanoGPT's way) or \"documents\" (whole ones); the default is tokens for "
                "a cache of one document or a text file, documents for more",
    "digits": "digits per operand", "dtype": "the token file's width, u16 by default",
    "fields": "[x y]: the arrays to read", "pack": "concat (the default) lays documents end to end; docs places whole documents in rows",
    "offsets": "random (the default for training) cuts rows anew each epoch; fixed (passes) does not",
    "stride": "tokens between windows (default seq)", "path": "the file (relative or s3://)",
    "components": "written positionally: (mix (0.7 LOADER) (0.3 LOADER) :batch B)",
    "tokenizer": "chat, pairs: a tokenizer.json (relative to the .sx file); the "
                 "chat_template of the tokenizer_config.json beside it renders conversations",
    "train-on": "chat: the tokens :mask is 1 on, those the assistant wrote (the default) or "
                "all of each conversation's",
}
LOADERS = {
    "markov": "a random Markov chain of tokens (:tokens [B seq], each row a walk from the "
              "chain's stationary law); check prints its entropy rate",
    "copy": "copy a random token sequence: :tokens [B seq] is `x, 1, x, 0…` (L = (seq−1)//2 "
            "symbols x drawn from 2..vocab−1, the separator 1, the answer, padding 0) and "
            ":mask [B seq] (bool) is true exactly on the answer's L positions",
    "reverse": "reverse a random token sequence: :tokens is `x, 1, reversed x, 0…` and :mask "
               "true on the reversed x (the second half), laid out as `copy`'s",
    "sort": "sort a random token sequence: :tokens is `x, 1, sorted x, 0…` and :mask true on "
            "the sorted x, laid out as `copy`'s",
    "add": "add two numbers digit by digit: :tokens is `a, 1 (+), b, 2 (=), c, 0…` with a and b "
           "D digits, c = a + b D+1 digits, most significant first, zero-padded, digit d as "
           "token 3+d (a vocabulary of 13); :mask true on c's digits; :seq defaults to 3D+3",
    "tokens": "windows of a flat token file, nanoGPT's .bin layout (:tokens)",
    "bytes": "windows of a file's bytes (:tokens)",
    "arrays": "rows of the named arrays of an .npz (one field per array)",
    "mix": "a weighted mixture of other loaders",
    "text": "a `sexpgpu tokenize` cache in rows of packed documents (:tokens :segments "
            ":positions); a text file instead is one document of characters, as `tokenize "
            "--chars` makes them",
    "chat": "conversations, one JSON line each ({\"messages\": [{\"role\", \"content\"}, "
            "...]}), rendered with the :tokenizer's chat template as transformers' "
            "apply_chat_template renders it (ChatML when its tokenizer_config.json has none), "
            "packed whole into rows (:tokens :segments :positions) with :mask 1 on the "
            "assistant's tokens (its end-of-turn marker included)",
    "pairs": "preference pairs, one JSON line each ({\"prompt\", \"chosen\", \"rejected\"}: "
             "text with :tokenizer, or token ids): :chosen and :rejected (the prompt, then "
             "the continuation, padded at the end) and :chosen-mask and :rejected-mask, 1 on "
             "the continuation (DPO's sequence-logps and dpo-loss)",
}

# Builtins that are not ops of the IR (they fold statically or make configuration values):
# (written, meaning). An op's own line comes from its declaration (`sexpgpu.ir.ops`).
FUNCTIONS = {
    "split": ("(split X N AXIS)", "N equal parts along an axis, as a vector"),
    "dim": ("(dim X AXIS)", "a static size"), "shape": ("(shape X)", "a static vector"),
    "rank": ("(rank X)", "the static number of axes"),
    "nil?": ("(nil? V)", "static: whether V is nil"),
    "assert": ('(assert COND "message" :fix "how")',
               "nothing when the static COND holds; else E-ARG-001 with the message and fix, "
               "told at the call of the function around it written in the user's files (at "
               "the keyword's value when COND names that keyword), never inside std"),
    "bool?": ("(bool? V)", "static: whether V is true or false"),
    "number?": ("(number? V)", "static: whether V is a finite int or float (not a boolean)"),
    "int?": ("(int? V)", "static: whether V is an integer (not a boolean)"),
    "string?": ("(string? V)", "static: whether V is a string"),
    "fn?": ("(fn? V)", "static: whether V is a function (a defn, fn or primitive)"),
    "zeros": ("(zeros SHAPE :dtype D)", "a tensor of zeros; as :init, zeros"),
    "ones": ("(ones SHAPE :dtype D)", "a tensor of ones; as :init, ones"),
    "normal": ("(normal STD)", "initializer"),
    "truncated-normal": ("(truncated-normal STD)", "initializer"),
    "uniform": ("(uniform LIMIT)", "initializer"),
    "constant": ("(constant V)", "initializer or learning rate"),
    "fan-in": ("(fan-in SCALE)", "initializer: normal, std SCALE/sqrt(fan-in)"),
    "reference": ("(reference X)", "X as the model the run started from computes it (DPO's "
                  "reference): each parameter X reads replaced by a frozen copy of its starting "
                  "value, `reference/PATH` (no gradient, no optimizer state, not in "
                  "checkpoints: a resume reads `:init-from` again, E-REF-001 when it changed), "
                  "without dropout"),
}
# optimizers and schedules: read from their one declaration (front/optimizers.py)
FUNCTIONS.update({n: (f"({n} :lr LR ...)", "optimizer: " + o.doc)
                  for n, o in optimizers.OPTIMIZERS.items()})
FUNCTIONS.update({n: (f"({n} :peak P ...)", "learning-rate schedule: " + sc.doc)
                  for n, sc in optimizers.SCHEDULES.items() if sc.written})


def _written(name: str) -> tuple[str, str]:
  """(written, meaning) of a builtin: an op's from its declaration, else FUNCTIONS'."""
  from sexpgpu.ir.ops import OPS
  if name in OPS:
    return OPS[name].usage(), OPS[name].doc
  return FUNCTIONS[name]


STD = {
    "dense": "x · w (+ b): a linear layer to `out` features; :scale scales the init",
    "rmsnorm": "RMS normalization over the last axis, with a learned scale",
    "layernorm": "layer normalization over the last axis, learned scale and bias",
    "mlp": "dense → act → dense; :hidden defaults to 4 × width",
    "relu2": "ReLU²: relu(x)², an activation (:act relu2)",
    "attention": "multi-head self-attention written with einsum (the sdpa pattern's target);"
                 " the width must divide by :heads; :qk-norm true RMS-normalises each head's "
                 "queries and keys (a learned [dh] scale, q_norm and k_norm: QK-norm), as "
                 "gpt2, llama, block and transformer-lm's :qk-norm do",
    "rope": "rotary position embedding over the last axis (Llama's half-split rotation),"
            " a table of :context positions, or read at :positions",
    "block": "a pre-norm transformer block: attention and mlp with residuals",
    "transformer-lm": "token embedding, :layers blocks (a repeat), norm, logits over :vocab; "
                      ":act the MLP's activation (gelu; relu2, …), as gpt2's and llama's :act",
    "lm-inputs": "tokens without the last position",
    "lm-targets": "tokens without the first position",
    "next-token-loss": "cross-entropy of logits against the next tokens; :segments counts "
                       "targets in their input's document, :mask [b t] only targets whose "
                       "mask is 1 (averaged over those); :z-loss Z adds PaLM's "
                       "Z · mean(logsumexp(logits)²), tapped as lm/z-loss",
    "loss-mask": "[b t-1] the targets next-token-loss counts from :segments and :mask "
                 "(nil when both are nil)",
    "sequence-logps": "[b] each row's summed log-probability of the targets whose mask is 1 "
                      "(:mean true: their mean, for IPO)",
    "dpo-loss": "DPO's sigmoid loss (Rafailov et al.) of [b] policy and reference "
                "sequence log-probabilities, :beta β; :ipo true for IPO's squared loss; taps "
                "rewards/chosen, rewards/rejected, rewards/accuracy, rewards/margin",
    "lm-mask": "[b t-1] 1.0 where a target is in its input's segment and not padding",
    "log-partition-penalty": "mean(logsumexp(logits)²) over the positions next-token-loss "
                             "counts (z-loss's term)",
    "accuracy": "the fraction of argmax predictions equal to the targets",
    "mlp-classifier": "an MLP from features to :classes logits",
    "gpt2-linear": "GPT-2's Conv1D: x @ w + b, w [in out], initialized normal :std, bias 0",
    "gpt2-attention": "GPT-2's causal self-attention (c_attn, c_proj), :segments for packing",
    "gpt2-mlp": "GPT-2's MLP: c_fc, GELU (tanh), c_proj",
    "gpt2-block": "GPT-2's block: ln_1, attention, ln_2, mlp, with residuals",
    "gpt2": "GPT-2 as transformers' GPT2LMHeadModel: tokens [b t] to logits [b t vocab],"
            " learned positions (:context), tied head",
    "llama-linear": "a Linear without bias: x @ w, w [in out], initialized normal 0.02",
    "repeat-heads": "key/value heads [b kv t dh] repeated to [b kv·n t dh] (grouped-query)",
    "llama-attention": "Llama's causal self-attention: q/k/v/o projections, rotary positions,"
                       " :kv-heads for grouped-query attention, :segments for packing",
    "llama-mlp": "Llama's SwiGLU MLP: down(silu(gate(x)) · up(x)), :hidden wide",
    "llama-block": "Llama's block: input_layernorm, attention, post_attention_layernorm, mlp",
    "llama": "Llama as transformers' LlamaForCausalLM: tokens [b t] to logits [b t vocab],"
             " rmsnorm, rotary positions (:context, :rope-theta), SwiGLU (:hidden),"
             " grouped-query attention (:kv-heads), untied head",
    "moe-capacity": "slots an expert's buffer holds: the smallest integer ≥ :factor · :k ·"
                    " tokens / experts",
    "moe-route": "router logits [n e] → [dispatch combine balance z-loss]: top-:k gates"
                 " renormalized, first choices before second ones, at most :capacity a expert",
    "moe-experts": "SwiGLU experts on their buffers [e c d], parameters stacked [e d :hidden]",
    "moe": "a mixture of experts → [y balance z-loss]: router, top-:k routing with a capacity"
           " :factor, dispatch, experts, combine",
    "moe-block": "a pre-norm transformer block whose MLP is a mixture of experts →"
                 " [h balance z-loss]",
    "same-doc": "attention scores kept only where query and key share a packed document"
                " (nil segments: all)",
    "mixtral-moe": "Mixtral's sparse MoE of SwiGLU experts (gate, experts/w1 w3 w2), top-:k"
                   " gates renormalized, no token dropped → [y chosen probs]",
    "mixtral-block": "Mixtral's layer: llama attention and norms, the sparse MoE; with :aux the"
                     " carry holds the router statistics after the width",
    "mixtral-balance": "the router statistics summed over layers → :router-aux × the twin's"
                       " load-balancing loss",
    "mixtral": "Mixtral as transformers' MixtralForCausalLM: tokens [b t] to logits, or"
               " [logits aux] with :aux true; :experts, :top-k, :router-aux, untied head",
    "mamba-mixer": "Mamba's mixer: in_proj, causal depthwise conv1d, the selective scan as a"
                   " linear-recurrence over time, D skip, SiLU gate, out_proj",
    "mamba-block": "Mamba's layer: x + mixer(rmsnorm(x))",
    "mamba": "Mamba as transformers' MambaForCausalLM: tokens [b t] to logits [b t vocab],"
             " :state, :conv, :expand, :dt-rank, tied head, no position table",
}


def _std_functions() -> list[tuple[str, str, list[str], list[tuple[str, str]]]]:
  """(file, name, positional params, [(keyword, default)]) of each std defn, in file order."""
  from sexpgpu.lang.program import STD_DIR
  out = []
  for fname in sorted(os.listdir(STD_DIR)):
    if not fname.endswith(".sx"):
      continue
    with open(os.path.join(STD_DIR, fname), encoding="utf-8") as f:
      forms = read_text(f.read(), f"std/{fname}")
    for form in forms:
      items = form.items if isinstance(form, List) else ()
      if len(items) > 2 and isinstance(items[0], Atom) and items[0].value == Symbol("defn") \
          and isinstance(items[2], Vector):
        pos, kws, params = [], [], list(items[2].items)
        i = 0
        while i < len(params):
          p = params[i]
          if isinstance(p, Atom) and isinstance(p.value, Keyword):
            kws.append((str(p.value), str(params[i + 1]) if i + 1 < len(params) else "?"))
            i += 2
          else:
            pos.append(str(p))
            i += 1
        out.append((f"std/{fname}", str(items[1].value), pos, kws))
  return out


# The rule of names between a user's files and the standard library (front/experiment.py's
# std_namespaces and lang/program.py's Program.namespace_of).
STD_NAMESPACES = (
    "Each std library keeps its names in its own namespace. In your files, every required "
    "library's names are visible unqualified, and your own definitions win: a `(defknob block "
    "64)` or `(defn block ...)` beside `(require std/lm)` is yours, and std/lm's is still "
    "`lm/block` (every name qualified by its library: `nn/dense`, `gpt2/gpt2`). A library's "
    "functions see only their own names and those of the libraries they require, never "
    "yours, so std/lm's `transformer-lm` keeps calling std/lm's `block` whatever you define. "
    "Two definitions of one name in your own files are E-NAME-002. The public functions "
    "check their keywords with `assert` (`:z-loss` ≥ 0, `:qk-norm` and `:remat` true or "
    "false, `:act` a function, `:drop` in [0, 1), `:eps` and `:rope-theta` > 0, an MoE's "
    "`:k`/`:top-k` in 1..`:experts`): a value refused is E-ARG-001 at your call.")


def _check_meanings() -> None:
  """Raises KeyError naming every table entry that has no meaning in this module."""
  from sexpgpu.data import KINDS
  from sexpgpu.front.experiment import LOADER_KINDS
  from sexpgpu.front.prims import BUILTINS
  from sexpgpu.ir.ops import OPS
  loader_kws = {k for cls in KINDS.values() for k in list(cls.arg_table.required)
                + list(cls.arg_table.optional)} | {k for ks in LOADER_KINDS.values() for k in ks}
  wanted = [
      ("function", set(BUILTINS) - set(OPS), FUNCTIONS), ("loader", set(KINDS), LOADERS),
      ("loader keyword", loader_kws, LOADER_KEYWORDS),
      ("std function", {n for _, n, _, _ in _std_functions()}, STD)]
  missing = [f"{what} `{n}`" for what, names, table in wanted for n in sorted(names)
             if n not in table]
  if missing:
    raise KeyError("no meaning in sexpgpu/tools/langdoc.py for " + ", ".join(missing))


def forms_section() -> list[str]:
  """The reference's lines on forms, from their declarations (lang/forms.py): the top-level
  forms, the special forms, each form's keywords, and a section for a form whose keywords
  each have a doc line (defrun).

  Raises:
    KeyError: a form or a documented keyword has no doc line, or a defrun key read
      elsewhere (lang/select.py's RUN_KNOBS, ir/mup.py's KEYS) has no declaration.
  """
  from sexpgpu.lang.select import RUN_KNOBS
  forms = (*FORMS.values(), *SPECIALS.values(), *CLAUSES.values())
  undeclared = [f"defrun keyword `{k}`" for k in (*RUN_KNOBS, *mup.KEYS)
                if k not in FORMS["defrun"].keys]
  undeclared += [f"form `{f.name}`" for f in forms if not (f.doc and f.written)]
  undeclared += [f"{f.name} keyword `{k}`" for f in forms if f.keys_doc
                 for k, key in f.keywords if not key.doc]
  if undeclared:
    raise KeyError("no declaration with a doc line in sexpgpu/lang/forms.py for "
                   + ", ".join(undeclared))
  out = ["## Top-level forms", ""]
  out += _table(("form", "written", "meaning"),
                [(f"`{f.name}`", f"`{f.written}`", f.doc) for f in FORMS.values()])
  out += ["", "## Special forms", ""]
  out += _table(("form", "written", "meaning"),
                [(f"`{f.name}`", f"`{f.written}`", f.doc) for f in SPECIALS.values()])
  out += ["", "Keywords of forms:", ""]
  # a form's keywords here, a clause's after its form's, a form with a keys_doc in its section
  listed = [*SPECIALS.values()] + [c for f in FORMS.values() if not f.keys_doc
                                   for c in (f, *(CLAUSES[k] for k in f.clauses))]
  out += _table(("form", "keywords"), [(f"`{f.name}`", " ".join(f"`:{k}`" for k in f.keys))
                                       for f in listed if f.keywords])
  for f in FORMS.values():
    if f.keys_doc:
      out += ["", f"## {f.name}", "", f.keys_doc, ""]
      out += _table(("keyword", "meaning"), [(f"`:{k}`", key.doc) for k, key in f.keywords])
  return out


def _table(header: tuple[str, ...], rows) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
  return lines


def _choices(keyword: str) -> str:
  """`; one of `concat` `docs`` for a keyword whose value is a name, from the loaders' tables."""
  from sexpgpu.data import KINDS
  names = [n for cls in KINDS.values() for n in cls.arg_table.choices.get(keyword, ())]
  return "; one of " + " ".join(f"`{n}`" for n in dict.fromkeys(names)) if names else ""


def _optimizers(code_optimizers, code_schedules, builtins) -> list[str]:
  """The optimizer section: each optimizer and schedule with its keywords and defaults, and
  what each keyword takes, from front/optimizers.py's tables."""
  from sexpgpu.front.options import range_text
  out = ["Each is an optax chain, declared once in `sexpgpu/front/optimizers.py`: `:clip` "
         "clips the gradients' global norm first; `:weight-decay` reaches the parameters "
         "whose role decays (matrices; norms, biases and embeddings are spared, "
         "`check --print params` shows each), `:decay` and `:no-decay` override it by path.",
         ""]

  def kws(pairs):
    return " ".join(f"`:{k}`" if d is None or d == () else f"`:{k} {_default(d)}`"
                    for k, d in pairs)
  rows = []
  for n, ks in code_optimizers.items():
    o = optimizers.OPTIMIZERS[n]
    rows.append((f"`{n}`", o.doc, kws((k, o.defaults()[k]) for k in ks)))
  out += _table(("optimizer", "meaning", "keywords (default)"), rows) + [""]
  rows = [(f"`{n}`", optimizers.SCHEDULES[n].doc,
           kws((k, dict(optimizers.SCHEDULES[n].keywords)[k]) for k in ks))
          for n, ks in code_schedules.items()
          if optimizers.SCHEDULES[n].written and n in builtins]
  out += _table(("schedule (as `:lr`)", "meaning", "keywords (default)"), rows) + [""]
  rows = []
  for k, spec in optimizers.KEYWORDS.items():
    takes = {"rate": "a number from 0, or a schedule", "bool": "true or false",
             "patterns": "a vector of glob patterns, such as " + spec.example,
             "choice": "one of " + ", ".join(f'"{c}"' for c in spec.choices)}.get(
                 spec.kind) or range_text(spec.kind == "integer", spec.lo, spec.hi,
                                           spec.lo_open, spec.hi_open)
    rows.append((f"`:{k}`", takes, spec.doc))
  return out + _table(("keyword", "takes", "meaning"), rows)


def _default(d) -> str:
  return "true" if d is True else "false" if d is False else f"{d:g}" \
      if isinstance(d, float) else str(d)


def generate() -> str:
  """The text of docs/language.md from the code's tables and the meanings above.

  Raises:
    KeyError: a table names something without a meaning here (add it above).
  """
  from sexpgpu.data import KINDS
  from sexpgpu.front.experiment import LOADER_KINDS
  from sexpgpu.front.prims import BUILTINS, OPTIMIZERS, SCHEDULES
  _check_meanings()
  out = ["# The .sx language: reference", "",
         "Generated by `python -m sexpgpu.tools.langdoc` from the code's tables; "
         "tests/test_docs.py keeps it in step. Errors print a code, the place and a fix.", "",
         "## Reading", "",
         "`; comment`, `#;` skips the next form, `(list)`, `[vector]`, `\"string\\n\"`, "
         "`:keyword`, `symbol` (letters, digits, `-_+*/<>=!?.%`), integers (64-bit, `1_000`), "
         "finite floats (`3.5e-4`), `true false nil`. Files are UTF-8 (a leading byte-order "
         "mark is skipped); forms nest at most 1000 deep. Maps `{...}` do not exist: "
         "keyword arguments are written `:key value`.", ""] + forms_section()
  out += ["", "## Loaders", "", "`(defloader NAME (KIND [\"path\"] :key value ...))`; the "
          "file kinds take the path first, relative to the experiment file or an s3:// URI. "
          "`sexpgpu check FILE --print batch [--loader NAME]` prints a loader's first "
          "microbatch: each field's type and first rows, decoded as text where a tokenizer is "
          "known.", ""]
  rows = []
  for kind, cls in KINDS.items():
    table = cls.arg_table
    allowed = LOADER_KINDS.get(kind, ())
    kws = list(dict.fromkeys([k for k in table.required if k != "path"] + list(allowed)
                             + sorted(table.optional)))
    req = set(table.required)
    rows.append((f"`{kind}`", LOADERS[kind],
                 " ".join(f"`:{k}`" + ("" if k in req else "?") for k in kws)))
  out += _table(("kind", "records", "keywords (? optional)"), rows)
  used = sorted({k for cls in KINDS.values() for k in list(cls.arg_table.required)
                 + list(cls.arg_table.optional)} | {k for ks in LOADER_KINDS.values() for k in ks})
  out += ["", "Loader keywords:", ""]
  out += _table(("keyword", "meaning"), [(f"`:{k}`", LOADER_KEYWORDS[k] + _choices(k))
                                         for k in used])
  out += ["", "## Optimizers and schedules", ""] + _optimizers(OPTIMIZERS, SCHEDULES, BUILTINS)
  out += ["", "## The standard library", "", "`(require std/nn)`, `(require std/lm)`:", "",
          STD_NAMESPACES, ""]
  out += _table(("function", "file", "parameters", "meaning"),
                [(f"`{n}`", f, " ".join(pos + [f":{k} {d}" for k, d in kws]), STD[n])
                 for f, n, pos, kws in _std_functions()])
  out += ["", "## Operations", ""]
  out += ["Tensors are positional; the words in capitals after them are static values written"
          " in that order; `:key value` pairs may come in any order, each with the default"
          " shown.", ""]
  out += _table(("op", "written", "meaning"),
                [(f"`{n}`", f"`{_written(n)[0]}`", _written(n)[1]) for n in sorted(BUILTINS)])
  return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
  """Writes docs/language.md (or checks it with --check: exit 1 when it differs)."""
  argv = sys.argv[1:] if argv is None else argv
  text = generate()
  if "--check" in argv:
    with open(DOC_PATH, encoding="utf-8") as f:
      return 0 if f.read() == text else 1
  os.makedirs(os.path.dirname(DOC_PATH), exist_ok=True)
  with open(DOC_PATH, "w", encoding="utf-8") as f:
    f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())

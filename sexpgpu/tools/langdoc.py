"""`docs/language.md`, generated from the language's declarations: forms, loaders, passes,
run, std, ops.

Each part is read from where it is declared: the forms, their keywords and defrun's keys
from lang/forms.py, the loader kinds and their keywords from their LoaderDefs (data/, beside
each builder; the keywords' meanings in data/spec.py's KEYS), the ops from ir/ops.py, the
other builtins from their `builtin` declarations (front/), the optimizers from
front/optimizers.py, and each std function's meaning from the doc string its body starts
with (std/*.sx). This module holds no table of meanings: it raises KeyError naming anything
declared without one. `python -m sexpgpu.tools.langdoc` rewrites the page, and
tests/test_docs.py fails when the page differs from what this module generates.
"""

from __future__ import annotations

import os
import sys

from sexpgpu.reader import Atom, Keyword, List, Symbol, Vector, read_text
from sexpgpu.front import experiment  # noqa: F401  (its imports register every builtin)
from sexpgpu.front import optimizers
from sexpgpu.ir import mup
from sexpgpu.lang.forms import CLAUSES, FORMS, SPECIALS

DOC_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "language.md")


def _written(name: str) -> tuple[str, str]:
  """(written, meaning) of a builtin: an op's from its declaration (ir/ops.py), another's
  from its own (front/prims.py's `builtin`)."""
  from sexpgpu.front.prims import BUILTINS
  from sexpgpu.ir.ops import OPS
  if name in OPS:
    return OPS[name].usage(), OPS[name].doc
  return BUILTINS[name].usage, BUILTINS[name].doc


def _std_functions() -> list[tuple[str, str, list[str], list[tuple[str, str]], str]]:
  """(file, name, positional params, [(keyword, default)], doc) of each std defn, in file
  order; the doc is the string its body starts with (empty when it has none)."""
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
        out.append((f"std/{fname}", str(items[1].value), pos, kws, _docstring(items[3:])))
  return out


def _docstring(body) -> str:
  """A defn's doc line: a string literal first in a body of more forms (evaluating it does
  nothing), its lines joined with single spaces; "" when there is none."""
  first = body[0] if len(body) > 1 else None
  if isinstance(first, Atom) and isinstance(first.value, str) \
      and not isinstance(first.value, (Symbol, Keyword)):
    return " ".join(first.value.split())
  return ""


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
  """Raises KeyError naming every builtin, loader kind, loader keyword and std function
  whose declaration has no doc line, and every loader keyword two kinds document apart."""
  from sexpgpu.data import KINDS
  from sexpgpu.front.prims import BUILTINS
  from sexpgpu.ir.ops import OPS
  missing = [f"function `{n}` (its `builtin` declaration)" for n in sorted(set(BUILTINS) - set(OPS))
             if not (BUILTINS[n].usage and BUILTINS[n].doc)]
  missing += [f"loader `{n}` (its LoaderDef)" for n, d in KINDS.items() if not d.doc]
  docs = _loader_keyword_docs()
  missing += [f"loader keyword `{k}` (data/spec.py's KEYS)" for k, ds in docs.items()
              if len(ds) != 1 or not ds[0]]
  missing += [f"std function `{n}` (a doc string first in its body, {f})"
              for f, n, _, _, doc in _std_functions() if not doc]
  if missing:
    raise KeyError("no one doc line declared for " + ", ".join(missing))


def _loader_keyword_docs() -> dict[str, list[str]]:
  """Each loader keyword, sorted, and the distinct doc lines the kinds declare it with."""
  from sexpgpu.data import KINDS
  docs: dict[str, list[str]] = {}
  for decl in KINDS.values():
    for k, key in decl.keywords:
      docs.setdefault(k, [])
      if key.doc not in docs[k]:
        docs[k].append(key.doc)
  return dict(sorted(docs.items()))


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
  """`; one of `concat` `docs`` for a keyword whose value is a name, from the loaders'
  declarations."""
  from sexpgpu.data import KINDS
  names = [n for d in KINDS.values() for n in d.choices.get(keyword, ())]
  return "; one of " + " ".join(f"`{n}`" for n in dict.fromkeys(names)) if names else ""


def _optimizers(code_optimizers, code_schedules, builtins) -> list[str]:
  """The optimizer section: each optimizer and schedule with its keywords and defaults, and
  what each keyword takes, from front/optimizers.py's tables."""
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
  rows = [(f"`:{k}`", spec.takes(), spec.doc) for k, spec in optimizers.KEYWORDS.items()]
  return out + _table(("keyword", "takes", "meaning"), rows)


def _default(d) -> str:
  return "true" if d is True else "false" if d is False else f"{d:g}" \
      if isinstance(d, float) else str(d)


def loader_rows() -> list[tuple[str, str, str]]:
  """The reference's row of each loader kind, from its declaration (data/, KINDS): the
  kind, its doc line, and its keywords (the required ones first, `?` on the optional)."""
  from sexpgpu.data import KINDS, keywords
  rows = []
  for kind, decl in KINDS.items():
    kws = list(dict.fromkeys([k for k in decl.required if decl.key(k).kind != "path"]
                             + list(keywords(kind)) + sorted(decl.optional)))
    rows.append((f"`{kind}`", decl.doc,
                 " ".join(f"`:{k}`" + ("" if k in decl.required else "?") for k in kws)))
  return rows


def generate() -> str:
  """The text of docs/language.md from the code's tables and the meanings above.

  Raises:
    KeyError: a table names something without a meaning here (add it above).
  """
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
  out += _table(("kind", "records", "keywords (? optional)"), loader_rows())
  out += ["", "Loader keywords:", ""]
  out += _table(("keyword", "meaning"), [(f"`:{k}`", ds[0] + _choices(k))
                                         for k, ds in _loader_keyword_docs().items()])
  out += ["", "## Optimizers and schedules", ""] + _optimizers(OPTIMIZERS, SCHEDULES, BUILTINS)
  out += ["", "## The standard library", "", "`(require std/nn)`, `(require std/lm)`:", "",
          STD_NAMESPACES, ""]
  out += _table(("function", "file", "parameters", "meaning"),
                [(f"`{n}`", f, " ".join(pos + [f":{k} {d}" for k, d in kws]), doc)
                 for f, n, pos, kws, doc in _std_functions()])
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

"""The language's forms declared once (lang/forms.py): a new top-level form is one
declaration, found by the program's checks, the evaluator's dispatch and the reference, and
no module dispatches on a form's name outside the table."""

import ast
import os

import pytest

from conftest import ROOT
from sexpgpu.errors import SxError
from sexpgpu.front.experiment import evaluate
from sexpgpu.front.keywords import keys, value
from sexpgpu.ir import mup
from sexpgpu.lang.forms import CLAUSES, FORMS, SPECIALS, FormDef, Key, reads
from sexpgpu.lang.program import load_text
from sexpgpu.lang.select import RUN_KNOBS, select
from sexpgpu.tools import langdoc

RUN = """
(defloader train (markov :vocab 8 :seq 5 :batch 2 :seed 1))
(defn loss [batch] (mean (get batch :tokens)))
(defrun :loss loss :data train :steps 2 :optimizer (adamw :lr 1e-3))
"""


def _experiment(text):
  program = load_text(RUN + text, "widgets.sx")
  return evaluate(program, select(program))


def _read_widget(top, form, env):
  kws = keys(form)
  return ("widget", value(top.b, form, kws, "width", env), value(top.b, form, kws, "gain", env))


@pytest.fixture
def widget(monkeypatch):
  """`defwidget` declared in the table, and nowhere else."""
  fdef = FormDef("defwidget", "(defwidget NAME [:width 8] [:gain 1])",
                 "a widget, for the test of a new form",
                 (("width", Key("its width", "int", 8, 1, 64)),
                  ("gain", Key("its gain", "number", 1.0, 0.0, 2.0))),
                 binds=True, reader=_read_widget)
  monkeypatch.setitem(FORMS, "defwidget", fdef)
  return fdef


def test_a_new_top_level_form_is_one_declaration(widget):
  exp = _experiment("(defwidget w :width 16)\n(defwidget v :gain 0.5)\n(def w2 w)")
  assert exp.found["defwidget"] == {"w": ("widget", 16, 1.0), "v": ("widget", 8, 0.5)}
  assert exp.env.vars["w2"] == ("widget", 16, 1.0)  # bound to its name, as declared
  section = "\n".join(langdoc.forms_section())
  assert "| `defwidget` | `(defwidget NAME [:width 8] [:gain 1])` | a widget, for the test " \
         "of a new form |" in section
  assert "| `defwidget` | `:width` `:gain` |" in section


@pytest.mark.parametrize("text,code,message,fix", [
    ("(defwidget w :depth 3)", "E-FORM-002", "defwidget has no keyword :depth",
     "known keywords: :width :gain"),
    ("(defwidget w :width 0)", "E-TYPE-001", ":width must be an integer ≥ 1; found", ":width"),
    ("(defwidget w :gain 3.0)", "E-TYPE-001", ":gain must be a number in 0.0..2.0", ":gain 1.0"),
    ("(defwidget w)\n(defwidget w)", "E-NAME-002", "`w` is defined twice", None),
    ("(defwidget)", "E-FORM-001", "defwidget needs a name", "(defwidget NAME ...)"),
])
def test_a_new_forms_keywords_are_checked_as_declared(widget, text, code, message, fix):
  with pytest.raises(SxError) as e:
    _experiment(text)
  assert (e.value.code, e.value.location.file) == (code, "widgets.sx")
  assert message in e.value.message
  assert fix is None or fix in e.value.fix


def test_an_undeclared_form_is_refused_with_the_table_listed():
  with pytest.raises(SxError) as e:
    _experiment("(defwidget w)")
  assert e.value.code == "E-FORM-001"
  assert e.value.fix == "top-level forms are " + ", ".join(FORMS)
  assert e.value.fix.startswith("top-level forms are require, defknob, defvariant, def, defn")


def test_a_reader_needs_its_declaration_and_is_its_forms_only(monkeypatch):
  with pytest.raises(AssertionError, match="no top-level form defgadget is declared"):
    reads("defgadget")(_read_widget)
  monkeypatch.setitem(FORMS, "defpass", FORMS["defpass"])  # restored if it were replaced
  with pytest.raises(AssertionError, match="form defpass is read by _pass already"):
    reads("defpass")(_read_widget)


def test_every_form_has_its_reader_and_every_run_key_its_declaration():
  assert [n for n, f in FORMS.items() if f.reader is None] == []
  assert set(RUN_KNOBS) | set(mup.KEYS) <= set(FORMS["defrun"].keys)
  assert FORMS["defrun"].required == ("loss", "data", "optimizer")
  assert all(f.doc and f.written for f in (*FORMS.values(), *SPECIALS.values(),
                                           *CLAUSES.values()))


def test_every_special_form_is_declared_and_evaluated():
  from sexpgpu.front.build import SPECIAL_FORMS, Builder
  evaluated = {n[len("_sf_"):] for n in vars(Builder) if n.startswith("_sf_")}
  assert set(SPECIAL_FORMS) == set(SPECIALS) == evaluated


def test_a_run_knob_without_a_declaration_fails_the_reference(monkeypatch):
  monkeypatch.setitem(RUN_KNOBS, "frobnicate-every", 0)
  with pytest.raises(KeyError, match="defrun keyword `frobnicate-every`"):
    langdoc.forms_section()


# ---- no dispatch on a form's name outside the table ---------------------------------------

# Reads of the program that are not its evaluation: blame finds the std defn around an error.
QUERIES = {("sexpgpu/lang/blame.py", "defn")}


def form_dispatches(source: str, path: str) -> list[tuple[str, int, str]]:
  """(path, line, name) of each comparison of a form's head (`head_symbol(...)`, `head`)
  with a top-level form's or clause's name, and each dict literal keyed by two or more
  such names (a dispatch table kept apart from lang/forms.py)."""
  names = set(FORMS) | set(CLAUSES)
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      sides = [node.left, *node.comparators]
      on_head = any((isinstance(s, ast.Call) and getattr(s.func, "id", getattr(s.func, "attr", ""))
                     == "head_symbol") or (isinstance(s, ast.Name) and s.id == "head")
                    for s in sides)
      consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else getattr(
          s, "elts", []))]
      found += [(path, node.lineno, c.value) for c in consts if on_head
                and isinstance(c, ast.Constant) and c.value in names]
    elif isinstance(node, ast.Dict):
      keyed = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
      if len(keyed) >= 2:
        found += [(path, node.lineno, k) for k in keyed]
  return sorted(found)


def test_the_dispatch_check_finds_an_if_chain():
  chain = 'def f(form):\n  head = head_symbol(form)\n  if head == "defpass":\n    pass\n' \
          '  elif head_symbol(form) in ("defeval", "defsample"):\n    pass\n' \
          'READERS = {"defpass": 1, "defeval": 2}\n'
  assert [(line, n) for _, line, n in form_dispatches(chain, "x.py")] == [
      (3, "defpass"), (5, "defeval"), (5, "defsample"), (7, "defeval"), (7, "defpass")]


def test_no_form_is_dispatched_outside_the_table():
  found = []
  for dirpath, _, files in os.walk(os.path.join(ROOT, "sexpgpu")):
    for f in sorted(files):
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
      if f.endswith(".py") and rel != "sexpgpu/lang/forms.py":
        with open(path, encoding="utf-8") as fh:
          found += [d for d in form_dispatches(fh.read(), rel) if (d[0], d[2]) not in QUERIES]
  assert found == [], "dispatch through lang/forms.py's FORMS instead: " + repr(found)

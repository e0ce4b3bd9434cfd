"""Loader kinds declared once (data/spec.py's LoaderDef, beside each builder): a new kind is
one declaration, found by `defloader`, bind_args' keyword checks and the reference; no loader
reads a keyword past its declaration."""

import ast
import os

import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.data import KINDS, LoaderSpec, base, keywords, make_loader
from sexpgpu.data.spec import KEYS, Key, LoaderDef, bind_args, key
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_source
from sexpgpu.tools import langdoc


class RampLoader(base.Loader):
  """`(ramp :seq N :batch B [:start 0] [:stream K])`: row r of batch i is start + i·B + r,
  then counting up by one, modulo 7."""

  kind = "ramp"

  def __init__(self, spec, args, ctx):
    super().__init__()
    self.spec, self.batch_size, self.seq = spec, args["batch"], args["seq"]
    self.start = args["stream"]
    self.fields = {"tokens": ((self.batch_size, self.seq), np.dtype(np.int32))}

  def batch(self, i):
    """The i-th microbatch: each row counts up from its record's index."""
    rows = self.start + i * self.batch_size + np.arange(self.batch_size)[:, None]
    return {"tokens": ((rows + np.arange(self.seq)) % 7).astype(np.int32)}


RAMP = LoaderDef("ramp", "a ramp of token ids, for the test of a new loader kind",
                 (key("seq", required=True, hi=64), key("batch", required=True), key("stream")),
                 RampLoader)

RUN = """
(defloader train {loader})
(defn loss [batch] (mean (* (param w [5] :init ones) (cast (get batch :tokens) f32))))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 1e-3))
"""


@pytest.fixture
def ramp(monkeypatch):
  """`ramp` declared in the kinds' table, and nowhere else."""
  monkeypatch.setitem(KINDS, "ramp", RAMP)
  return RAMP


def test_a_new_loader_kind_is_one_declaration(ramp):
  c = compile_source(RUN.format(loader="(ramp :seq 5 :batch 2 :stream 1)"), "ramp.sx")
  assert c.fields["train"] == {"tokens": ("i32", (2, 5))}
  assert c.loaders["train"].batch(1)["tokens"].tolist() == [[3, 4, 5, 6, 0], [4, 5, 6, 0, 1]]
  page = langdoc.generate()
  assert "| `ramp` | a ramp of token ids, for the test of a new loader kind | `:seq` `:batch` " \
         "`:stream`? |" in page
  assert keywords("ramp") == ("seq", "batch", "stream")


@pytest.mark.parametrize("loader,code,message,fix", [
    ("(ramp :seq 5 :batch 2 :width 3)", "E-FORM-002", "loader kind ramp has no keyword :width",
     "known keywords: :seq :batch :stream"),
    ("(ramp :seq 65 :batch 2)", "E-FORM-001", "`:seq` is 65, more than the 64 it may be",
     "write :seq with an integer from 1 to 64"),
    ("(ramp :seq 5 :batch 2 :stream -1)", "E-FORM-001",
     "`:stream` is -1, expected an integer >= 0", "write :stream with an integer of at least 0"),
    ("(ramp :seq 5 :batch true)", "E-FORM-001", "`:batch` is True, expected an integer >= 1",
     ":batch"),
])
def test_a_new_kinds_keywords_are_checked_as_declared(ramp, loader, code, message, fix):
  with pytest.raises(SxError) as e:
    compile_source(RUN.format(loader=loader), "ramp.sx")
  assert (e.value.code, e.value.location.file, e.value.location.line) == (code, "ramp.sx", 2)
  assert message in e.value.message and fix in e.value.fix


def test_a_missing_required_keyword_is_told_with_the_usage(ramp):
  with pytest.raises(SxError) as e:
    compile_source(RUN.format(loader="(ramp :seq 5)"), "ramp.sx")
  assert e.value.code == "E-FORM-001" and "`ramp` needs :batch" in e.value.message
  assert e.value.fix == "write (ramp :seq SEQ :batch BATCH [:stream STREAM])"


def test_an_undeclared_kind_is_refused_with_the_table_listed():
  with pytest.raises(SxError) as e:
    compile_source(RUN.format(loader="(ramp :seq 5 :batch 2)"), "ramp.sx")
  assert e.value.code == "E-FORM-001" and "unknown kind `ramp`" in e.value.message
  assert e.value.fix.endswith("kinds: " + " ".join(KINDS))


def test_a_keyword_has_one_meaning():
  with pytest.raises(KeyError):
    key("temperature")  # a keyword new to the loaders is declared in KEYS first
  assert all(k.doc for k in KEYS.values())
  assert {k for d in KINDS.values() for k, _ in d.keywords} == set(KEYS)


def test_a_keyword_declared_with_another_meaning_fails_the_reference(monkeypatch):
  other = LoaderDef("ramp", "a ramp", (("seq", Key("a different meaning", "int", required=True)),
                                       key("batch", required=True)), RampLoader)
  monkeypatch.setitem(KINDS, "ramp", other)
  with pytest.raises(KeyError, match="loader keyword `seq`"):
    langdoc.generate()
  monkeypatch.setitem(KINDS, "ramp", LoaderDef("ramp", "", RAMP.keywords, RampLoader))
  with pytest.raises(KeyError, match="loader `ramp`"):
    langdoc.generate()


# Each kind's keywords at their declared bounds: a value at a bound binds, one past it is
# E-FORM-001 from bind_args, before the loader is built.
REQUIRED = {"vocab": 16, "seq": 9, "batch": 2, "seed": 3, "digits": 2, "path": "x.bin",
            "fields": ["x"], "tokenizer": "tok.json", "components": []}
BOUNDS = [(kind, k) for kind, d in KINDS.items() for k, spec in d.keywords
          if spec.kind == "int"]


@pytest.mark.parametrize("kind,name", BOUNDS)
def test_every_int_keyword_is_bound_by_its_declaration(kind, name):
  decl = KINDS[kind]
  spec = decl.key(name)
  args = {k: REQUIRED[k] for k in decl.required}

  def bind(v):
    return bind_args(LoaderSpec("d", kind, {**args, name: v}), decl)

  assert bind(spec.lo)[name] == spec.lo
  with pytest.raises(SxError) as e:
    bind(spec.lo - 1)
  assert e.value.code == "E-FORM-001" and f"`:{name}` is {spec.lo - 1}" in e.value.message
  top = 2**31 - 1 if spec.hi is None else spec.hi
  assert bind(top)[name] == top
  with pytest.raises(SxError) as e:
    bind(top + 1)
  assert e.value.code == "E-FORM-001" and f"more than the {top}" in e.value.message


def test_bind_args_checks_shuffle_split_and_fields():
  def refused(kind, extra):
    d = KINDS[kind]
    with pytest.raises(SxError) as e:
      bind_args(LoaderSpec("d", kind, {**{k: REQUIRED[k] for k in d.required}, **extra}), d)
    return e.value.code, e.value.message

  assert refused("tokens", {"shuffle": 1}) == (
      "E-FORM-001", "loader `d`: `:shuffle` is 1, expected true or false")
  assert refused("chat", {"split": [0.5, 0.2]})[1].startswith("loader `d`: `:split` is")
  assert refused("arrays", {"fields": []}) == (
      "E-FORM-001", "loader `d`: `:fields` is [], expected a list of names")
  bound = bind_args(LoaderSpec("d", "text", {"path": "c", "seq": 4, "batch": 1,
                                             "split": [0, 0.5]}), KINDS["text"])
  assert (bound["split"], bound["shuffle"], bound["pack"]) == ((0.0, 0.5), None, "concat")


def test_a_synthetic_loader_reads_its_bound_keywords():
  ld = make_loader(LoaderSpec("a", "add", {"digits": 2, "batch": 3}))
  assert (ld.seq, ld.vocab, ld.task_seed, ld.stream) == (9, 13, 0, 0)
  with pytest.raises(SxError) as e:
    make_loader(LoaderSpec("a", "add", {"digits": 2, "batch": 3, "seq": 8}))
  assert "`:seq 8` is too short for 2 digits" in e.value.message


# ---- no loader reads a keyword past its declaration ----------------------------------------

CHECKERS = ("positive_int", "fraction_range")


def keyword_checks(source: str) -> list[tuple[int, str]]:
  """(line, name) of each call of a keyword checker (positive_int, fraction_range)."""
  return sorted((n.lineno, n.func.id) for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id in CHECKERS)


def test_the_keyword_check_finds_a_loader_reading_its_own_range():
  src = "def f(spec, args):\n  v = positive_int(spec, args, 'seq', minimum=3)\n" \
        "  s = fraction_range(spec, args['split'])\n"
  assert keyword_checks(src) == [(2, "positive_int"), (3, "fraction_range")]


def test_no_loader_checks_a_keyword_outside_bind_args():
  folder = os.path.join(ROOT, "sexpgpu", "data")
  found = []
  for f in sorted(os.listdir(folder)):
    if f.endswith(".py") and f != "spec.py":
      with open(os.path.join(folder, f), encoding="utf-8") as fh:
        found += [(f, line, n) for line, n in keyword_checks(fh.read())]
  assert found == [], "declare the range on the keyword's Key instead: " + repr(found)

"""Forms to a program: requires resolved, top-level forms checked and collected."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from sexpgpu.errors import Loc, SxError
from sexpgpu.lang.forms import FORMS, reads, std_spaced, top_names
from sexpgpu.reader import Atom, Form, Keyword, List, Symbol, Vector, read_text
from sexpgpu.reader.read import read_source
from sexpgpu.reader.forms import head_symbol

STD_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "std")


@dataclasses.dataclass
class KnobDecl:
  """A `defknob`: name, default, doc and constraints."""

  name: str
  default: Any
  doc: str
  choices: tuple | None
  min: Any
  max: Any
  loc: Loc | None


@dataclasses.dataclass
class Program:
  """An experiment's forms after `require`, with knobs and variants collected.

  Attributes:
    path: the experiment file (as given) or a string's name.
    base_dir: directory that relative loader files are read from.
    forms: every top-level form except require/defknob/defvariant, in order.
    knobs: `defknob` declarations by name.
    variants: name → list of (knob, value form, loc).
    run: the one `defrun` form.
    sources: display name → text of every file read (for checkpoints, bundles).
    files: display name → absolute path of every file read from disk.
    python: display name → (absolute path, the require's place) of each `.py` file of
      ops written in Python (`(require "my_ops.py")`), in require order. Nothing here runs
      them: the evaluator does, when the command's policy allows (front/pyops.py).
    std: display name (`std/lm.sx`) → library (`lm`) of each standard-library file read.
    std_requires: library → the std libraries it requires itself, in require order.
  """

  path: str
  base_dir: str
  forms: list[Form]
  knobs: dict[str, KnobDecl]
  variants: dict[str, list[tuple[str, Form, Loc]]]
  run: List
  sources: dict[str, str]
  files: dict[str, str]
  python: dict[str, tuple[str, Loc]] = dataclasses.field(default_factory=dict)
  std: dict[str, str] = dataclasses.field(default_factory=dict)
  std_requires: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  def namespace_of(self, form: Form) -> str | None:
    """The standard library (`lm`) whose namespace a top-level `def`, `defn` or `defparam`
    of `form` defines into, or None for the user's own top level.

    Each std library's definitions live in its own namespace: its functions see its own
    names and those of the libraries it requires, never the user's; the user sees every
    loaded library's names unqualified (their own definitions win) and qualified (`lm/block`).
    """
    return _namespace(form, self.std)


def _namespace(form: Form, std: dict[str, str]) -> str | None:
  if not std_spaced(head_symbol(form)):  # the forms declared std_spaced (lang/forms.py)
    return None
  return std.get(form.loc.file)


def form_error(form: Form, message: str, fix: str, code: str = "E-FORM-001") -> SxError:
  return SxError(code, message, location=form.loc, fix=fix)


def load_program(path: str) -> Program:
  """Reads an experiment file and everything it requires.

  Raises:
    SxError: read errors, E-REQ-001/002, E-FORM-001, E-NAME-002, E-RUN-001.
  """
  if os.path.isdir(path):
    raise SxError("E-REQ-001", f"`{path}` is a directory, not an experiment file", where=path,
                  fix="give the path of a .sx file (or a .sxb bundle)")
  if not os.path.isfile(path):
    raise SxError("E-REQ-001", f"experiment file `{path}` not found", where=path,
                  fix="check the path; it is relative to the current directory")
  loader = _Loader()
  forms = loader.load(os.path.abspath(path), path, stack=())
  return _collect(path, os.path.dirname(os.path.abspath(path)), forms, loader)


def load_text(text: str, name: str = "<string>", base_dir: str | None = None) -> Program:
  """Compiles a string as an experiment (its requires resolve from base_dir)."""
  loader = _Loader()
  base = base_dir or os.getcwd()
  forms = loader.load_forms(read_text(text, name), os.path.join(base, name), name, stack=())
  loader.sources[name] = text
  return _collect(name, base, forms, loader)


class _Loader:
  """Resolves `require`s: each file once, cycles refused."""

  def __init__(self):
    self.done: set[str] = set()
    self.sources: dict[str, str] = {}
    self.files: dict[str, str] = {}
    self.python: dict[str, tuple[str, Loc]] = {}
    self.std: dict[str, str] = {}  # display name of a std file → its library (`lm`)
    self.std_requires: dict[str, list[str]] = {}  # library → the std libraries it requires

  def load(self, abspath: str, display: str, stack: tuple) -> list[Form]:
    text = read_source(abspath, display)
    forms = read_text(text, display)
    self.sources[display] = text
    self.files[display] = abspath
    return self.load_forms(forms, abspath, display, stack)

  def load_forms(self, forms: list[Form], abspath: str, display: str, stack: tuple) -> list[Form]:
    self.done.add(abspath)
    stack = stack + ((abspath, display),)
    out: list[Form] = []
    for form in forms:
      head = head_symbol(form)
      if head is None:
        raise form_error(form, f"`{form}` at top level is not a definition",
                         "top-level forms are " + top_names())
      if head not in FORMS:
        raise form_error(form, f"`{head}` is not a top-level form",
                         "top-level forms are " + top_names())
      fdef = FORMS[head]
      if fdef.phase == "load":  # require: the forms of the file it names, in its place
        out.extend(fdef.reader(self, form, abspath, stack))
      else:
        out.append(form)
    return out

  @reads("require")
  def _require(self, form: List, abspath: str, stack: tuple) -> list[Form]:
    if len(form.items) != 2:
      raise form_error(form, "require takes one file", '(require "lib/blocks.sx") or (require std/nn)')
    arg = form.items[1]
    lib = None
    if isinstance(arg, Atom) and isinstance(arg.value, Symbol) and arg.value.startswith("std/"):
      target = os.path.join(STD_DIR, arg.value[4:] + ".sx")
      display = f"{arg.value}.sx"
      lib = str(arg.value)[4:]
    elif isinstance(arg, Atom) and isinstance(arg.value, str) and not isinstance(arg.value, Symbol):
      target = os.path.normpath(os.path.join(os.path.dirname(abspath), arg.value))
      display = os.path.relpath(target) if not os.path.isabs(arg.value) else target
    else:
      raise form_error(form, "require takes a string path or std/NAME",
                       '(require "lib/blocks.sx") or (require std/nn)')
    if not os.path.isfile(target):
      raise SxError("E-REQ-001", f"required file `{arg.value}` not found (looked at {target})",
                    location=arg.loc, fix="paths are relative to the requiring file; "
                    "the standard library is std/nn, std/lm")
    chain = [p for p, _ in stack]
    if target in chain:
      names = [d for _, d in stack[chain.index(target):]] + [display]
      raise SxError("E-REQ-002", "requires form a cycle: " + " → ".join(names),
                    location=form.loc, fix="move the shared definitions into a file both require")
    if lib is not None and os.path.isfile(target):
      requirer = self.std.get(stack[-1][1]) if stack[-1][0].startswith(STD_DIR + os.sep) else None
      if requirer is not None and lib not in self.std_requires.setdefault(requirer, []):
        self.std_requires[requirer].append(lib)
      self.std[display] = lib
      self.std_requires.setdefault(lib, [])
    if target in self.done:
      return []
    if target.endswith(".py"):  # ops written in Python: the front end runs the file
      self.done.add(target)
      self.sources[display] = read_source(target, display)
      self.files[display] = target
      self.python[display] = (target, form.loc)
      return []
    return self.load(target, display, stack)


def _collect(path: str, base_dir: str, forms: list[Form], loader: _Loader) -> Program:
  selected: dict[str, dict] = {}  # form → name → what its reader made (defknob, defvariant)
  rest: list[Form] = []
  runs: list[List] = []
  defined: dict[tuple, Loc] = {}
  for form in forms:
    fdef = FORMS[head_symbol(form)]
    name_form = form.items[1] if len(form.items) > 1 else None
    if fdef.defines is not None:
      if not (isinstance(name_form, Atom) and isinstance(name_form.value, Symbol)):
        raise form_error(form, f"{fdef.name} needs a name", f"({fdef.name} NAME ...)")
      name = str(name_form.value)
      # a std library's names are its own: a user's `block` does not collide with std/lm's
      key = (fdef.defines, _namespace(form, loader.std), name)
      if key in defined:
        raise SxError("E-NAME-002", f"`{name}` is defined twice (first at {defined[key]})",
                      location=name_form.loc)
      defined[key] = name_form.loc
    if fdef.phase == "select":
      selected.setdefault(fdef.name, {})[name] = fdef.reader(form)
      continue
    if fdef.count == "one":
      runs.append(form)
    rest.append(form)
  knobs: dict[str, KnobDecl] = selected.get("defknob", {})
  variants: dict[str, list] = selected.get("defvariant", {})
  if len(runs) != 1:
    where = runs[1].loc if len(runs) > 1 else None
    raise SxError("E-RUN-001", "an experiment needs exactly one defrun; found " + str(len(runs)),
                  location=where, where=None if where else path,
                  fix="(defrun :loss LOSS :data LOADER :steps N ...)")
  return Program(path, base_dir, rest, knobs, variants, runs[0], loader.sources, loader.files,
                 loader.python, loader.std,
                 {lib: tuple(reqs) for lib, reqs in loader.std_requires.items()})


def literal_value(form: Form) -> Any:
  """The value of a literal form (number, string, bool, symbol, vector of those)."""
  if isinstance(form, Atom):
    return form.value
  if isinstance(form, Vector):
    return tuple(literal_value(i) for i in form.items)
  raise form_error(form, f"`{form}` is not a literal value",
                   "write a number, string, true/false or a symbol")


def split_keywords(form: List, start: int, allowed: tuple[str, ...] | None, what: str
                   ) -> tuple[list[Form], dict[str, Form], dict[str, Loc]]:
  """Splits items[start:] into positional forms and `:key value` pairs.

  Raises:
    SxError: E-FORM-001 for a keyword without value, E-FORM-002 for an unknown one.
  """
  pos: list[Form] = []
  kws: dict[str, Form] = {}
  locs: dict[str, Loc] = {}
  items = form.items[start:]
  i = 0
  while i < len(items):
    it = items[i]
    if isinstance(it, Atom) and isinstance(it.value, Keyword):
      key = str(it.value)
      if i + 1 >= len(items):
        raise SxError("E-FORM-001", f"keyword :{key} has no value", location=it.loc,
                      fix=f"write :{key} VALUE")
      if allowed is not None and key not in allowed:
        raise SxError("E-FORM-002", f"{what} has no keyword :{key}", location=it.loc,
                      fix="known keywords: " + " ".join(":" + a for a in allowed))
      if key in kws:  # one value would silently win over the other
        raise SxError("E-FORM-001", f"keyword :{key} is given twice (first at {locs[key]})",
                      location=it.loc, fix=f"keep one :{key}")
      kws[key] = items[i + 1]
      locs[key] = it.loc
      i += 2
    else:
      if kws:
        raise SxError("E-FORM-001", f"positional argument `{it}` after keyword arguments",
                      location=it.loc, fix="put positional arguments before :keywords")
      pos.append(it)
      i += 1
  return pos, kws, locs


@reads("defknob")
def _parse_knob(form: List) -> KnobDecl:
  name = str(form.items[1].value)
  if len(form.items) < 3:
    raise form_error(form, f"defknob {name} needs a default value", f"(defknob {name} DEFAULT)")
  default = literal_value(form.items[2])
  if isinstance(default, tuple) or default is None:
    raise form_error(form.items[2], f"knob {name}'s default must be a number, string, boolean "
                     "or symbol", f"(defknob {name} 0.01)")
  rest = list(form.items[3:])
  doc = ""
  if rest and isinstance(rest[0], Atom) and type(rest[0].value) is str:
    doc = rest.pop(0).value
  fake = List(form.loc, (form.items[0],) + tuple(rest))
  _, kws, _ = split_keywords(fake, 1, FORMS["defknob"].keys, "defknob")
  choices = literal_value(kws["choices"]) if "choices" in kws else None
  lo = literal_value(kws["min"]) if "min" in kws else None
  hi = literal_value(kws["max"]) if "max" in kws else None
  return KnobDecl(name, default, doc, choices, lo, hi, form.loc)


@reads("defvariant")
def _parse_variant(form: List) -> list[tuple[str, Form, Loc]]:
  out = []
  for item in form.items[2:]:
    if not (isinstance(item, List) and len(item.items) == 2 and isinstance(item.items[0], Atom)
            and isinstance(item.items[0].value, Symbol)):
      raise form_error(item, "a variant's settings are (KNOB VALUE) pairs",
                       "(defvariant smoke (layers 2) (width 128))")
    out.append((str(item.items[0].value), item.items[1], item.loc))
  return out


_STD_NAMES: dict[str, list[str]] | None = None  # name → the std libraries that define it


def std_libraries_of(name: str) -> list[str]:
  """The standard libraries (`std/gpt2`, ...) whose top level defines `name` (or, for a
  qualified `lm/block`, std/lm when it defines `block`), sorted.

  For the fix of an unbound name: a name the standard library defines is brought in by a
  `(require std/LIB)`, which a "did you mean" of a nearby spelling would hide.
  """
  global _STD_NAMES  # pylint: disable=global-statement
  if _STD_NAMES is None:
    found: dict[str, list[str]] = {}
    for file in sorted(os.listdir(STD_DIR)):
      if not file.endswith(".sx"):
        continue
      lib = "std/" + file[:-3]
      path = os.path.join(STD_DIR, file)
      for form in read_text(read_source(path, lib + ".sx"), lib + ".sx"):
        head = head_symbol(form)
        if std_spaced(head) and len(form.items) > 1:
          item = form.items[1]
          if isinstance(item, Atom) and isinstance(item.value, Symbol):
            found.setdefault(str(item.value), []).append(lib)
    _STD_NAMES = found
  lib, _, base = name.partition("/")
  if base and "std/" + lib in _STD_NAMES.get(base, []):  # qualified: `lm/block`
    return ["std/" + lib]
  return sorted(set(_STD_NAMES.get(name, [])))

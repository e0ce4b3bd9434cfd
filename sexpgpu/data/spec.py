"""A loader's declaration in a file (LoaderSpec), a loader kind's declaration (LoaderDef: its
typed keywords, checked by bind_args), and error helpers."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sexpgpu.errors import Loc, SxError, did_you_mean
from sexpgpu.paths import redact  # noqa: F401  (data/ imports it from here)


@dataclasses.dataclass(frozen=True)
class LoaderSpec:
  """One `(defloader NAME (KIND ARGS...))`, its arguments already evaluated.

  Attributes:
    name: the defloader name, such as "train".
    kind: "markov", "copy", "reverse", "sort", "add", "tokens", "bytes",
      "arrays" or "mix".
    args: keyword arguments as Python values; file kinds hold the file in
      args["path"], `mix` holds args["components"], a list of
      (weight, LoaderSpec).
    base_dir: the directory of the `.sx` file that declared the loader.
    location: where the defloader form is, for errors.
  """

  name: str
  kind: str
  args: Mapping[str, Any]
  base_dir: str = "."
  location: Loc | None = None


@dataclasses.dataclass(frozen=True)
class Key:
  """What a loader keyword accepts: bind_args checks it from here, before any loader is built.

  Attributes:
    doc: one line for docs/language.md; every kind taking the keyword shares it (KEYS').
    kind: "int" (an integer in lo..hi), "bool" (true or false; a None default leaves the
      choice to the loader's context), "choice" (a name, one of `choices`), "split" ([a b]
      fractions), "names" (a vector of field names), "path" (the file written first), "file"
      (a file named by a string), "components" (a mix's (WEIGHT LOADER) pairs) or "any".
    default: the value when the keyword is absent (required ones have none).
    lo, hi: an int's range, both ends included (hi None: below 2^31).
    required: the kind needs it.
    choices: the names a "choice" keyword takes.
  """

  doc: str
  kind: str = "any"
  default: Any = None
  lo: int = 1
  hi: int | None = None
  required: bool = False
  choices: tuple[str, ...] = ()


# Sizes and counts reach the step as int32: no loader size, nor a microbatch's element
# count, may reach this (XLA aborts the process on some larger extents).
SIZE_LIMIT = 2**31
SEED_LIMIT = 2**63

# The loader keywords, one meaning each; a kind takes its own range and default with key().
KEYS: dict[str, Key] = {
    "vocab": Key("token vocabulary size", "int"),
    "seq": Key("tokens per record", "int"),
    "batch": Key("records per microbatch", "int"),
    "seed": Key("the data's own seed", "int", 0, 0, SEED_LIMIT - 1),
    "branching": Key("successors per Markov state", "int"),
    "stream": Key("an independent stream of the same source (0, 1, ...)", "int", 0, 0),
    "shuffle": Key("shuffle records (default: true for training, false for passes)", "bool"),
    "split": Key("[FROM TO] fractions of the records, such as [0 0.9]; text: of the documents "
                 "or of the tokens (:split-by)", "split", (0, 1)),
    "split-by": Key("text: what :split counts, \"tokens\" (cut within documents: one book "
                    "split 90/10, nanoGPT's way) or \"documents\" (whole ones); the default is "
                    "tokens for a cache of one document or a text file, documents for more",
                    "choice"),
    "digits": Key("digits per operand", "int"),
    "dtype": Key("the token file's width, u16 by default", "choice"),
    "fields": Key("[x y]: the arrays to read", "names"),
    "pack": Key("concat (the default) lays documents end to end; docs places whole documents "
                "in rows", "choice"),
    "offsets": Key("random (the default for training) cuts rows anew each epoch; fixed "
                   "(passes) does not", "choice"),
    "stride": Key("tokens between windows (default seq)", "int"),
    "path": Key("the file (relative or s3://)", "path", required=True),
    "components": Key("written positionally: (mix (0.7 LOADER) (0.3 LOADER) :batch B)",
                      "components", required=True),
    "tokenizer": Key("chat, pairs: a tokenizer.json (relative to the .sx file); the "
                     "chat_template of the tokenizer_config.json beside it renders "
                     "conversations", "file"),
    "train-on": Key("chat: the tokens :mask is 1 on, those the assistant wrote (the default) "
                    "or all of each conversation's", "choice"),
}


def key(name: str, **changes: Any) -> tuple[str, Key]:
  """(name, its KEYS declaration with a kind's own range, default or requirement)."""
  return name, dataclasses.replace(KEYS[name], **changes)


@dataclasses.dataclass(frozen=True)
class LoaderDef:
  """One loader kind of the language, declared beside the class that builds it.

  Attributes:
    name: the kind, as written: `(markov ...)`.
    doc: one line for the reference: the records it makes.
    keywords: (keyword, Key) in the order bind_args checks them, the required ones first
      among themselves as listed; "path" and "components" are written positionally.
    builder: the Loader class, built as `builder(spec, bound args, Context)`.
  """

  name: str
  doc: str
  keywords: tuple[tuple[str, Key], ...]
  builder: Any

  @property
  def required(self) -> tuple[str, ...]:
    """The keywords it needs, in declaration order."""
    return tuple(k for k, d in self.keywords if d.required)

  @property
  def optional(self) -> dict[str, Any]:
    """Each optional keyword and its default."""
    return {k: d.default for k, d in self.keywords if not d.required}

  @property
  def choices(self) -> dict[str, tuple[str, ...]]:
    """The names each "choice" keyword takes."""
    return {k: d.choices for k, d in self.keywords if d.kind == "choice"}

  def known(self) -> list[str]:
    """Every keyword of the kind, required first."""
    return list(self.required) + sorted(self.optional)

  def key(self, name: str) -> Key:
    """The declaration of keyword `name`."""
    return dict(self.keywords)[name]


def bind_args(spec: LoaderSpec, table: LoaderDef) -> dict[str, Any]:
  """Checks a spec's keywords against its kind's declaration and fills defaults.

  Args:
    spec: the loader's declaration.
    table: its kind's declaration.

  Returns:
    The arguments, every optional keyword present.

  Raises:
    SxError: E-FORM-002 for an unknown keyword, E-FORM-001 for a missing one, a name
      that is not one of its keyword's choices, or a value its Key refuses (an integer out
      of its range, a :shuffle that is no boolean, a :split that is no pair of fractions,
      :fields that are no names).
  """
  known = table.known()
  for name in spec.args:
    if name not in known:
      hint = did_you_mean(name, known)
      raise SxError(
          "E-FORM-002",
          f"loader `{spec.name}`: `{spec.kind}` takes no keyword `:{name}`",
          location=spec.location,
          fix=(hint + " " if hint else "") + "known keywords: "
          + " ".join(_show_key(k) for k in known))
  for name in table.required:
    if name not in spec.args:
      raise SxError(
          "E-FORM-001",
          f"loader `{spec.name}`: `{spec.kind}` needs {_show_key(name)}",
          location=spec.location,
          fix=f"write ({spec.kind} {_usage(table)})")
  for name, names in table.choices.items():
    if name in spec.args and str(spec.args[name]) not in names:
      hint = did_you_mean(str(spec.args[name]), list(names))
      raise SxError(
          "E-FORM-001",
          f"loader `{spec.name}`: `:{name}` is {str(spec.args[name])[:60]}, expected one of "
          + ", ".join(names), location=spec.location,
          fix=(hint + " " if hint else "") + f"write :{name} " + f" or :{name} ".join(names))
  args = dict(table.optional)
  args.update(spec.args)
  for name in known:
    _check(spec, args, name, table.key(name))
  return args


def _check(spec: LoaderSpec, args: dict[str, Any], name: str, decl: Key) -> None:
  """Refuses a bound value its declaration does not take (a default of None is absent)."""
  v = args[name]
  if v is None:
    return
  if decl.kind == "int":
    positive_int(spec, args, name, decl.lo, SIZE_LIMIT - 1 if decl.hi is None else decl.hi)
  elif decl.kind == "bool" and not isinstance(v, bool):
    raise form_error(spec, f"`:{name}` is {_shown(v)}, expected true or false",
                     f"write :{name} true or :{name} false")
  elif decl.kind == "split":
    args[name] = fraction_range(spec, v)
  elif decl.kind == "names" and (not isinstance(v, (list, tuple)) or not v
                                 or not all(isinstance(n, str) for n in v)):
    raise form_error(spec, f"`:{name}` is {v!r}, expected a list of names",
                     f"write :{name} [x y]")


def _show_key(key: str) -> str:
  return "a file path" if key == "path" else f":{key}"


def _usage(table: LoaderDef) -> str:
  parts = ['"FILE"' if k == "path" else f":{k} {k.upper()}" for k in table.required]
  parts += [f"[:{k} {k.upper()}]" for k in sorted(table.optional)]
  return " ".join(parts)


def form_error(spec: LoaderSpec, message: str, fix: str) -> SxError:
  """An E-FORM-001 about a loader argument of the wrong type or range."""
  return SxError("E-FORM-001", f"loader `{spec.name}`: {message}",
                 location=spec.location, fix=fix)


def positive_int(spec: LoaderSpec, args: Mapping[str, Any], key: str,
                 minimum: int = 1, maximum: int = SIZE_LIMIT - 1) -> int:
  """Reads an integer argument that must lie in minimum..maximum: every loader size is
  bounded here, before anything is built from it.

  Args:
    spec: the loader's declaration, for the error.
    args: its bound arguments.
    key: the keyword.
    minimum: the least value allowed.
    maximum: the largest value allowed (a size that fits int32 unless told otherwise).

  Returns:
    The value.

  Raises:
    SxError: E-FORM-001 when the value is no integer, too small or too large.
  """
  value = args[key]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise form_error(spec, f"`:{key}` is {_shown(value)}, expected an integer >= {minimum}",
                     f"write :{key} with an integer of at least {minimum}")
  if value > maximum:
    raise form_error(spec, f"`:{key}` is {value}, more than the {maximum} it may be",
                     f"write :{key} with an integer from {minimum} to {maximum}")
  return value


def check_fields(spec: LoaderSpec, fields: Mapping[str, Any]) -> None:
  """Refuses a loader whose microbatch holds a field of SIZE_LIMIT elements or more.

  Raises:
    SxError: E-FORM-001 naming the field and its shape.
  """
  for name, (shape, _) in fields.items():
    count = 1
    for d in shape:
      count *= int(d)
    if count >= SIZE_LIMIT:
      raise form_error(spec, f"field `{name}` of a microbatch has shape "
                       f"[{' '.join(str(d) for d in shape)}], {count} elements: more than the "
                       f"{SIZE_LIMIT - 1} a step can index",
                       "lower :batch or :seq so that batch × seq stays below 2^31")


def _shown(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:60] + "..."


def fraction_range(spec: LoaderSpec, value: Any) -> tuple[float, float]:
  """Reads `:split [a b]`, two fractions with 0 <= a < b <= 1.

  Raises:
    SxError: E-FORM-001 when it is not such a pair.
  """
  ok = (isinstance(value, (list, tuple)) and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        and 0 <= value[0] < value[1] <= 1)
  if not ok:
    raise form_error(spec, f"`:split` is {value!r}, expected [a b] with 0 <= a < b <= 1",
                     "write :split [0 0.9] for the first 90% of the file")
  return float(value[0]), float(value[1])


def load_error(code: str, spec: LoaderSpec, file: str, message: str,
               fix: str) -> SxError:
  """An E-LOAD error naming the loader and its file (credentials removed).

  Args:
    code: "E-LOAD-001" ... "E-LOAD-004".
    spec: the loader's declaration.
    file: the file or URI.
    message: what was found and what was expected.
    fix: how to fix it.

  Returns:
    The error, to raise.
  """
  return SxError(code, f"loader `{spec.name}`: {redact(file)}: {message}",
                 location=spec.location, fix=fix)

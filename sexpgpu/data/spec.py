"""A loader's declaration (LoaderSpec), its argument tables and error helpers."""

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
class ArgTable:
  """The keywords a loader kind takes: the required ones, the defaults, and for a keyword
  whose value is a name (`:pack docs`), the names it takes."""

  required: tuple[str, ...]
  optional: Mapping[str, Any]
  choices: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  def known(self) -> list[str]:
    """Every keyword of the kind, required first."""
    return list(self.required) + sorted(self.optional)


def bind_args(spec: LoaderSpec, table: ArgTable) -> dict[str, Any]:
  """Checks a spec's keywords against its kind's table and fills defaults.

  Args:
    spec: the loader's declaration.
    table: the keywords its kind takes.

  Returns:
    The arguments, every optional keyword present.

  Raises:
    SxError: E-FORM-002 for an unknown keyword, E-FORM-001 for a missing one or a name
      that is not one of its keyword's choices.
  """
  known = table.known()
  for key in spec.args:
    if key not in known:
      hint = did_you_mean(key, known)
      raise SxError(
          "E-FORM-002",
          f"loader `{spec.name}`: `{spec.kind}` takes no keyword `:{key}`",
          location=spec.location,
          fix=(hint + " " if hint else "") + "known keywords: "
          + " ".join(_show_key(k) for k in known))
  for key in table.required:
    if key not in spec.args:
      raise SxError(
          "E-FORM-001",
          f"loader `{spec.name}`: `{spec.kind}` needs {_show_key(key)}",
          location=spec.location,
          fix=f"write ({spec.kind} {_usage(table)})")
  for key, names in table.choices.items():
    if key in spec.args and str(spec.args[key]) not in names:
      hint = did_you_mean(str(spec.args[key]), list(names))
      raise SxError(
          "E-FORM-001",
          f"loader `{spec.name}`: `:{key}` is {str(spec.args[key])[:60]}, expected one of "
          + ", ".join(names), location=spec.location,
          fix=(hint + " " if hint else "") + f"write :{key} " + f" or :{key} ".join(names))
  args = dict(table.optional)
  args.update(spec.args)
  return args


def _show_key(key: str) -> str:
  return "a file path" if key == "path" else f":{key}"


def _usage(table: ArgTable) -> str:
  parts = ['"FILE"' if k == "path" else f":{k} {k.upper()}" for k in table.required]
  parts += [f"[:{k} {k.upper()}]" for k in sorted(table.optional)]
  return " ".join(parts)


def form_error(spec: LoaderSpec, message: str, fix: str) -> SxError:
  """An E-FORM-001 about a loader argument of the wrong type or range."""
  return SxError("E-FORM-001", f"loader `{spec.name}`: {message}",
                 location=spec.location, fix=fix)


# Sizes and counts reach the step as int32: no loader size, nor a microbatch's element
# count, may reach this (XLA aborts the process on some larger extents).
SIZE_LIMIT = 2**31
SEED_LIMIT = 2**63


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

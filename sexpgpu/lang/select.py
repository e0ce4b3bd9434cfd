"""Selection: a variant, `--set` overrides and run overrides bind every knob."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from typing import Any

from sexpgpu.env import get as env_get
from sexpgpu.errors import SxError, did_you_mean, without_credentials
from sexpgpu.lang.mesh import is_mesh, parse_mesh
from sexpgpu.lang.program import KnobDecl, Program, literal_value, split_keywords
from sexpgpu.reader import Atom, Keyword, Symbol
from sexpgpu.reader.read import INT_LIMIT, is_int_literal, parse_int, shown

# The run's own settings: knobs that always exist, with these defaults unless
# defrun writes a literal. None means required.
RUN_KNOBS: dict[str, Any] = {
    "steps": None, "microbatches": 1, "seed": 0, "precision": Symbol("f32"),
    "checkpoint-every": 0, "keep": 3, "on-nan": Symbol("stop"),
    "sharding": Symbol("replicate"),
    # a warm start: a checkpoint, a .safetensors file or hf:DIR
    "init-from": "", "init-partial": False,
}
# Integer knobs other than the seed reach the step as int32 (sizes, counts, steps).
INT32_LIMIT = 2**31
# The largest float32: a float knob reaches the step as one, so a larger value is infinite.
F32_MAX = 3.4028234663852886e38
RUN_CHOICES = {"precision": ("f32", "bf16", "fp8"), "on-nan": ("stop", "skip"),
               "sharding": ("replicate", "fsdp", "hsdp")}
RUN_MIN = {"steps": 0, "microbatches": 1, "checkpoint-every": 0, "keep": 1, "seed": 0}
# Knobs outside the experiment's identity: a longer resume is the same run.
# :sharding is where the state lives, not what is computed: a resume may change it.
# :init-from and :init-partial say where the first parameters came from; a checkpoint holds
# them already, so `sample`, `export` and a resume need not repeat them.
NOT_IN_FINGERPRINT = ("steps", "eval-every", "checkpoint-every", "keep", "sharding", "init-from",
                      "init-partial")


@dataclasses.dataclass(frozen=True)
class Knob:
  """A bound knob: its value and where the value came from."""

  value: Any
  source: str  # file | variant | set | override


@dataclasses.dataclass
class Selection:
  """One experiment's knob values, and the run slug they name."""

  knobs: dict[str, Knob]
  variant: str | None
  sets: list[tuple[str, Any]]
  slug: str

  def value(self, name: str) -> Any:
    return self.knobs[name].value


def a_type(v: Any) -> str:
  """The type of a knob's value with its article: `an integer`, `a float`."""
  name = type_name(v)
  return ("an " if name[0] in "aeiou" else "a ") + name


def type_name(v: Any) -> str:
  if isinstance(v, bool):
    return "boolean"
  if isinstance(v, int):
    return "integer"
  if isinstance(v, float):
    return "float"
  if isinstance(v, Symbol):
    return "symbol"
  return "string"


def parse_as(text: str, like: Any, name: str, where: str) -> Any:
  """Parses a `--set` string as the type of `like`.

  Raises:
    SxError: E-KNOB-002 naming the type.
  """
  def bad():
    return SxError("E-KNOB-002", f"`{text}` is not {a_type(like)} (knob {name})",
                   where=where, fix=f"give {name} {a_type(like)} value, like {format_value(like)}")
  if isinstance(like, bool):
    if text in ("true", "false"):
      return text == "true"
    raise bad()
  if isinstance(like, int):
    if not is_int_literal(text.strip()):
      raise bad()
    value = parse_int(text.strip())
    if value is None:
      raise SxError("E-KNOB-002", f"`{shown(text)}` does not fit in a 64-bit integer (knob "
                    f"{name})", where=shown(where, 80),
                    fix=f"give {name} a value below {INT_LIMIT} in size")
    return value
  if isinstance(like, float):
    try:
      value = float(text.replace("_", ""))
    except ValueError:
      raise bad() from None
    if not math.isfinite(value) or abs(value) > F32_MAX:
      raise SxError("E-KNOB-002", f"`{text}` is not a finite number"
                    + (" in float32" if math.isfinite(value) else "") + f" (knob {name})",
                    where=where, fix=f"give {name} a finite value, like {format_value(like)}")
    return value
  if isinstance(like, Symbol):
    if name == "sharding" and is_mesh(text):  # a mesh, `fsdp:2,tensor:2`
      parse_mesh(text, where=where)
      return Symbol(text)
    if re.fullmatch(r"[A-Za-z_+*/<>=!?.%-][A-Za-z0-9_+*/<>=!?.%-]*", text):
      return Symbol(text)
    raise bad()
  return text


def coerce(value: Any, like: Any, name: str, loc) -> Any:
  """Checks a variant's literal against the knob's type (int widens to float)."""
  if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if name == "sharding" and isinstance(value, str) and is_mesh(value):  # written "tensor:4"
    parse_mesh(value, loc=loc)
    return Symbol(value)
  if type_name(value) != type_name(like):
    raise SxError("E-KNOB-002", f"knob {name} is {a_type(like)}; "
                  f"`{format_value(value)}` is {a_type(value)}", location=loc,
                  fix=f"give {name} {a_type(like)} value, like {format_value(like)}")
  return value


def format_value(v: Any) -> str:
  """A value as written in slugs and `--print knobs`: Python's shortest form."""
  if isinstance(v, bool):
    return "true" if v else "false"
  if v is None:
    return "-"
  return repr(v) if isinstance(v, float) else str(v)


def _check_range(name: str, value: Any, choices, lo, hi, where=None, loc=None) -> None:
  def err(msg, fix):
    return SxError("E-KNOB-003", msg, where=where, location=loc, fix=fix)
  if (isinstance(value, int) and not isinstance(value, bool) and name != "seed"
      and not -INT32_LIMIT <= value < INT32_LIMIT):
    raise err(f"knob {name} = {value} does not fit in a 32-bit integer",
              f"sizes and counts reach the step as int32: keep {name} below {INT32_LIMIT}")
  if choices is not None and value not in choices and not (name == "sharding"
                                                            and is_mesh(value)):
    raise err(f"knob {name} = {format_value(value)} is not one of its choices",
              "choose one of " + ", ".join(format_value(c) for c in choices)
              + (", or a mesh like fsdp:2,tensor:2" if name == "sharding" else ""))
  def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)
  for bound, what in ((lo, ":min"), (hi, ":max")):
    if bound is not None and not (number(bound) and number(value)):
      raise err(f"knob {name}: {what} {format_value(bound)} does not compare with "
                f"{format_value(value)}", ":min and :max bound numeric knobs with numbers")
  if lo is not None and value < lo:
    raise err(f"knob {name} = {format_value(value)} is below its minimum {format_value(lo)}",
              f"use a value ≥ {format_value(lo)}")
  if hi is not None and value > hi:
    raise err(f"knob {name} = {format_value(value)} is above its maximum {format_value(hi)}",
              f"use a value ≤ {format_value(hi)}")


def run_knob_decls(program: Program) -> dict[str, KnobDecl]:
  """The run's own knobs, their defaults taken from defrun's literals."""
  _, kws, _ = split_keywords(program.run, 1, None, "defrun")
  decls = {}
  for name, default in RUN_KNOBS.items():
    form = kws.get(name)
    if form is not None and isinstance(form, Atom) and not isinstance(form.value, Keyword):
      value = form.value
      if isinstance(value, Symbol) and name not in RUN_CHOICES:
        # `:steps steps` names a user knob: resolved against it in select().
        value = ("ref", str(value))
    else:
      value = default
    decls[name] = KnobDecl(name, value, "", RUN_CHOICES.get(name), RUN_MIN.get(name), None,
                           form.loc if form is not None else program.run.loc)
  return decls


def select(program: Program, variant: str | None = None, sets: list[tuple[str, str]] = (),
           overrides: dict[str, int] | None = None, slug_stem: str | None = None) -> Selection:
  """Binds every knob of `program`.

  Args:
    variant: the `--variant` name, or None.
    sets: `--set` pairs (name, text), in command-line order; the last wins.
    overrides: `--steps`/`--eval-every` values (source "override").
    slug_stem: SEXPGPU_RUN_SLUG, replacing the file's stem.

  Raises:
    SxError: E-VARIANT-001, E-KNOB-001/002/003, E-RUN-002 (no steps).
  """
  decls = dict(program.knobs)
  for name, d in run_knob_decls(program).items():
    if name not in decls:
      decls[name] = d
  knobs: dict[str, Knob] = {}
  for name, d in decls.items():
    value = d.default
    if isinstance(value, tuple) and value[:1] == ("ref",):
      ref = value[1]
      if ref not in program.knobs:
        raise SxError("E-NAME-001", f"`{ref}` is not a knob", location=d.loc,
                      fix=did_you_mean(ref, program.knobs) or "use a number or a defknob name")
      value = program.knobs[ref].default
    if name in RUN_KNOBS and name not in program.knobs and value is not None:
      # a defrun literal (or the knob it names) must fit the run setting's type
      value = coerce(value, RUN_KNOBS[name] if RUN_KNOBS[name] is not None else 0, name, d.loc)
    if value is not None:
      _check_range(name, value, d.choices, d.min, d.max, loc=d.loc)
    knobs[name] = Knob(value, "file")
  if variant is not None:
    if variant not in program.variants:
      known = sorted(program.variants)
      raise SxError("E-VARIANT-001", f"no variant `{variant}`", where="--variant",
                    fix=(did_you_mean(variant, known) + " " if did_you_mean(variant, known) else "")
                    + ("defined variants: " + ", ".join(known) if known else
                       "this experiment defines no variant"))
    for name, form, loc in program.variants[variant]:
      if name not in decls:
        raise SxError("E-KNOB-001", f"variant {variant} sets unknown knob `{name}`",
                      location=loc, fix=did_you_mean(name, decls) or
                      "knobs: " + ", ".join(sorted(decls)))
      like = knobs[name].value
      value = coerce(literal_value(form), like, name, form.loc)
      _check_range(name, value, decls[name].choices, decls[name].min, decls[name].max, loc=form.loc)
      knobs[name] = Knob(value, "variant")
  set_values: dict[str, Any] = {}
  for name, text in sets:
    where = f"--set {name}={text}"
    if name not in decls:
      raise SxError("E-KNOB-001", f"unknown knob `{name}`", where=where,
                    fix=did_you_mean(name, decls) or "knobs: " + ", ".join(sorted(decls)))
    like = knobs[name].value
    value = parse_as(text, like, name, where)
    _check_range(name, value, decls[name].choices, decls[name].min, decls[name].max, where=where)
    knobs[name] = Knob(value, "set")
    set_values[name] = value
  if "eval-every" not in knobs:
    knobs["eval-every"] = Knob(None, "file")
  for name, value in (overrides or {}).items():
    if value is not None:
      _check_range(name, value, None, 0, None, where=f"--{name} {value}")
      knobs[name] = Knob(value, "override")
  if knobs["steps"].value is None:
    raise SxError("E-RUN-002", "defrun has no :steps", location=program.run.loc,
                  fix="add :steps N to defrun, or pass --steps N")
  ordered = sorted(set_values.items())
  slug = make_slug(slug_stem or _stem(program.path), variant, ordered)
  return Selection(knobs, variant, ordered, slug)


# What a run slug may hold: every other character is written `_`.
_NOT_SLUG = re.compile(r"[^A-Za-z0-9._=-]")
# The longest slug: a folder name (255 bytes on most file systems) with room for the
# `.status.json`, `.jsonl` and `.lock` names made from it.
MAX_SLUG = 200
_SLUG_FIX = ("set SEXPGPU_RUN_SLUG to one folder name of letters, digits, `.`, `_`, `=` and `-` "
             f"(at most {MAX_SLUG} characters, not `.` or `..`), or unset it to use the "
             "file's name")


def slug_component(text: str) -> str:
  """`text` as one safe path component: the one place a run slug is cleaned.

  Characters outside [A-Za-z0-9._=-] become `_` (so no `/`, NUL or non-UTF-8 byte is
  left); a name of dots only (`.`, `..`) or an empty one gets a `_` in front, so it never
  names its own folder or the parent; a name past MAX_SLUG characters keeps its head and
  a hash of the whole.
  """
  out = _NOT_SLUG.sub("_", text)
  if out.strip(".") == "":
    out = "_" + out
  if len(out) > MAX_SLUG:
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    out = out[:MAX_SLUG - 13] + "-" + digest
  return out


def is_slug_component(text: object) -> bool:
  """Whether `text` is already one safe path component (slug_component keeps it as is)."""
  return isinstance(text, str) and slug_component(text) == text


def run_slug_stem(environ=None) -> str | None:
  """SEXPGPU_RUN_SLUG, checked: the stem every slug of this process starts with, or None.

  Spaces and other characters outside the slug's set are written `_` later (as in every
  slug), but a value that names a path rather than one folder is refused: one with `/`,
  `\\` or NUL, a name of dots only (`..` would put the run's folder above its location),
  or one longer than MAX_SLUG.

  Args:
    environ: the environment to read (os.environ when None).

  Raises:
    SxError: E-ENV-001 naming SEXPGPU_RUN_SLUG, with the fix.
  """
  value = env_get("SEXPGPU_RUN_SLUG", environ)
  if value is None:
    return None
  shown = ascii(value) if len(value) <= 60 else ascii(value[:60]) + "..."
  if any(c in value for c in "/\\\0") or value.strip(".") == "":
    raise SxError("E-ENV-001", f"SEXPGPU_RUN_SLUG={shown} is not one folder name: the "
                  "run's files would land outside their location", where="SEXPGPU_RUN_SLUG",
                  fix=_SLUG_FIX)
  if len(value) > MAX_SLUG:
    raise SxError("E-ENV-001", f"SEXPGPU_RUN_SLUG has {len(value)} characters, more than "
                  f"the {MAX_SLUG} a run slug may have", where="SEXPGPU_RUN_SLUG",
                  fix=_SLUG_FIX)
  return value


def _stem(path: str) -> str:
  base = os.path.basename(path)
  for ext in (".sxb", ".sx"):
    if base.endswith(ext):
      return base[: -len(ext)]
  return base


def make_slug(stem: str, variant: str | None, sets: list[tuple[str, Any]]) -> str:
  """stem[-variant][-k=v ...] as one safe folder name (paths.slug_component).

  A value's credentials never enter it: a URI's `user:secret@` and its credential query
  parameters are removed (errors.without_credentials), so the configuration line, the
  status, the metrics and checkpoint folder names carry none, and a run whose credentials
  change keeps its slug. The run itself still gets the value as given.
  """
  parts = [stem] + ([variant] if variant else []) + [
      f"{k}={without_credentials(format_value(v))}" for k, v in sets]
  return slug_component("-".join(parts))

"""How an op is declared: its signature, its doc and its reference rule, once.

Every other interpretation of an op (per-platform lowerings in `sexpgpu.lower`,
FLOPs, the decode rule, the front end's reading of a call, the reference page)
is a table of its own module, keyed by the op's name; this module holds only
what the op *is*. Shapes and dtypes come from the reference rule evaluated
abstractly (`ir.shapes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import jax.numpy as jnp
import numpy as np

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "i32": jnp.int32,
          "u32": jnp.uint32, "bool": jnp.bool_}
DTYPE_NAMES = {np.dtype(v).name: k for k, v in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
  """The IR's short name of a numpy/jax dtype ("f32", "i32", ...)."""
  return DTYPE_NAMES[np.dtype(dtype).name]


@dataclasses.dataclass
class LowerCtx:
  """What a lowering rule may consult besides its inputs and attributes.

  Attributes:
    precision: "f32", or "bf16" to compute products and attention in bf16, or "fp8": bf16,
      and the products `fp8` names in float8 (lower/fp8.py).
    rng: the PRNG key of this microbatch (None in passes and shape rules).
    training: False in passes (dropout is off) and in shape rules.
    notes: what rules chose where a choice was made (for the lowering report).
    platform: the device the step runs on ("cpu", "gpu"), where a rule lowers
      differently for it; None when unknown (shape rules, passes).
    fp8: the uids of the `matmul` nodes lowered in FP8 (set by the evaluator under "fp8").
    fp8_only: globs over parameter paths naming the matrices whose products run in FP8
      (empty: the hidden matrices).
  """

  precision: str = "f32"
  rng: Any = None
  training: bool = False
  notes: list = dataclasses.field(default_factory=list)
  platform: str | None = None
  fp8: frozenset = frozenset()
  fp8_only: tuple = ()

  def compute_dtype(self, x):
    wide = self.precision in ("bf16", "fp8")  # fp8 leaves all but its products in bf16
    return jnp.bfloat16 if wide and x.dtype == jnp.float32 else x.dtype


class _Required:
  """The default of an attribute that every call must give."""

  def __repr__(self) -> str:
    return "REQUIRED"


REQUIRED = _Required()

# The static values an attribute may hold, as the front end reads them from a call.
ATTR_TYPES = {
    "int": "a static integer",
    "float": "a static number",
    "bool": "true or false",
    "str": "a string",
    "dtype": "a dtype (f32 bf16 f16 i32 u32 bool)",
    "axis": "an axis of the first tensor (negative counts from the end)",
    "axes": "an axis or a vector of axes, or nil for all",
    "shape": "a vector of static sizes",
    "ints": "a static integer, or a vector of them (one a spatial axis)",
    "padding": '"valid", "same", "causal" (the first spatial axis), or [[lo hi] ...] a spatial axis',
    "pairs": "[[lo hi] ...], one pair an axis",
    "spec": "an einsum spec string",
}


@dataclasses.dataclass(frozen=True)
class Attr:
  """A static attribute of an op.

  Attributes:
    name: its name in the IR, and its keyword in the language (`:name`).
    type: one of ATTR_TYPES.
    default: its value when a call leaves it out; REQUIRED when a call must give it;
      None when leaving it out means "absent".
    doc: what it means, for the reference.
    positional: the language writes it after the tensors, unnamed (`(sum X AXES)`).
    internal: set by the compiler (a rewrite, a site counter), never written by a user.
  """

  name: str
  type: str
  default: Any = REQUIRED
  doc: str = ""
  positional: bool = False
  internal: bool = False

  def __post_init__(self):
    if self.type not in ATTR_TYPES:
      raise ValueError(f"attribute {self.name}: no type {self.type}")


@dataclasses.dataclass(frozen=True)
class OpDef:
  """One primitive, declared once.

  Attributes:
    name: the op's name, in the IR and in the language.
    lower: the reference rule `rule(ctx, *inputs, **attrs)`, plain JAX.
    inputs: the tensor inputs' names; `name?` is optional, `name*` takes any number
      (at least one), `:name` is an optional tensor the language passes by keyword.
    attrs: the static attributes.
    doc: one line for the reference and `check`.
    written: how a call is written, when the language's form is not the plain
      `(op TENSORS... :attr value ...)` (for ops whose front end reads more).
    random: draws from the run's key (a site number attribute keeps draws apart).
    source: the Python file of an op a user wrote (`@sexpgpu.op`), None for the table's own.
    kind: one of KINDS; every interpretation's table takes its default rule for the op
      from it, and registers only the ops that are its exceptions.
  """

  name: str
  lower: Callable[..., Any]
  inputs: tuple[str, ...]
  attrs: tuple[Attr, ...]
  doc: str
  written: str | None = None
  random: bool = False
  source: str | None = None
  kind: str = "opaque"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"op {self.name}: no kind {self.kind!r}; the kinds: {' '.join(KINDS)}")

  @property
  def pointwise(self) -> bool:
    """Each output element depends only on the same element of the inputs."""
    return self.kind == "pointwise"

  @property
  def min_inputs(self) -> int:
    return sum(1 for i in self.inputs if not i.endswith("?") and not i.startswith(":"))

  @property
  def max_inputs(self) -> int | None:
    return None if any(i.endswith("*") for i in self.inputs) else len(self.inputs)

  @property
  def keywords(self) -> tuple[str, ...]:
    """The keywords a call may write: keyword tensors and non-positional attributes."""
    return (tuple(i[1:] for i in self.inputs if i.startswith(":"))
            + tuple(a.name for a in self.attrs if not a.positional and not a.internal))

  def attr(self, name: str) -> Attr:
    return next(a for a in self.attrs if a.name == name)

  def usage(self) -> str:
    """The call as the reference writes it, `(cumsum X :axis -1 :reverse false)`."""
    if self.written:
      return self.written
    parts = [self.name]
    for i in self.inputs:
      if not i.startswith(":"):
        parts.append(i.rstrip("?*").upper() + (" ..." if i.endswith("*") else ""))
    parts += [a.name.upper() for a in self.attrs if a.positional and not a.internal]
    parts += [f":{i[1:]} {i[1:].upper()}" for i in self.inputs if i.startswith(":")]
    for a in self.attrs:
      if a.positional or a.internal:
        continue
      parts.append(f":{a.name} " + (a.name.upper() if a.default in (REQUIRED, None)
                                    else _written(a.default)))
    return "(" + " ".join(parts) + ")"


def _written(v: Any) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, str):
    return f'"{v}"'
  if isinstance(v, tuple):
    return "[" + " ".join(_written(x) for x in v) + "]"
  return str(v)


OPS: dict[str, OpDef] = {}

# What an op is, as far as the interpretations care: each table (FLOPs, the backward's cost
# and what it saves, decoding, splits, lowering) gives a kind its default rule.
KINDS = {
    "pointwise": "each output element depends only on the same element of its inputs",
    "reduction": "reduces its input over axes",
    "along": "works along one axis, the other axes' positions apart (a softmax, a running "
             "total, a sort)",
    "movement": "moves, copies or selects values and computes none (shapes, gathers, triangles)",
    "product": "sums products of its inputs (matmul, einsum, attention, convolution)",
    "loss": "reduces logits and targets to one number",
    "mask": "fills positions of scores by where they lie",
    "window": "reduces windows of the spatial axes (pooling)",
    "function": "applies a function of the IR along an axis (a scan)",
    "random": "draws values from the run's key, from no tensor input",
    "constant": "makes values from no input",
    "opaque": "an op written in Python whose positions the compiler cannot see into",
}

# The graph's leaves, and a part of a tuple value: nodes that compute nothing themselves
# (no op of the table; a scan's part is counted by its scan).
ARGUMENTS = ("input", "param", "carry")
LEAVES = ARGUMENTS + ("part",)


def register(name: str, inputs: tuple[str, ...], doc: str, attrs: tuple[Attr, ...] = (),
             written: str | None = None, random: bool = False, *, kind: str):
  """Declares op `name`, of `kind` (one of KINDS), with the decorated function as its
  reference rule.

  Raises:
    ValueError: the name is declared twice, or the kind is none of KINDS.
  """

  def deco(fn):
    if name in OPS:
      raise ValueError(f"op {name} registered twice")
    OPS[name] = OpDef(name, fn, tuple(inputs), tuple(attrs), doc, written, random, kind=kind)
    return fn

  return deco


TABLES: list["OpTable"] = []  # every interpretation's table, in the order they were made


class OpTable(MutableMapping):
  """One interpretation of the ops: op name → rule, or the reason the op has none.

  An op's rule is its own entry when it has one (an exception, registered), else its
  kind's default; a kind with no default makes each of its ops register one. The one
  registration helper of every table (FLOPs, the backward's cost and saved inputs, decode,
  split, lowering), as JAX's `mlir.register_lowering` is for lowerings.
  """

  def __init__(self, what: str, where: str, defaults: dict | None = None,
               complete: bool = True):
    """`what` names the table in messages, `where` its module; `defaults`: kind → rule;
    `complete`: every op must have an entry (else the table names only the ops a pass
    looks for, as the views a memory estimate sees through)."""
    for kind in defaults or {}:
      if kind not in KINDS:
        raise ValueError(f"{what}: no kind {kind!r}")
    self.what, self.where, self.own, self.defaults = what, where, {}, dict(defaults or {})
    self.complete = complete
    TABLES.append(self)

  def register(self, rule: Any, *ops: str) -> Any:
    """Registers `rule` (or the reason there is none) as the entry of `ops`.

    Raises:
      ValueError: an op already has an entry of its own.
    """
    for op in ops:
      if op in self.own:
        raise ValueError(f"op {op} has a {self.what} rule already")
      self.own[op] = rule
    return rule

  def register_kind(self, rule: Any, *kinds: str) -> Any:
    """Registers `rule` as the default of every op of `kinds` that registers none.

    Raises:
      ValueError: a kind is none of KINDS, or already has a default.
    """
    for kind in kinds:
      if kind not in KINDS or kind in self.defaults:
        raise ValueError(f"{self.what}: kind {kind!r} is unknown or has a default already")
      self.defaults[kind] = rule
    return rule

  def default(self, kind: str) -> Any:
    """The rule of `kind`'s ops that register none, or None."""
    return self.defaults.get(kind)

  def forget(self, op: str) -> None:
    """Drops `op`'s own entry (an op written in Python, declared again)."""
    self.own.pop(op, None)

  def __getitem__(self, op: str) -> Any:
    if op in self.own:
      return self.own[op]
    d = OPS.get(op)
    if d is not None and d.kind in self.defaults:
      return self.defaults[d.kind]
    raise KeyError(op)

  def __setitem__(self, op: str, rule: Any) -> None:
    self.own[op] = rule

  def __delitem__(self, op: str) -> None:
    del self.own[op]

  def __iter__(self) -> Iterator[str]:
    yield from list(self.own)
    yield from [n for n, d in OPS.items() if n not in self.own and d.kind in self.defaults]

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __repr__(self) -> str:
    return f"OpTable({self.what}: {len(self.own)} own, defaults for {sorted(self.defaults)})"

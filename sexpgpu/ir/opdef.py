"""How an op is declared: its signature, its doc and its reference rule, once.

Every other interpretation of an op (per-platform lowerings in `sexpgpu.lower`,
FLOPs, the decode rule, the front end's reading of a call, the reference page)
is a table of its own module, keyed by the op's name; this module holds only
what the op *is*. Shapes and dtypes come from the reference rule evaluated
abstractly (`ir.shapes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

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
    precision: "f32", or "bf16" to compute products and attention in bf16.
    rng: the PRNG key of this microbatch (None in passes and shape rules).
    training: False in passes (dropout is off) and in shape rules.
    notes: what rules chose where a choice was made (for the lowering report).
    platform: the device the step runs on ("cpu", "gpu"), where a rule lowers
      differently for it; None when unknown (shape rules, passes).
  """

  precision: str = "f32"
  rng: Any = None
  training: bool = False
  notes: list = dataclasses.field(default_factory=list)
  platform: str | None = None

  def compute_dtype(self, x):
    return jnp.bfloat16 if self.precision == "bf16" and x.dtype == jnp.float32 else x.dtype


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
    pointwise: each output position depends only on the same position of the inputs
      (a user op's declaration; decoding passes positions through it).
  """

  name: str
  lower: Callable[..., Any]
  inputs: tuple[str, ...]
  attrs: tuple[Attr, ...]
  doc: str
  written: str | None = None
  random: bool = False
  source: str | None = None
  pointwise: bool = False

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


def register(name: str, inputs: tuple[str, ...], doc: str, attrs: tuple[Attr, ...] = (),
             written: str | None = None, random: bool = False):
  """Declares op `name` with the decorated function as its reference rule.

  Raises:
    ValueError: the name is declared twice.
  """

  def deco(fn):
    if name in OPS:
      raise ValueError(f"op {name} registered twice")
    OPS[name] = OpDef(name, fn, tuple(inputs), tuple(attrs), doc, written, random)
    return fn

  return deco

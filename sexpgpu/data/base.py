"""The Loader base class: positions, state and record access over batch(i)."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

import numpy as np

from sexpgpu.data.spec import LoaderSpec

Fields = dict[str, tuple[tuple[int, ...], np.dtype]]

# Tags that keep the random streams of different purposes apart.
TAG_MARKOV_TABLE = 1
TAG_MARKOV = 2
TAG_TASK = 3
TAG_SHUFFLE = 4
TAG_MIX = 5


@dataclasses.dataclass(frozen=True)
class Context:
  """What every loader is built with besides its own arguments.

  Attributes:
    seed: the run's seed.
    cache_dir: the cache root for remote files, or None for the default.
    shuffle_default: whether file loaders shuffle when `:shuffle` is absent.
    make: builds a sub-loader from its spec (for `mix`).
  """

  seed: int
  cache_dir: str | None
  shuffle_default: bool
  make: Callable[[LoaderSpec], "Loader"]


def rng(*parts: int) -> np.random.Generator:
  """A generator seeded by a tuple of integers (negative ones folded to 64 bits)."""
  return np.random.default_rng([int(p) % (1 << 64) for p in parts])


def type_name(shape: tuple[int, ...], dtype: np.dtype) -> str:
  """Writes a field's type as `int32[4,17]`."""
  return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


class Loader(abc.ABC):
  """A source of microbatches: batch(i) is a pure function of (args, seed, i).

  Subclasses take (spec, bound args, Context), are declared by a LoaderDef
  beside them (its keywords, in data.KINDS), set `spec`, `kind`, `batch_size`
  and `fields` and implement `batch`; they may override `records` (the total
  count, None when endless) and `describe`.
  """

  spec: LoaderSpec
  kind: str
  batch_size: int
  fields: Fields
  records: int | None = None

  def __init__(self) -> None:
    self.position = 0

  @abc.abstractmethod
  def batch(self, i: int) -> dict[str, np.ndarray]:
    """The i-th microbatch, counting from the start of the run.

    Args:
      i: the microbatch index (>= 0).

    Returns:
      A map of field name to an array with a leading axis of batch_size.
    """

  def next(self) -> dict[str, np.ndarray]:
    """The microbatch at the current position; advances the position by one."""
    out = self.batch(self.position)
    self.position += 1
    return out

  def take(self, start: int, count: int) -> dict[str, np.ndarray]:
    """Records start .. start+count-1 (record p is row p % B of batch p // B).

    Args:
      start: the first record's index.
      count: how many records.

    Returns:
      A map of field name to an array with a leading axis of `count`.
    """
    b = self.batch_size
    if count == 0:
      return {k: np.zeros((0,) + shape[1:], dtype) for k, (shape, dtype) in self.fields.items()}
    first, last = start // b, (start + count - 1) // b
    parts = [self.batch(k) for k in range(first, last + 1)]
    offset = start - first * b
    return {k: np.concatenate([p[k] for p in parts])[offset:offset + count]
            for k in self.fields}

  def state(self) -> dict[str, Any]:
    """The loader's whole state, JSON-able: its kind and position."""
    return {"kind": self.kind, "position": self.position}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a state from `state()`.

    Raises:
      ValueError: when the state is not one of this loader's.
    """
    position = state.get("position")
    if state.get("kind", self.kind) != self.kind or not isinstance(position, int) or position < 0:
      raise ValueError(f"loader {self.spec.name}: not a {self.kind} loader state: {state!r}")
    self.position = position

  def whole_batches(self) -> int | None:
    """Microbatches the split holds whole: batch(i) for i below it reads each record of the
    split once (batch(i) past it wraps round to records already read); None when endless."""
    return None if self.records is None else self.records // self.batch_size

  def describe(self) -> dict[str, Any]:
    """What `sexpgpu check` prints: kind, field types, total records."""
    return {"kind": self.kind,
            "fields": {k: type_name(s, d) for k, (s, d) in self.fields.items()},
            "records": self.records}

"""What each event kind becomes in a dashboard: scalars and text, one table."""

from __future__ import annotations

import json
import numbers
from typing import Any, Callable, Iterator

# Fields every event carries; never plotted themselves.
_ENVELOPE = ("kind", "slug", "time", "step")

Scalars = Iterator[tuple[str, float]]
Texts = Iterator[tuple[str, str]]


def number(value: Any) -> float | None:
  """The value as a float when it is a real number (not a bool), else None.

  Args:
    value: a Python, numpy or 0-d array value.

  Returns:
    The float, or None for anything that is not one number.
  """
  if isinstance(value, bool) or value is None:
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  if getattr(value, "shape", None) == () and hasattr(value, "dtype"):
    try:
      return float(value)
    except (TypeError, ValueError):
      return None
  return None


def to_json(value: Any) -> Any:
  """A `json.dumps` default: numpy and JAX values as numbers or lists."""
  if hasattr(value, "tolist"):
    return value.tolist()
  if isinstance(value, (set, frozenset, tuple)):
    return list(value)
  return str(value)


def pretty(event: dict) -> str:
  """The event as indented JSON in a fenced block, for a text panel."""
  body = json.dumps(event, indent=2, default=to_json)
  return f"```json\n{body}\n```"


def _numeric_fields(event: dict) -> Scalars:
  """Every numeric field, and each numeric entry of a dict as `field/key`."""
  for name, value in event.items():
    if name in _ENVELOPE:
      continue
    if isinstance(value, dict):
      for key, inner in value.items():
        v = number(inner)
        if v is not None:
          yield f"{name}/{key}", v
      continue
    v = number(value)
    if v is not None:
      yield name, v


def _metric_scalars(event: dict) -> Scalars:
  """The numeric entries of the event's `metrics`, each by its own name."""
  for name, value in (event.get("metrics") or {}).items():
    v = number(value)
    if v is not None:
      yield name, v


def _pass_scalars(event: dict) -> Scalars:
  yield from _metric_scalars(event)
  seconds = number(event.get("time/pass"))
  if seconds is not None:
    yield f"time/pass/{event.get('pass', 'pass')}", seconds


def _eval_scalars(event: dict) -> Scalars:
  yield from _metric_scalars(event)
  seconds = number(event.get("time/eval"))
  if seconds is not None:
    where = "/".join(str(event[k]) for k in ("eval", "task") if event.get(k) is not None)
    yield f"time/eval/{where or 'eval'}", seconds


def _diagnostic_scalars(event: dict) -> Scalars:
  v = number(event.get("value"))
  if v is not None:
    yield f"diag/{event.get('name', 'value')}", v


def _stage_scalars(event: dict) -> Scalars:
  v = number(event.get("to"))
  if v is not None:
    yield "stage", v


def _checkpoint_scalars(event: dict) -> Scalars:
  for key in ("bytes", "seconds"):
    v = number(event.get(key))
    if v is not None:
      yield f"checkpoint/{key}", v


def _no_scalars(event: dict) -> Scalars:
  return iter(())


_SCALARS: dict[str, Callable[[dict], Scalars]] = {
    "step": _numeric_fields,
    "pass": _pass_scalars,
    "eval": _eval_scalars,
    "diagnostic": _diagnostic_scalars,
    "stage": _stage_scalars,
    "checkpoint": _checkpoint_scalars,
}


def scalars(event: dict) -> list[tuple[str, float]]:
  """The (tag, value) scalars an event plots; [] for kinds that plot nothing.

  Args:
    event: an event as emitted (kind, fields, slug, time).

  Returns:
    Tags and values: step fields as named (dicts such as counters as
    `counters/<name>`), pass metrics by name plus `time/pass/<pass>`, eval
    metrics by name (`<eval>/<task>/acc`) plus `time/eval/<eval>/<task>`,
    `diag/<name>`, `stage`, `checkpoint/bytes` and `checkpoint/seconds`.
  """
  return list(_SCALARS.get(event["kind"], _no_scalars)(event))


def _annotation_text(event: dict) -> Texts:
  name = event.get("name", "annotation")
  parts = {k: v for k, v in event.items()
           if k not in _ENVELOPE and k not in ("name", "text")}
  text = str(event.get("text", ""))
  if parts:
    text = f"{text}\n\n{pretty(parts)}"
  yield f"annotation/{name}", text


def _stage_text(event: dict) -> Texts:
  yield "stage", (f"{event.get('from')} -> {event.get('to')}: "
                  f"{event.get('reason', '')}")


def _checkpoint_text(event: dict) -> Texts:
  yield "checkpoint", (f"{event.get('action', 'saved')} step "
                       f"{event.get('step')} at {event.get('location')}")


def _whole_text(event: dict) -> Texts:
  body = {k: v for k, v in event.items() if k not in ("kind", "time")}
  yield event["kind"], pretty(body)


def _sample_text(event: dict) -> Texts:
  text = f"{event.get('prompt', '')} → {event.get('text', '')}"
  yield f"sample/{event.get('name', 'sample')}", text


_TEXTS: dict[str, Callable[[dict], Texts]] = {
    "config": _whole_text,
    "sample": _sample_text,
    "annotation": _annotation_text,
    "stage": _stage_text,
    "checkpoint": _checkpoint_text,
    "summary": _whole_text,
}


def texts(event: dict) -> list[tuple[str, str]]:
  """The (tag, text) entries an event shows in a text panel.

  Args:
    event: an event as emitted.

  Returns:
    `config` and `summary` as JSON, `annotation/<name>` with its text and
    structured parts, a `stage` line, a `checkpoint` line, `sample/<name>` as the prompt
    and its continuation; [] otherwise.
  """
  producer = _TEXTS.get(event["kind"])
  return list(producer(event)) if producer else []


def images(event: dict) -> list[tuple[str, str]]:
  """The (tag, PNG path) pictures an event shows in an image panel.

  Args:
    event: an event as emitted.

  Returns:
    A `generate` event's grids as `generate/<name>` (one image output) or
    `generate/<name>/<output>` (several), each the path of its PNG; [] otherwise.
  """
  if event["kind"] != "generate":
    return []
  found = event.get("images") or {}
  name = event.get("name", "generate")
  return [(f"generate/{name}" if len(found) == 1 else f"generate/{name}/{key}", str(path))
          for key, path in found.items()]


def picture(path: str):
  """A PNG's pixels as a uint8 array [h w c] (a grey picture with c 1)."""
  import numpy as np
  from PIL import Image
  with Image.open(path) as im:
    a = np.asarray(im.convert("L" if im.mode in ("L", "I", "1") else "RGB"))
  return a[..., None] if a.ndim == 2 else a

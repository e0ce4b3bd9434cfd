"""`defrun`'s keywords of patterns and forms: `:trainable`, `:fp8` and `(lora ...)`."""

from __future__ import annotations

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.front import reference  # noqa: F401  (registers the `reference` builtin)
from sexpgpu.front.build import Builder, describe
from sexpgpu.front.values import Env, Spec
from sexpgpu.ir import lora as adapters
from sexpgpu.lang.program import split_keywords
from sexpgpu.reader import Form, List
from sexpgpu.reader.forms import head_symbol


def _patterns(b: Builder, form: Form, env: Env, key: str, fix: str) -> tuple[str, ...]:
  """A pattern key's value: a non-empty vector of non-empty glob strings, else E-RUN-002."""
  v = b.eval(form, env)
  if not (isinstance(v, tuple) and v and all(isinstance(p, str) and p for p in v)):
    raise SxError("E-RUN-002", f":{key} is {describe(v)}; it is a vector of glob patterns "
                  "over parameter paths", location=form.loc, fix=fix)
  return v


def trainable(b: Builder, form: Form | None, env: Env) -> Spec | None:
  """`:trainable ["glob" ...]` as a Spec holding its patterns (matched in ir/lora.py).

  Raises:
    SxError: E-RUN-002 at the value when it is no non-empty vector of non-empty strings.
  """
  if form is None:
    return None
  v = _patterns(b, form, env, "trainable", ":trainable [\"*/lm_head/*\" \"*/norm/*\"] "
                "(`check --print params` lists the paths)")
  return Spec("trainable", "trainable", (("patterns", v),), form.loc)


def fp8(b: Builder, form: Form | None, env: Env, precision: str) -> Spec | None:
  """`:fp8 ["glob" ...]` as a Spec holding its patterns (matched in lower/fp8.py against the
  weights the products read).

  Raises:
    SxError: E-RUN-002 at the value when it is no non-empty vector of non-empty strings, or
      when the run's precision is not fp8 (the patterns would name nothing that runs).
  """
  if form is None:
    return None
  v = _patterns(b, form, env, "fp8", ":fp8 [\"*/mlp/*\"] (the products whose weights these "
                "name run in float8; `check --print params` lists the paths)")
  if precision != "fp8":
    raise SxError("E-RUN-002", f":fp8 names products to run in float8, but the run's precision "
                  f"is {precision}", location=form.loc,
                  fix=":precision fp8 beside :fp8 (or --set precision=fp8), or leave :fp8 out "
                  "of a bf16 or f32 run")
  return Spec("fp8", "fp8", (("patterns", v),), form.loc)


def lora(b: Builder, form: Form | None, env: Env) -> adapters.Lora | None:
  """`:lora (lora :rank 8 :alpha 16 :dropout 0.0 :targets [...])` as an ir.lora.Lora.

  Raises:
    SxError: E-RUN-002 for a value that is no (lora ...) form and for a keyword's bad value
      (ir.lora.options); E-FORM-002 at an unknown keyword, the nearest known one named;
      E-FORM-001 for a positional argument.
  """
  if form is None:
    return None
  if not (isinstance(form, List) and head_symbol(form) == "lora"):
    raise SxError("E-RUN-002", ":lora takes a (lora ...) form", location=form.loc,
                  fix=":lora (lora :rank 8 :alpha 16 :targets [\"*/q_proj/w\" \"*/v_proj/w\"])")
  pos, kws, locs = split_keywords(form, 1, None, "lora")
  for key in kws:
    if key not in adapters.KEYWORDS:
      near = did_you_mean(":" + key, [":" + k for k in adapters.KEYWORDS])
      raise SxError("E-FORM-002", f"lora has no keyword :{key}", location=locs[key],
                    fix=(near + " " if near else "") + "lora takes "
                    + " ".join(":" + k for k in adapters.KEYWORDS))
  if pos:
    raise SxError("E-FORM-001", "lora takes keyword arguments only", location=pos[0].loc,
                  fix="(lora :rank 8 :targets [\"*/q_proj/w\"]), each value after its keyword")
  values = {k: b.eval(f, env) for k, f in kws.items()}
  return adapters.options(values, {k: f.loc for k, f in kws.items()}, form.loc)

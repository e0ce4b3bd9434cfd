"""Where a model's parameters come from: a checkpoint, a `.safetensors` file, a twin folder;
and the graph of a function that maps tokens to logits."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from sexpgpu.env import get as env_get
from sexpgpu.errors import SxError

SX_FORMAT = "sexpgpu"  # the `format` metadata of a .safetensors file of .sx paths


def step_dir_of(value: str, checkpoint_dir: str | None, slug: str) -> str:
  """A --resume value (a step folder, a run folder, `latest`) as a complete step folder.

  Raises:
    SxError: E-CKPT-001/003 as `run --resume` raises them; E-CKPT-003 for `latest` with
      no checkpoint yet.
  """
  from sexpgpu.ckpt import resolve_resume
  step_dir, _ = resolve_resume(value, checkpoint_dir, slug)
  if step_dir is None:
    raise SxError("E-CKPT-003", f"no checkpoint of {slug} under {checkpoint_dir} yet",
                  where="--resume latest", fix="train first, or pass --resume a step folder")
  return step_dir


def checkpoint_params(step_dir: str) -> tuple[dict[str, np.ndarray], dict]:
  """The parameters (path → host array) and the meta of a complete step folder, read
  without knowing the experiment that wrote it (its optimizer state is not kept).

  Raises:
    SxError: E-CKPT-003 when the folder is missing, incomplete or unreadable.
  """
  from sexpgpu.ckpt import shards
  from sexpgpu.ckpt.orbax_io import ocp
  from sexpgpu.ckpt.restore import _read, meta_of

  def reader(local: str):
    if shards.is_sharded(local):  # every process wrote its own shards
      return {"params": shards.read_group(local, "params")}, meta_of(local)
    return ocp.StandardCheckpointer().restore(os.path.join(local, "state")), meta_of(local)

  state, meta = _read(step_dir, reader)
  params = state.get("params") if isinstance(state, dict) else None
  if not isinstance(params, dict):
    raise SxError("E-CKPT-003", f"cannot read checkpoint {step_dir}: it holds no parameters",
                  where=step_dir, fix="pass a step folder written by sexpgpu run or import")
  return {k: np.asarray(v) for k, v in params.items()}, meta


def check_experiment(c, meta: dict, step_dir: str) -> None:
  """E-CKPT-002 when the checkpoint is of another experiment than `c`, as --resume says."""
  from sexpgpu.ckpt.meta import check_experiment
  check_experiment(meta, step_dir, c.fingerprint,
                   {k: v.value for k, v in c.selection.knobs.items()})


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict]:
  """The tensors (as numpy, bf16 as ml_dtypes' bfloat16) and metadata of a .safetensors file.

  Raises:
    SxError: E-INIT-001 when it cannot be read (naming it).
  """
  from safetensors import safe_open
  try:
    with safe_open(path, framework="flax") as f:
      meta = f.metadata() or {}
      return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}, meta
  except Exception as e:  # pylint: disable=broad-except
    raise SxError("E-INIT-001", f"cannot read {path}: {e}", where=path,
                  fix="give a .safetensors file written by sexpgpu export or transformers") from e


def read_twin_folder(folder: str, where: str) -> tuple[dict[str, np.ndarray], dict]:
  """A Hugging Face folder's tensors (model.safetensors) and config.json.

  Raises:
    SxError: E-INIT-001 for a name instead of a folder (nothing is downloaded), a folder
      without config.json or model.safetensors.
  """
  if not os.path.isdir(folder):
    hub = "/" in folder and not folder.startswith((".", "/")) and not os.path.exists(folder)
    raise SxError("E-INIT-001", f"{folder} is not a folder" + (
                  " (a hub name? nothing is downloaded)" if hub else ""), where=where,
                  fix="save the model with save_pretrained(DIR) where the network is, and "
                  "give DIR")
  cfg_path = os.path.join(folder, "config.json")
  weights = os.path.join(folder, "model.safetensors")
  for p in (cfg_path, weights):
    if not os.path.isfile(p):
      raise SxError("E-INIT-001", f"{folder} has no {os.path.basename(p)}", where=where,
                    fix="a folder written by save_pretrained(DIR, safe_serialization=True) "
                    "or by sexpgpu export --format hf")
  with open(cfg_path) as f:
    config = json.load(f)
  tensors, _ = read_safetensors(weights)
  return tensors, config


# --- a function from tokens to logits ------------------------------------------------------

def takes_segments(c, fn: str) -> bool:
  """Whether the function `fn` takes the keywords :segments and :positions (packed rows)."""
  if not _is_function(c.exp, fn):
    return False
  names = {k for k, _ in c.exp.env.lookup(fn).kwparams}
  return {"segments", "positions"} <= names


def logits_graph(c, fn: str, t: int, batch: int = 1, packed: bool = False):
  """The graph of `(FN tokens)` for int32 tokens [batch t], built as the loss builds it, so
  that FN's parameters have the loss's paths (`lm/...`); rewritten (attention → sdpa).
  `packed`: `(FN tokens :segments S :positions P)` with S and P int32 [batch t] inputs too.

  Raises:
    SxError: E-SAMPLE-001 when FN is not a function of the experiment or does not map
      tokens [b t] to logits [b t vocab].
  """
  from sexpgpu.front.build import is_tensor
  from sexpgpu.ir.rewrite import rewrite
  from sexpgpu.reader.read import read_text
  exp = c.exp
  if not _is_function(exp, fn):
    raise SxError("E-SAMPLE-001", f"`{fn}` is not a function of this experiment",
                  where=f"--fn {fn}", fix=_candidates_fix(c))
  b = exp.builder()
  b.params = dict(c.params)
  fields = ("tokens", "segments", "positions") if packed else ("tokens",)
  extra = " :segments (get batch :segments) :positions (get batch :positions)" if packed else ""
  (form,) = read_text(f"(fn [batch] ({fn} (get batch :tokens){extra}))", "<sample>")
  closure = b.eval(form, exp.env)
  try:
    g, out = b.build(f"sample/{fn}", closure, {f: ("i32", (batch, t)) for f in fields},
                     allow_new_params=False)
  except SxError as e:
    raise SxError("E-SAMPLE-001", f"`({fn} tokens)` does not build on tokens [{batch} {t}]: "
                  f"{e.message} ({e.code})",
                  where=f"--fn {fn}", fix=_candidates_fix(c)) from e
  if not (is_tensor(out) and len(out.shape) == 3 and out.shape[:2] == (batch, t)
          and out.dtype in ("f32", "bf16", "f16")):
    raise SxError("E-SAMPLE-001", f"`({fn} tokens)` returns "
                  f"{getattr(out, 'type_str', type(out).__name__)}, not logits "
                  f"[{batch} {t} vocab]", where=f"--fn {fn}", fix=_candidates_fix(c))
  patterns = env_get("SEXPGPU_PATTERNS") != "off"
  return rewrite(g, patterns)[0]


def _is_function(exp, name: str) -> bool:
  from sexpgpu.front.values import Closure
  try:
    return isinstance(exp.env.lookup(name), Closure)
  except KeyError:
    return False


def token_lengths(c) -> list[int]:
  """Window lengths to try a function on: the loaders' token lengths and one less (what
  `lm-inputs` leaves), longest first."""
  lengths = sorted({sh[-1] for f in c.fields.values() for name, (_, sh) in f.items()
                    if name == "tokens" and sh}, reverse=True)
  return [n for L in lengths for n in (L, L - 1) if n > 0]


def candidates(c) -> list[str]:
  """The experiment's own functions (not the standard library's) that map tokens [1 t] to
  logits [1 t vocab] with the loss's parameters, for some t, in the file's order."""
  out = []
  for name, v in _user_functions(c.exp.env):
    if len(v.params) != 1 or str(getattr(v.loc, "file", "")).startswith("std/"):
      continue
    for t in [2] + token_lengths(c):
      try:
        logits_graph(c, name, t)
      except SxError:
        continue
      out.append(name)
      break
  return out


def _user_functions(env) -> list[tuple[str, Any]]:
  from sexpgpu.front.values import Closure
  seen, out = set(), []
  while env is not None:
    for k, v in env.vars.items():
      if k not in seen and isinstance(v, Closure) and v.name is not None:
        seen.add(k)
        out.append((k, v))
    env = env.parent
  return sorted(out, key=lambda kv: (str(getattr(kv[1].loc, "file", "")),
                                      getattr(kv[1].loc, "line", 0)))


def _candidates_fix(c) -> str:
  return "pass --fn NAME, a function of the tokens that returns logits [b t vocab]"


def default_fn(c) -> str:
  """The function that maps tokens to logits when --fn is not given: the one the
  experiment's defsample passes name, else the only candidate.

  Raises:
    SxError: E-SAMPLE-001 listing the candidates when there is not exactly one.
  """
  named = {d.fn for d in c.exp.samples.values()}
  if len(named) == 1:  # the function the experiment's defsample decodes
    return named.pop()
  found = candidates(c)
  if len(found) == 1:
    return found[0]
  raise SxError("E-SAMPLE-001", "sample cannot tell which function maps tokens to logits: "
                + (f"candidates {', '.join(found)}" if found else "no function of this file "
                   "maps tokens [b t] to logits [b t vocab]"), where="--fn",
                fix="pass --fn NAME" + (f", one of {', '.join(found)}" if found else ""))

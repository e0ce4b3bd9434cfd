"""Where a model's parameters come from: a checkpoint, a `.safetensors` file, a twin folder;
and the graph of a function that maps tokens to logits."""

from __future__ import annotations

import math
import os
import stat
from typing import Any, Callable

import numpy as np

from sexpgpu import bounded
from sexpgpu.env import get as env_get
from sexpgpu.errors import SxError

SX_FORMAT = "sexpgpu"  # the `format` metadata of a .safetensors file of .sx paths
CONFIG_LIMIT = 4 * bounded.MiB  # a config.json (a few KB; a long label map at most a MB)
INDEX_LIMIT = 64 * bounded.MiB  # a model.safetensors.index.json (a line a tensor)
SIZE_MAX = (1 << 31) - 1  # a size in a config.json: an int32 token id or axis at most


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
  from sexpgpu.ckpt.restore import read_verified, meta_of

  def reader(local: str):
    if shards.is_sharded(local):  # every process wrote its own shards
      return {"params": shards.read_group(local, "params")}, meta_of(local)
    return ocp.StandardCheckpointer().restore(os.path.join(local, "state")), meta_of(local)

  state, meta = read_verified(step_dir, reader)
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
    mode = os.stat(path).st_mode
  except OSError as e:
    raise SxError("E-INIT-001", f"cannot read {path}: {e.strerror}", where=path,
                  fix="give the path of a .safetensors file that exists") from None
  if not stat.S_ISREG(mode):  # a FIFO would wait for a writer, /dev/zero never end
    raise SxError("E-INIT-001", f"{path} is not a regular file (a folder, FIFO or device)",
                  where=path, fix="give a .safetensors file, never a pipe or a device")
  try:
    with safe_open(path, framework="flax") as f:
      meta = f.metadata() or {}
      return {k: np.asarray(f.get_tensor(k)) for k in f.keys()}, meta
  except Exception as e:  # pylint: disable=broad-except
    raise SxError("E-INIT-001", f"cannot read {path}: {e}", where=path,
                  fix="give a .safetensors file written by sexpgpu export or transformers") from e


def read_twin_folder(folder: str, where: str, *,
                     allow_nonfinite: bool = False) -> tuple[dict[str, np.ndarray], dict]:
  """A Hugging Face folder's tensors (model.safetensors, or the shards its
  model.safetensors.index.json lists) and config.json, each read within a bound.

  Args:
    allow_nonfinite: take a config.json holding NaN or infinity (refused otherwise).

  Raises:
    SxError: E-INIT-001 for a name instead of a folder (nothing is downloaded), a folder
      without config.json or weights, a config.json that is no JSON object within
      CONFIG_LIMIT or holds a value of the wrong type (naming the key), unreadable weights.
  """
  if not os.path.isdir(folder):
    hub = "/" in folder and not folder.startswith((".", "/")) and not os.path.exists(folder)
    raise SxError("E-INIT-001", f"{folder} is not a folder" + (
                  " (a hub name? nothing is downloaded)" if hub else ""), where=where,
                  fix=f"make it from a run of sexpgpu with `sexpgpu export RUN.sx --resume "
                  f"CHECKPOINT --format hf -o {folder}`, or save a model there with "
                  "save_pretrained where the network is")
  cfg_path = os.path.join(folder, "config.json")
  weights = os.path.join(folder, "model.safetensors")
  index = weights + ".index.json"
  for p in (cfg_path, weights):
    if not os.path.lexists(p) and not (p == weights and os.path.lexists(index)):
      raise SxError("E-INIT-001", f"{folder} has no {os.path.basename(p)}", where=where,
                    fix="a folder written by save_pretrained(DIR, safe_serialization=True) "
                    "or by sexpgpu export --format hf")
  config = bounded.read_json(cfg_path, limit=CONFIG_LIMIT, what="config", code="E-INIT-001",
                             where=cfg_path, fix="give the config.json that save_pretrained "
                             "wrote beside the weights: one JSON object")
  check_config(config, cfg_path, allow_nonfinite)
  if os.path.lexists(weights):
    tensors, _ = read_safetensors(weights)
  else:
    tensors = _read_shards(folder, index)
  return tensors, config


# config.json keys the twins read, by what each must hold
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_ctx", "n_inner",
          "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "max_position_embeddings", "head_dim", "state_size",
          "conv_kernel", "time_step_rank", "num_local_experts", "num_experts_per_tok",
          "sliding_window")
_MAY_BE_NULL = ("n_inner", "head_dim", "sliding_window", "torch_dtype", "rope_scaling")
_REALS = ("layer_norm_epsilon", "rms_norm_eps", "rope_theta", "initializer_range",
          "resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout",
          "router_aux_loss_coef", "router_jitter_noise", "expand")
_STRINGS = ("model_type", "activation_function", "hidden_act", "torch_dtype")
_FLAGS = ("tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
          "reorder_and_upcast_attn", "attention_bias", "mlp_bias", "use_bias", "use_conv_bias",
          "residual_in_fp32")
_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "true or false",
          type(None): "null", int: "a number", float: "a number"}


def _config_value_problem(key: str, value) -> str | None:
  """What is wrong with one known key's value, or None (the key's own test)."""
  if value is None and key in _MAY_BE_NULL:
    return None
  if key in _SIZES:
    if key == "time_step_rank" and value == "auto":
      return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
      return f"a whole number from 1 to {SIZE_MAX} is expected"
    return None if 1 <= value <= SIZE_MAX else f"a size from 1 to {SIZE_MAX} is expected"
  if key in _REALS:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return "a number is expected"
    return None if value >= 0 or not math.isfinite(value) else "a number ≥ 0 is expected"
  if key in _STRINGS and not isinstance(value, str):
    return "a string is expected"
  if key in _FLAGS and not isinstance(value, bool):
    return "true or false is expected"
  if key == "architectures" and not (isinstance(value, list)
                                     and all(isinstance(a, str) for a in value)):
    return "an array of class names is expected"
  if key == "rope_scaling" and not isinstance(value, dict):
    return "null or an object is expected"
  return None


def _nonfinite_keys(config: dict) -> list[str]:
  """The keys (dotted, arrays indexed) of the config's NaN and infinite numbers."""
  out, todo = [], [("", config)]
  while todo:
    key, value = todo.pop()
    if isinstance(value, dict):
      todo.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
      todo.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, float) and not math.isfinite(value):
      out.append(f"{key} {value}")
  return sorted(out)


def check_config(config: dict, cfg_path: str, allow_nonfinite: bool = False) -> None:
  """E-INIT-001 naming config.json's key when it holds NaN or infinity (unless
  `allow_nonfinite`), or a known key holds a value of the wrong type or a size out of range
  (checked before any size is used, so a vocab_size of 10**12 allocates nothing)."""
  bad = _nonfinite_keys(config)
  if bad and not allow_nonfinite:
    raise SxError("E-INIT-001", f"{cfg_path} holds non-finite numbers: {', '.join(bad[:8])}"
                  + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
                  + "; a model made from it cannot train", where=cfg_path,
                  fix="write finite values in config.json, or import with --allow-nonfinite "
                  "to take it as it is")
  for key in sorted(config):
    value = config[key]
    if isinstance(value, float) and not math.isfinite(value):
      continue  # allowed above
    problem = _config_value_problem(key, value)
    if problem:
      shown = repr(value) if not isinstance(value, (dict, list)) else _KINDS[type(value)]
      raise SxError("E-INIT-001", f"{cfg_path}: {key} is {shown[:80]}, where {problem}",
                    where=f"{cfg_path} {key}",
                    fix=f"write {key} in config.json as save_pretrained does")


def _read_shards(folder: str, index: str) -> dict[str, np.ndarray]:
  """The tensors of the shards a model.safetensors.index.json lists (each read once)."""
  data = bounded.read_json(index, limit=INDEX_LIMIT, what="weight index", code="E-INIT-001",
                           where=index, fix="give the model.safetensors.index.json that "
                           "save_pretrained wrote: {\"weight_map\": {tensor: shard file}}")
  weight_map = data.get("weight_map")
  if not (isinstance(weight_map, dict) and weight_map
          and all(isinstance(v, str) for v in weight_map.values())):
    raise SxError("E-INIT-001", f"{index}: weight_map is not an object of tensor → shard "
                  "file names", where=index,
                  fix="list each tensor's shard under weight_map, as save_pretrained does")
  shards = sorted(set(weight_map.values()))
  outside = [f for f in shards if os.path.basename(f) != f or f in ("", ".", "..")
             or not f.endswith(".safetensors")]
  if outside:
    raise SxError("E-INIT-001", f"{index}: weight_map names files that are no .safetensors "
                  f"file of the folder: {', '.join(map(repr, outside[:4]))}", where=index,
                  fix="name shards by their file names in the folder, without / or ..")
  tensors: dict[str, np.ndarray] = {}
  for shard in shards:
    got, _ = read_safetensors(os.path.join(folder, shard))
    twice = sorted(set(got) & set(tensors))
    if twice:
      raise SxError("E-INIT-001", f"{shard}: tensors also in another shard: "
                    f"{', '.join(twice[:4])}", where=index,
                    fix="write the folder again with save_pretrained: each tensor in one shard")
    tensors.update(got)
  missing = sorted(k for k in weight_map if k not in tensors)
  if missing:
    raise SxError("E-INIT-001", f"{index} lists tensors no shard holds: "
                  f"{', '.join(missing[:4])}" + (f" and {len(missing) - 4} more"
                                                 if len(missing) > 4 else ""), where=index,
                  fix="copy every shard the index lists into the folder")
  return tensors


def twin_params(c, folder: str, where: str, finder: str,
                mismatch: Callable[[Any, list[str]], SxError], *,
                allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
  """The parameters of experiment `c` from a Hugging Face folder of its model's twin.

  Args:
    where: the flag or keyword the folder came from; finder: the command, for E-EXPORT-001.
    mismatch: the caller's error for the twin and the problems when the folder does not fit.
    allow_nonfinite: take a config.json holding NaN or infinity.

  Raises:
    SxError: E-EXPORT-001 when the model has no twin, E-INIT-001 as read_twin_folder
      raises it, and `mismatch`'s error.
  """
  from sexpgpu.models import twin
  g = twin.find(c.params, c.stages[0].graph, finder)
  tensors, config = read_twin_folder(folder, where, allow_nonfinite=allow_nonfinite)
  params, problems = twin.from_folder(g, tensors, config, folder)
  if problems:
    raise mismatch(g, problems)
  return params


_CHUNK = 1 << 24  # elements a non-finite scan holds at once


def nonfinite(params: dict[str, np.ndarray]) -> list[str]:
  """Each tensor holding NaN or infinity: its name, how many of how many, the first index."""
  out = []
  for name in sorted(params):
    v = np.asarray(params[name])
    if v.dtype.kind in "iub" or v.size == 0:
      continue
    flat, bad, first = v.reshape(-1), 0, None
    for at in range(0, flat.size, _CHUNK):
      try:
        wrong = ~np.isfinite(flat[at:at + _CHUNK])
      except TypeError:  # a dtype without a notion of finite
        break
      n = int(np.count_nonzero(wrong))
      if n and first is None:
        first = at + int(np.argmax(wrong))
      bad += n
    if bad:
      where = [int(i) for i in np.unravel_index(first, v.shape)] if v.ndim else []
      out.append(f"{name}: {bad} of {v.size} values NaN or infinite, the first "
                 f"{flat[first]} at {where}")
  return out


def refuse_nonfinite(params: dict[str, np.ndarray], what: str, where: str, fix: str) -> None:
  """E-INIT-001 naming each tensor of `params` that holds NaN or infinity, when any does."""
  bad = nonfinite(params)
  if bad:
    raise SxError("E-INIT-001", f"{what}: {len(bad)} tensor{'s hold' if len(bad) != 1 else ' holds'} "
                  "NaN or infinity, so a model made from them cannot train:\n    "
                  + "\n    ".join(bad[:12]) + (f"\n    and {len(bad) - 12} more"
                                               if len(bad) > 12 else ""),
                  where=where, fix=fix)


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
  from sexpgpu.ir.lora import apply  # LoRA's adapters, as the loss's graph has them
  g = rewrite(apply(g, exp.run.get("lora"), strict=False), patterns)[0]
  from sexpgpu.ir.mup import follow  # μP's output multiplier, as the loss's graph has it
  return follow(g, c.stages[0].graph, exp.optimizer)


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

"""`sexpgpu generate`: a `defgenerate` program of the trained functions, run from a checkpoint.

`(defgenerate NAME :fn F :every N [:seed S])` names F, a function of no arguments: a
sampling loop written in `.sx` (steps as `scan` or `repeat`, random draws from the key of
the seed). Its graph is built as a pass metric's is, so every function the loss calls reads
its trained parameters whoever calls it (front/homes.py), and a parameter only F would
create is an error. The outputs are written as one `.npz`; an output shaped as images
[b h w c] with c 1 or 3 also as a PNG grid beside it.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from sexpgpu.errors import SxError


def decl(c, fn: str | None):
  """The defgenerate to run: the one named by `fn` (a defgenerate or its :fn), or the only one.

  Raises:
    SxError: E-GEN-001 when the experiment has none, or several and `fn` names none of them.
  """
  found = c.exp.generates
  if fn is not None:
    for d in found.values():
      if fn in (d.name, d.fn):
        return d
    return None  # a function of the experiment without a defgenerate: the seed is 0
  if len(found) == 1:
    return next(iter(found.values()))
  names = ", ".join(sorted(found)) or "none"
  raise SxError("E-GEN-001", f"which program to generate with: the experiment's defgenerate "
                f"forms are {names}", where="--fn",
                fix="write (defgenerate NAME :fn F :every N) for a function F of no arguments, "
                "or pass --fn F" if not found else f"pass --fn with one of {names}")


def graph(c, fn: str):
  """The graph of `(F)`, its outputs `out` (a tensor) or `out0`, `out1`, ... (a vector).

  Raises:
    SxError: E-GEN-001 when F is no function of no arguments of the experiment, or returns
      no tensor; E-PARAM-001 / E-RUN-002 from the parameters it reads.
  """
  from sexpgpu.front.build import is_tensor
  from sexpgpu.front.values import Closure
  from sexpgpu.ir.graph import Graph
  from sexpgpu.reader.read import read_text
  exp = c.exp
  try:
    closure = exp.env.lookup(fn)
  except KeyError:
    closure = None
  if not isinstance(closure, Closure) or closure.params:
    raise SxError("E-GEN-001", f"`{fn}` is not a function of no arguments of this experiment",
                  where="--fn", fix=f"(defn {fn} [] ...) returning the tensors it generates, "
                  "named by (defgenerate NAME :fn F :every N)")
  b = exp.builder()
  b.params = dict(c.params)
  (form,) = read_text(f"(fn [batch] ({fn}))", "<generate>")
  g, out = b.build(f"generate/{fn}", b.eval(form, exp.env), {}, allow_new_params=False)
  outs = {"out": out} if is_tensor(out) else (
      {f"out{i}": o for i, o in enumerate(out)}
      if isinstance(out, tuple) and out and all(map(is_tensor, out)) else None)
  if outs is None:
    raise SxError("E-GEN-001", f"`({fn})` returns {type(out).__name__}, not a tensor or a "
                  "vector of tensors", where="--fn", fix=f"make `{fn}` return the generated "
                  "tensor, such as images [b h w c]")
  return Graph(g.name, g.inputs, outs, g.params, g.taps)


class Program:
  """`(F)` compiled once: called with the graph's parameters (device or host arrays, by the
  checkpoint's paths) and a seed, it returns F's outputs as numpy arrays.

  Raises:
    SxError: as `graph` does, when made.
  """

  def __init__(self, c, fn: str):
    from sexpgpu.ir.ops import LowerCtx
    from sexpgpu.lower.interp import run_graph
    self.fn = fn
    self.graph = g = graph(c, fn)
    from sexpgpu.lower.fp8 import patterns
    ctx = LowerCtx(str(c.exp.run["precision"]), None, False, fp8_only=patterns(c.exp.run))
    self._f = jax.jit(lambda prm, key: run_graph(g, prm, {}, dataclasses.replace(ctx, rng=key)))
    self._compiled = None  # at the first call, so a caller can time the calls apart

  def compile(self, params: dict) -> None:
    """Compiles F for parameters shaped as `params` (once; later calls do nothing)."""
    if self._compiled is None:
      self._compiled = self._f.lower({k: params[k] for k in self.graph.params},
                                     jax.random.key(0)).compile()

  def __call__(self, params: dict, seed: int) -> dict[str, np.ndarray]:
    """F's outputs with `params` (device arrays as the graph reads them), draws from key(seed)."""
    self.compile(params)
    out = self._compiled({k: params[k] for k in self.graph.params}, jax.random.key(seed))
    return {k: np.asarray(v) for k, v in out.items()}


def run(c, fn: str, params: dict, seed: int) -> dict[str, np.ndarray]:
  """The outputs of `(F)` with the checkpoint's parameters, its draws from key(seed)."""
  from sexpgpu.models import forward
  return Program(c, fn)(forward.device_params(c, params), seed)


def is_images(a: np.ndarray) -> bool:
  """[b h w c] with c 1 or 3, floats."""
  return a.ndim == 4 and a.shape[-1] in (1, 3) and np.issubdtype(a.dtype, np.floating)


def grid(a: np.ndarray) -> np.ndarray:
  """Images [b h w c] as one uint8 picture, ceil(sqrt(b)) a row, a pixel between: values in
  [0, 1] as they are, in [-1, 1] from (x + 1) / 2, else their own range to [0, 1]."""
  a = np.nan_to_num(a.astype(np.float32))
  lo, hi = float(a.min()), float(a.max())
  if lo < 0 and lo >= -1 and hi <= 1:
    a = (a + 1) / 2
  elif lo < 0 or hi > 1:
    a = (a - lo) / max(hi - lo, 1e-12)
  b, h, w, ch = a.shape
  cols = math.ceil(math.sqrt(b))
  rows = math.ceil(b / cols)
  out = np.ones((rows * (h + 1) + 1, cols * (w + 1) + 1, ch), np.float32)
  for i in range(b):
    r, q = divmod(i, cols)
    out[1 + r * (h + 1):1 + r * (h + 1) + h, 1 + q * (w + 1):1 + q * (w + 1) + w] = a[i]
  return np.round(np.clip(out, 0, 1) * 255).astype(np.uint8)


def write(outputs: dict[str, np.ndarray], path: str) -> list[str]:
  """`path` (.npz added when missing) holding the outputs, and a PNG grid beside it for each
  output shaped as images; each written whole (a temporary file renamed) or not at all.

  Returns:
    the files written.
  """
  from PIL import Image
  if not path.endswith(".npz"):
    path += ".npz"
  folder = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise SxError("E-GEN-001", f"-o {path}: cannot make the folder {folder} ({e.strerror})",
                  where="-o", fix="give -o a file in a folder you can write") from None
  written = []

  def save(target: str, writer) -> None:
    tmp = target + ".tmp"
    try:
      with open(tmp, "wb") as f:
        writer(f)
      os.replace(tmp, target)
    except OSError as e:
      raise SxError("E-GEN-001", f"cannot write {target} ({e.strerror})", where="-o",
                    fix="give -o a writable file path (OUT.npz)") from None
    written.append(target)

  save(path, lambda f: np.savez(f, **outputs))
  stem = path[:-len(".npz")]
  images = [k for k, v in outputs.items() if is_images(v)]
  for k in images:
    target = stem + ".png" if len(images) == 1 else f"{stem}.{k}.png"
    pic = grid(outputs[k])
    pic = pic[..., 0] if pic.shape[-1] == 1 else pic
    save(target, lambda f, pic=pic: Image.fromarray(pic).save(f, format="PNG"))
  return written

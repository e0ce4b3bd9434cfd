"""Lowering for CUDA on any machine: GPU probes answered as a CUDA machine would, calls counted.

XLA lowers for a platform that is not present
(`jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`), giving the
StableHLO a CUDA run would compile. The one question cuDNN's lowering asks of
the machine is the installed cuDNN version: the `[cuda]` extra answers it where
installed; elsewhere the version `jax[cuda13]` 0.10.2 installs is assumed, and
`cudnn_source()` says which.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import re

import jax

# cuDNN 9.28.1: what `check_cudnn_version()` answered with the jax-cuda13-plugin and
# nvidia-cudnn-cu13 wheels of jax[cuda13]==0.10.2 installed (no GPU needed to ask).
ASSUMED_CUDNN = 92801
# The one jax module outside its public API that sexpgpu touches: where cuDNN attention's
# lowering asks `check_cudnn_version()`. No public API answers or stands in for it, and
# cross-lowering cannot do without it. Reached by name, for this one purpose only; when a
# jax release moves it, `cudnn_answered` stands nothing in and says so (`cudnn_source`).
CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
_CALL = re.compile(r"custom_call\s*@([\w$.\-]+)")


@functools.cache
def cuda_present() -> bool:
  """Whether this process can open a CUDA device (then probes compile for real)."""
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


def _fused():
  """jax's cuDNN attention module, or None when this jax has it elsewhere."""
  try:
    module = importlib.import_module(CUDNN_MODULE)
  except ImportError:
    return None
  return module if hasattr(module, "check_cudnn_version") else None


def _installed_cudnn() -> int | None:
  fused = _fused()
  try:
    return int(fused.check_cudnn_version()) if fused is not None else None
  except RuntimeError:  # "cuDNN is not detected": no [cuda] extra here
    return None


def cudnn_source() -> str:
  """The cuDNN version cross-lowering uses, and whether it is installed or assumed."""
  if _fused() is None:
    return f"cuDNN's version not asked: this jax has no {CUDNN_MODULE}"
  got = _installed_cudnn()
  version = got if got is not None else ASSUMED_CUDNN
  text = f"cuDNN {version // 10000}.{version // 100 % 100}.{version % 100}"
  return f"{text} installed" if got is not None else f"{text} assumed (jax[cuda13] 0.10.2's)"


@contextlib.contextmanager
def cudnn_answered():
  """Inside: cuDNN's lowering is told a version even where no cuDNN is installed."""
  fused = _fused()
  if fused is None or _installed_cudnn() is not None:
    yield
    return
  asked = fused.check_cudnn_version
  fused.check_cudnn_version = lambda: ASSUMED_CUDNN
  try:
    yield
  finally:
    fused.check_cudnn_version = asked


def lower_for_cuda(fn, *args):
  """`fn` (a function or a jitted one) traced for `args` and lowered for CUDA.

  Returns:
    the jax `Lowered`; `.as_text()` is its StableHLO.
  """
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  with cudnn_answered():
    return jitted.trace(*args).lower(lowering_platforms=("cuda",))


def probe(fn, *args) -> None:
  """Raises what building `fn` for a GPU raises: compiled on a CUDA machine, else lowered
  for CUDA (Triton's own limits then show only on a GPU, so kernels state theirs)."""
  if cuda_present():
    # on a CUDA device even where the process's default is the CPU (`check --target cuda`
    # run on a GPU machine): an abstract argument lowers for the default device
    with jax.default_device(jax.devices("cuda")[0]):
      jax.jit(fn).lower(*args).compile()
  else:
    lower_for_cuda(fn, *args)


def custom_calls(text: str) -> dict[str, int]:
  """How many custom calls of each target StableHLO text holds."""
  return dict(collections.Counter(_CALL.findall(text)))


def sharding_rules(text: str) -> int:
  """How many custom calls carry a Shardy sharding rule (`sdy.sharding_rule`)."""
  return text.count("sdy.sharding_rule")

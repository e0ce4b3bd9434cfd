"""Convolution and pooling, channels last: CNNs, ViT stems, Mamba's causal depthwise conv1d.

A tensor is [batch, s1 .. sn, channels] with 1 to 3 spatial axes; a kernel is
[k1 .. kn, in / groups, out] (XLA's HWIO).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu.ir.opdef import REQUIRED, Attr, register

_LAYOUTS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"),
            3: ("NDHWC", "DHWIO", "NDHWC")}


def _spatial(x) -> int:
  n = x.ndim - 2
  if n not in _LAYOUTS:
    raise ValueError(f"takes [batch, 1 to 3 spatial axes, channels]; X has {x.ndim} axes")
  return n


def _per_axis(v, n: int, what: str) -> tuple[int, ...]:
  vs = (v,) * n if isinstance(v, int) else tuple(v)
  if len(vs) != n or any(not isinstance(d, int) or d < 1 for d in vs):
    raise ValueError(f"{what} {list(vs)} must be {n} positive size(s), one a spatial axis")
  return vs


def _padding(padding, n: int, window: tuple[int, ...], dilation: tuple[int, ...]):
  """lax's padding: "VALID", "SAME" or explicit (lo, hi) pairs of the spatial axes."""
  if isinstance(padding, str):
    if padding in ("valid", "same"):
      return padding.upper()
    if padding == "causal":
      if n != 1:
        raise ValueError("causal padding takes one spatial axis (time)")
      return ((dilation[0] * (window[0] - 1), 0),)
    raise ValueError(f'padding "{padding}" is not "valid", "same", "causal" or [[lo hi] ...]')
  pairs = tuple(tuple(p) for p in padding)
  if len(pairs) != n or any(len(p) != 2 or min(p) < 0 for p in pairs):
    raise ValueError(f"padding needs {n} [lo hi] pair(s) of non-negative sizes")
  return pairs


@register("conv", ("x", "w"), "convolution, channels last: X [b, s.., c_in], W [k.., c_in/groups,"
          " c_out]", (Attr("stride", "ints", 1, "steps between windows, a spatial axis"),
                      Attr("padding", "padding", "valid", "how the edges are padded"),
                      Attr("dilation", "ints", 1, "the kernel's spacing, a spatial axis"),
                      Attr("groups", "int", 1, "channel groups (c_in for a depthwise conv)")),
                      kind="product")
def _conv(ctx, x, w, *, stride, padding, dilation, groups):
  n = _spatial(x)
  if w.ndim != n + 2:
    raise ValueError(f"W has {w.ndim} axes; a conv over {n} spatial axes takes {n + 2}")
  if groups < 1 or x.shape[-1] % groups or w.shape[-1] % groups:
    raise ValueError(f"groups {groups} must divide the channels in ({x.shape[-1]}) and out "
                     f"({w.shape[-1]})")
  if w.shape[-2] * groups != x.shape[-1]:
    raise ValueError(f"W's input channels {w.shape[-2]} × groups {groups} must equal X's "
                     f"channels {x.shape[-1]}")
  stride, dilation = _per_axis(stride, n, "stride"), _per_axis(dilation, n, "dilation")
  pad = _padding(padding, n, tuple(w.shape[:n]), dilation)
  ct = ctx.compute_dtype(x)
  out = jax.lax.conv_general_dilated(
      x.astype(ct), w.astype(ct), window_strides=stride, padding=pad, rhs_dilation=dilation,
      dimension_numbers=_LAYOUTS[n], feature_group_count=groups,
      preferred_element_type=jnp.float32)
  return out.astype(jnp.result_type(x, w))


_POOL = (Attr("window", "ints", REQUIRED, "the window, a spatial axis"),
         Attr("stride", "ints", None, "steps between windows (default: the window)"),
         Attr("padding", "padding", "valid", '"valid", "same" or [[lo hi] ...]'))


def _pool(x, window, stride, padding, init, op):
  n = _spatial(x)
  window = _per_axis(window, n, "window")
  stride = window if stride is None else _per_axis(stride, n, "stride")
  if padding == "causal":
    raise ValueError("pooling takes padding \"valid\", \"same\" or [[lo hi] ...]")
  pad = _padding(padding, n, window, (1,) * n)
  if not isinstance(pad, str):
    pad = ((0, 0),) + pad + ((0, 0),)
  # the init a NumPy scalar, not a traced one: under jit JAX tells a max or a sum window
  # (and so its gradient) only by a known init
  return jax.lax.reduce_window(x, np.array(init, x.dtype), op, (1,) + window + (1,),
                               (1,) + stride + (1,), pad), window


@register("max-pool", ("x",), "the maximum of each window of the spatial axes (channels last)",
          _POOL, kind="window")
def _max_pool(ctx, x, *, window, stride, padding):
  return _pool(x, window, stride, padding, -jnp.inf, jax.lax.max)[0]


@register("avg-pool", ("x",), "the mean of each window of the spatial axes (channels last;"
          " padding counts as zeros)", _POOL, kind="window")
def _avg_pool(ctx, x, *, window, stride, padding):
  total, window = _pool(x, window, stride, padding, 0.0, jax.lax.add)
  return total / math.prod(window)

"""What the decoding tests share: a model decoded one position a step against its forward."""

import jax
import jax.numpy as jnp
import numpy as np

from sexpgpu.ir.ops import LowerCtx
from sexpgpu.models import decode, forward, source


def incremental_against_full(c, fn: str, params, window: int, vocab: int, seed: int,
                             prompt: int = 3):
  """A prompt of `prompt` tokens prefilled (padded past its end, as `sample` pads it), then
  one position a step to the window's end.

  Returns:
    (the largest difference from the full forward's logits at any position, the shapes of
    the state kept after the last step).
  """
  pl = decode.plan(source.logits_graph(c, fn, window), window)
  toks = np.random.RandomState(seed).randint(0, vocab, (1, window)).astype(np.int32)
  full = np.asarray(forward.forward(c, fn, window)(params, toks))
  ctx = LowerCtx("f32")
  buf = np.zeros((1, 8), np.int32)
  buf[0, :prompt] = toks[0, :prompt]
  empty = decode.empty_cache(pl, params, ctx)
  logits, cache = jax.jit(lambda p, t, c: decode.run(pl, p, t, ctx, c, jnp.int32(0), prompt))(
      params, buf, empty)
  got = [np.asarray(logits)[0, i] for i in range(prompt)]
  step = jax.jit(lambda p, t, cache, o: decode.run(pl, p, t, ctx, cache, o))
  for i in range(prompt, window):
    logits, cache = step(params, toks[:, i:i + 1], cache, jnp.int32(i))
    got.append(np.asarray(logits)[0, 0])
  return (float(np.abs(np.stack(got) - full[0]).max()),
          {a.shape for a in jax.tree_util.tree_leaves(cache)})

"""The two ways to write an FSDP step, timed against each other on the same devices.

Usage:
  python benchmarks/bench_fsdp_styles.py [--devices 4] [--width 1024] [--layers 4]
                                         [--batch 256] [--steps 20] [--rounds 5]

An MLP of `layers` square layers with adam, its parameters and moments split over N XLA
host devices on their first axis, the batch split over the same devices:

- `jit`: one global program; each array placed by a NamedSharding, XLA's partitioner
  inserts the gathers and reduce-scatters. Written as lower/fsdp.py writes the step: a
  vmap over ranks of each rank's gradient, summed into the parameters' shardings.
- `shard_map`: each device's program written out: all_gather of a layer's weight before
  use, psum_scatter of its gradient, adam on the local shards.

A leg's time is the median step after one warm-up step; the ratio is the median of the
rounds' paired ratios shard_map ÷ jit (above 1: jit is faster). The final parameters of
the two are compared, so the programs are the same computation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--devices", type=int, default=4)
  ap.add_argument("--width", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--rounds", type=int, default=5)
  a = ap.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={a.devices}").strip()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:a.devices]), ("d",))
  split = NamedSharding(mesh, P("d"))
  opt = optax.adam(1e-3)
  rng = np.random.default_rng(0)
  params0 = [rng.standard_normal((a.width, a.width), np.float32) / np.sqrt(a.width)
             for _ in range(a.layers)]
  x = jax.device_put(rng.standard_normal((a.batch, a.width), np.float32), split)
  y = jax.device_put(rng.standard_normal((a.batch, a.width), np.float32), split)

  def loss_of(ws, x, y):
    h = x
    for w in ws:
      h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)

  # jit: the global program, placed by NamedShardings. As lower/fsdp.py writes it, the
  # batch is [ranks, batch/ranks, ...] and each rank's gradient comes from a vmap over
  # ranks, summed over them into the parameters' shardings.
  n = a.devices

  def jit_step(ws, state, x, y):
    xr, yr = x.reshape((n, -1) + x.shape[1:]), y.reshape((n, -1) + y.shape[1:])
    g = jax.vmap(jax.grad(lambda ws, x, y: loss_of(ws, x, y) / n), (None, 0, 0))(ws, xr, yr)
    g = [jax.lax.with_sharding_constraint(jnp.sum(gi, 0), split) for gi in g]
    updates, state = opt.update(g, state, ws)
    return optax.apply_updates(ws, updates), state

  jit_fn = jax.jit(jit_step, donate_argnums=(0, 1))

  # shard_map: each device's program, its collectives written out

  def local_step(ws, state, x, y):
    full = [jax.lax.all_gather(w, "d", tiled=True) for w in ws]

    def local_loss(full):
      return loss_of(full, x, y) / n  # the mean over the whole batch: each device's share

    g = jax.grad(local_loss)(full)
    g = [jax.lax.psum_scatter(gi, "d", scatter_dimension=0, tiled=True) for gi in g]
    updates, state = opt.update(g, state, ws)
    return optax.apply_updates(ws, updates), state

  def specs(tree):
    return jax.tree_util.tree_map(lambda v: P("d") if np.ndim(v) == 2 else P(), tree)

  def fresh():
    ws = [jax.device_put(w, split) for w in params0]
    state = opt.init(ws)
    state = jax.tree_util.tree_map(
        lambda v: jax.device_put(v, split if np.ndim(v) == 2 else NamedSharding(mesh, P())),
        state)
    return ws, state

  ws, state = fresh()
  shard_fn = jax.jit(jax.shard_map(local_step, mesh=mesh,
                                   in_specs=(specs(ws), specs(state), P("d"), P("d")),
                                   out_specs=(specs(ws), specs(state)), check_vma=False),
                     donate_argnums=(0, 1))

  def leg(fn):
    ws, state = fresh()
    ws, state = fn(ws, state, x, y)  # compile and warm up
    jax.block_until_ready(ws)
    times = []
    for _ in range(a.steps):
      t = time.perf_counter()
      ws, state = fn(ws, state, x, y)
      jax.block_until_ready(ws)
      times.append(time.perf_counter() - t)
    return statistics.median(times), ws

  runs = {"jit": [], "shard_map": []}
  finals = {}
  for r in range(a.rounds):
    for name in (("jit", "shard_map") if r % 2 == 0 else ("shard_map", "jit")):
      t, ws = leg(jit_fn if name == "jit" else shard_fn)
      runs[name].append(t)
      finals[name] = [np.asarray(w) for w in ws]
  diff = max(float(np.max(np.abs(p - q))) for p, q in zip(finals["jit"], finals["shard_map"]))
  ratios = [s / j for s, j in zip(runs["shard_map"], runs["jit"])]
  for name, ts in runs.items():
    print(f"{name:10} median step {statistics.median(ts) * 1e3:.2f} ms over {a.rounds} rounds")
  print(f"ratio shard_map/jit over {a.devices} host devices, width {a.width} x {a.layers} "
        f"layers, batch {a.batch}: step {statistics.median(ratios):.3f} (median of "
        f"{len(ratios)} rounds, {min(ratios):.2f}..{max(ratios):.2f}); final parameters max "
        f"|difference| {diff:.1e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

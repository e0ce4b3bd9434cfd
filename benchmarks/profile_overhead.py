"""Where sexpgpu's per-step time goes, next to the hand-written JAX step (one process).

Usage: python benchmarks/profile_overhead.py [--shape tiny|compute] [--steps N]

Times, interleaved in rounds, the pieces of one iteration of
sexpgpu/run/loop.py's loop (without its batch thread): drawing and stacking the microbatches, the
device_put, the compiled step (AOT executable vs the same function through
jax.jit), the metric fetch, the step event and the status update; and the
hand-written JAX step with its layers unrolled and scanned. Prints the median
microseconds of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402


def _stack(batches: list[dict]) -> dict:
  """The loop's stacking of a step's microbatches (run/loop.py's _draw)."""
  import numpy as np
  return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def main() -> int:
  """Runs the profile and prints one line a piece."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="tiny", choices=list(bt.SHAPES))
  ap.add_argument("--steps", type=int, default=300)
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import sexpgpu
  from sexpgpu.lower.init import init_params
  from sexpgpu.lower.optim import make_optimizer
  from sexpgpu.lower.step import TrainStep, init_state
  shape = bt.SHAPES[a.shape]
  k = shape["microbatches"]
  exp = sexpgpu.compile(bt.SX, set=shape)
  c = exp._c
  loader = c.loaders["train"]
  opt, sched = make_optimizer(c.exp.optimizer, 100)
  st = TrainStep(c.stages[0].graph, opt, sched, "f32", k, k, 1, "stop", (), platform="cpu")
  state = init_state(init_params(1, c.params), opt)
  b0 = jax.device_put(_stack([loader.next() for _ in range(k)]))
  st.compile(jax.eval_shape(lambda: state), jax.eval_shape(lambda: b0))
  jit_state = init_state(init_params(1, c.params), opt)

  # the hand-written step, unrolled and scanned over layers
  tmp = tempfile.mkdtemp()
  bt.write_init(shape, os.path.join(tmp, "i.npz"))
  init = dict(np.load(os.path.join(tmp, "i.npz")))
  bopt = optax.adamw(1e-3, weight_decay=0.0)

  def make(unroll):
    def loss_fn(p, tokens):
      logits = bt.jax_model(p, tokens[:, :-1], shape["heads"], unroll)
      t = tokens[:, 1:]
      return jnp.mean(jax.nn.logsumexp(logits, -1)
                      - jnp.take_along_axis(logits, t[..., None], -1)[..., 0])

    def step(s, batches):
      params, o = s

      def body(acc, tokens):
        lg = jax.value_and_grad(loss_fn)(params, tokens)
        return jax.tree_util.tree_map(jnp.add, acc, lg), None
      (loss, g), _ = jax.lax.scan(body, (jnp.float32(0), jax.tree_util.tree_map(jnp.zeros_like,
                                                                              params)), batches)
      u, o = bopt.update(jax.tree_util.tree_map(lambda x: x / k, g), o, params)
      return (optax.apply_updates(params, u), o), loss / k
    return jax.jit(step, donate_argnums=(0,))

  base = {"unroll": make(True), "scan": make(False)}
  bstate = {n: (jax.device_put(init), bopt.init(jax.device_put(init))) for n in base}
  tok = jax.device_put(_stack([loader.next() for _ in range(k)]))["tokens"]

  from sexpgpu.track.metrics import open_metrics
  from sexpgpu.track.status import StatusFile
  metrics = open_metrics("jsonl:" + os.path.join(tmp, "m.jsonl"), "profile")
  status = StatusFile(None)
  steps_seen: list[float] = []

  def event(m):
    ev = {"train/loss": float(m["loss"]), "train/lr": float(m["lr"]),
          "train/grad-norm": float(m["grad_norm"]), "time/step": 1e-3,
          "throughput/tokens-per-second": 1.0, "throughput/mfu": None, "counters": {"records": 1}}
    metrics.emit("step", step=1, **ev)

  def status_update():
    steps_seen.append(1e-3)
    sps = 1.0 / max(float(np.median(steps_seen[-20:])), 1e-9)
    status.maybe_update(time.time(), state="running", step=1, train_loss=1.0, last_pass={},
                        counters={}, steps_per_second=sps, eta_seconds=1.0)
  times: dict[str, list[float]] = {}

  def timed(name, fn):
    t = time.perf_counter()
    out = fn()
    times.setdefault(name, []).append(time.perf_counter() - t)
    return out

  for _ in range(a.steps):
    mbs = timed("draw: loader.next() x K", lambda: [loader.next() for _ in range(k)])
    stacked = timed("np.stack (_stack)", lambda: _stack(mbs))
    batches = timed("jax.device_put(batch)", lambda: jax.device_put(stacked))
    state, m = timed("compiled step: AOT _fused_exec, dispatch", lambda: st(state, batches))
    timed("  ... wait (block_until_ready)", lambda: jax.block_until_ready(m))
    mh = timed("  ... the metrics vector to the host", lambda: dict(zip(
        st.step_names, np.asarray(m).tolist())))
    timed("host: bool(finite)+float()s+metrics.emit(step) jsonl", lambda: (bool(mh["finite"]),
                                                                          event(mh)))
    timed("host: set_status(force=False) incl. np.median", status_update)
    jit_state, m2 = timed("same fn via jax.jit, dispatch+wait", lambda: jax.block_until_ready(
        st._fused(jit_state, batches, {})))  # {}: no rates as arguments (no recipe)
    for n, f in base.items():
      bstate[n], l = timed(f"baseline ({n} layers), dispatch+wait",
                           lambda: jax.block_until_ready(f(bstate[n], batches["tokens"])))
      timed(f"baseline ({n}) float(loss)", lambda: float(jax.device_get(l)))
  print(f"shape {a.shape}; median microseconds over {a.steps} interleaved iterations")
  for n, ts in times.items():
    print(f"{statistics.median(ts) * 1e6:10.1f}  {n}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

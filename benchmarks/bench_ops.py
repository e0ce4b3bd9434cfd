"""Layers of the op table against hand-written JAX twins: MoE, linear recurrence, linear
attention by cumsum, a CNN.

Usage:
  python benchmarks/bench_ops.py [--quick] [--cases moe,recurrence,linear-attention,cnn]
                                 [--rounds R] [--iters N] [--json F]

Each case is a small `.sx` loss (the layer, then a scalar of its output) compiled by
sexpgpu, and the same math written by hand in JAX over the same parameter dict. Both legs
are `jax.jit(jax.value_and_grad(loss))` of the parameters: the sexpgpu leg evaluates the
compiled graph with `sexpgpu.lower.interp.run_graph`, the twin is plain JAX. The two must
agree (loss to 1e-5 relative, every gradient to 1e-4 of its largest entry: asserted), so
the twin is the same computation. Each leg is compiled and run once to warm up, then the
rounds alternate the order of the legs; a round times N calls of each leg, each waited for,
and keeps their median. The figure is the median over rounds of twin time / sexpgpu time:
1.0 is parity, above 1 sexpgpu is faster; the goal is ≥ 0.95 for each case. Beside it,
XLA's cost analysis of both executables (flops, bytes accessed) and their instruction
counts: on a busy machine the times scatter, the work each executable does does not.

  moe               std/moe.sx's `moe` (router, top-2 of 8 experts, capacity factor 1.25,
                    one-hot/cumsum dispatch, SwiGLU experts [e d h], combine) + its
                    load-balancing and z-losses
  recurrence        configs/ssm-lm.sx's `recurrence`: in-projection, causal depthwise conv1d,
                    input-dependent decay, `linear-recurrence` (an associative scan), gate,
                    out-projection
  linear-attention  causal linear attention (relu feature maps) by `cumsum` of k ⊗ v and of k
  cnn               configs/cnn.sx's model and cross-entropy on 12x12 images
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sexpgpu  # noqa: E402
from sexpgpu.ir.ops import LowerCtx  # noqa: E402
from sexpgpu.lower.init import init_params  # noqa: E402
from sexpgpu.lower.interp import run_graph  # noqa: E402

HEAD = "(require std/nn)\n(require std/moe)\n"
TAIL = "(defrun :loss loss :data train :steps 1 :optimizer (sgd :lr 0.1) :precision f32)\n"


def _loader(fields: str) -> str:
  return f'(defloader train (arrays "{{npz}}" :fields [{fields}] :batch {{b}} :shuffle false))\n'


# --- the cases: (.sx text, twin, input arrays) ---------------------------------------------
MOE_SX = """
(defn loss [batch]
  (let [[y balance z] (moe (get batch :x) :experts {e} :k 2 :factor 1.25 :hidden {h})]
    (+ (mean (square y)) (* 0.01 balance) (* 0.001 z))))
"""


def moe_twin(p, x, *, e, h):
  b, t, d = x.shape
  n, k = b * t, 2
  xs = x.reshape(n, d)
  logits = xs @ p["moe/router/w"]
  cap = int(np.ceil(1.25 * k * n / e))
  probs = jax.nn.softmax(logits, -1)
  top, idx = jax.lax.top_k(probs, k)
  gates = top / top.sum(-1, keepdims=True)
  choice = jax.nn.one_hot(idx, e, dtype=jnp.float32)                   # [n k e]
  order = choice.transpose(1, 0, 2).reshape(k * n, e)
  before = ((jnp.cumsum(order, 0) - order) * order).sum(-1)
  slot = before.astype(jnp.int32).reshape(k, n).T                       # [n k]
  slots = jax.nn.one_hot(slot, cap, dtype=jnp.float32) * (slot < cap)[..., None]
  dispatch = jnp.einsum("nke,nkc->nec", choice, slots)
  combine = jnp.einsum("nke,nkc,nk->nec", choice, slots, gates)
  fraction = choice.sum(1).mean(0) / k
  balance = e * jnp.sum(fraction * probs.mean(0))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, -1)))
  xin = jnp.einsum("nec,nd->ecd", dispatch, xs)
  pre = "moe/moe-experts/"
  hid = (jax.nn.silu(jnp.einsum("ecd,edh->ech", xin, p[pre + "gate"]))
         * jnp.einsum("ecd,edh->ech", xin, p[pre + "up"]))
  out = jnp.einsum("ech,ehd->ecd", hid, p[pre + "down"])
  y = jnp.einsum("nec,ecd->nd", combine, out).reshape(b, t, d)
  return jnp.mean(jnp.square(y)) + 0.01 * balance + 0.001 * z


REC_SX = """
(defn recurrence [x]
  (let [[b t d] (shape x)
        e (* 2 d)
        [v gate] (split (dense x (* 2 e) :as in) 2 -1)
        v (silu (+ (conv v (param conv [4 1 e] :init (fan-in 1.0)) :padding "causal" :groups e)
                   (param conv-bias [e] :init (normal 0.1))))
        a (sigmoid (+ (dense v e :as decay) (param decay-bias [e] :init (constant 2.0))))
        h (linear-recurrence a (* (- 1.0 a) v) :axis 1)]
    (dense (* h (silu gate)) d :as out)))
(defn loss [batch] (mean (square (recurrence (get batch :x)))))
"""


def _combine(left, right):
  (a1, x1), (a2, x2) = left, right
  return a1 * a2, a2 * x1 + x2


def rec_twin(p, x):
  d = x.shape[-1]
  e = 2 * d
  pre = "recurrence/"
  v, gate = jnp.split(x @ p[pre + "in/w"], 2, -1)
  v = jax.lax.conv_general_dilated(v, p[pre + "conv"], (1,), ((3, 0),),
                                   dimension_numbers=("NWC", "WIO", "NWC"),
                                   feature_group_count=e)
  v = jax.nn.silu(v + p[pre + "conv-bias"])
  a = jax.nn.sigmoid(v @ p[pre + "decay/w"] + p[pre + "decay-bias"])
  h = jax.lax.associative_scan(_combine, (a, (1.0 - a) * v), axis=1)[1]
  return jnp.mean(jnp.square((h * jax.nn.silu(gate)) @ p[pre + "out/w"]))


LIN_SX = """
(defn linear-attention [x :heads 4]
  (let [[b t d] (shape x)
        dh (/ d heads)
        split (fn [y] (reshape y [b t heads dh]))
        q (relu (split (dense x d :as q)))
        k (relu (split (dense x d :as k)))
        v (split (dense x d :as v))
        kv (cumsum (* (expand k 4) (expand v 3)) :axis 1)
        z (cumsum k :axis 1)
        num (sum (* (expand q 4) kv) 3)
        den (+ (sum (* q z) -1 :keep true) 1e-3)]
    (dense (reshape (/ num den) [b t d]) d :as o)))
(defn loss [batch] (mean (square (linear-attention (get batch :x)))))
"""


def lin_twin(p, x, heads=4):
  b, t, d = x.shape
  dh = d // heads
  pre = "linear-attention/"
  split = lambda y: y.reshape(b, t, heads, dh)  # noqa: E731
  q = jax.nn.relu(split(x @ p[pre + "q/w"]))
  k = jax.nn.relu(split(x @ p[pre + "k/w"]))
  v = split(x @ p[pre + "v/w"])
  kv = jnp.cumsum(k[..., :, None] * v[..., None, :], axis=1)
  z = jnp.cumsum(k, axis=1)
  num = (q[..., :, None] * kv).sum(3)
  den = (q * z).sum(-1, keepdims=True) + 1e-3
  return jnp.mean(jnp.square((num / den).reshape(b, t, d) @ p[pre + "o/w"]))


CNN_SX = """
(defn pool-2x2 [y]
  (let [[b h w c] (shape y)] (max-of (reshape y [b (/ h 2) 2 (/ w 2) 2 c]) [2 4])))
(defn conv-stage [x out]
  (let [w (param w [3 3 (dim x -1) out] :init (fan-in 1.4))]
    (pool-2x2 (relu (+ (conv x w :padding "same") (param b [out] :init (normal 0.1)))))))
(defn model [pixels]
  (let [x (/ (cast pixels f32) 255.0)
        h (conv-stage (conv-stage x {c} :as stage1) {c2} :as stage2)
        [b s1 s2 c] (shape h)]
    (dense (reshape h [b (* s1 s2 c)]) 4 :bias true :as head)))
(defn loss [batch] (cross-entropy (model (get batch :x)) (get batch :y)))
"""


def cnn_twin(p, x, y):
  def stage(h, pre):
    out = jax.lax.conv_general_dilated(h, p[pre + "w"], (1, 1), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"))
    out = jax.nn.relu(out + p[pre + "b"])
    b, hh, ww, c = out.shape
    return out.reshape(b, hh // 2, 2, ww // 2, 2, c).max(axis=(2, 4))
  h = stage(stage(x.astype(jnp.float32) / 255.0, "model/stage1/"), "model/stage2/")
  logits = h.reshape(h.shape[0], -1) @ p["model/head/w"] + p["model/head/b"]
  logp = jax.nn.log_softmax(logits, -1)
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], -1))


def cases(quick: bool) -> dict:
  """name → (sx text, twin(params, *inputs), {field: array})."""
  r = np.random.default_rng(0)
  f = np.float32
  if quick:
    b, t, d, e, h, img = 2, 16, 16, 4, 32, 8
  else:
    b, t, d, e, h, img = 8, 64, 64, 8, 128, 64
  x = lambda *s: r.normal(size=s).astype(f)  # noqa: E731
  pixels = r.integers(0, 256, size=(img, 12, 12, 1)).astype(np.int32)
  labels = r.integers(0, 4, size=(img,)).astype(np.int32)
  c = 4 if quick else 16
  return {
      "moe": (MOE_SX.format(e=e, h=h), lambda p, x: moe_twin(p, x, e=e, h=h),
              {"x": x(b, t, d)}),
      "recurrence": (REC_SX, rec_twin, {"x": x(b, 2 * t, d)}),
      "linear-attention": (LIN_SX, lin_twin, {"x": x(b // 2 or 1, 2 * t, d)}),
      "cnn": (CNN_SX.format(c=c, c2=2 * c), cnn_twin, {"x": pixels, "y": labels}),
  }


def build(name: str, sx: str, arrays: dict, tmp: str):
  """The compiled loss graph and initial parameters of one case."""
  npz = os.path.join(tmp, f"{name}.npz")
  np.savez(npz, **arrays)
  fields = " ".join(arrays)
  b = next(iter(arrays.values())).shape[0]
  text = HEAD + _loader(fields).format(npz=npz, b=b) + sx + TAIL
  exp = sexpgpu.compile_text(text, f"{name}.sx", base_dir=tmp)
  c = exp._c
  graph = c.stages[0].graph
  params = init_params(0, c.params)
  return graph, {k: jnp.asarray(v) for k, v in params.items()}


def legs(graph, twin, fields: list[str]):
  ctx = LowerCtx("f32", None, False)

  def sx_loss(p, *xs):
    return run_graph(graph, p, dict(zip(fields, xs)), ctx)["out"]

  return {"sexpgpu": jax.jit(jax.value_and_grad(sx_loss)),
          "jax": jax.jit(jax.value_and_grad(twin))}


def check(outs: dict) -> float:
  """Asserts the legs agree; returns the largest gradient difference over its scale."""
  (ls, gs), (lj, gj) = outs["sexpgpu"], outs["jax"]
  assert np.isclose(float(ls), float(lj), rtol=1e-5, atol=1e-7), (float(ls), float(lj))
  assert sorted(gs) == sorted(gj), (sorted(gs), sorted(gj))
  worst = 0.0
  for k in gs:
    a, b = np.asarray(gs[k]), np.asarray(gj[k])
    scale = max(np.abs(b).max(), 1e-12)
    worst = max(worst, float(np.abs(a - b).max() / scale))
  assert worst < 1e-4, worst
  return worst


def time_leg(fn, params, xs, iters: int) -> float:
  """The median seconds of `iters` calls, each waited for: robust to a busy machine's spikes."""
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params, *xs))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def cost(compiled) -> dict:
  """XLA's view of an executable: its flops and bytes (cost analysis), its instructions."""
  c = compiled.cost_analysis()
  c = c[0] if isinstance(c, list) else c
  text = compiled.as_text()
  return {"flops": float(c.get("flops", 0.0)), "bytes": float(c.get("bytes accessed", 0.0)),
          "instructions": len(re.findall(r"^\s*(?:ROOT )?%?[\w.-]+ = ", text, re.M))}


def run_case(name, sx, twin, arrays, rounds, iters, tmp) -> dict:
  graph, params = build(name, sx, arrays, tmp)
  fields = list(arrays)
  xs = [jnp.asarray(arrays[f]) for f in fields]
  fns, compile_s, outs, costs = {}, {}, {}, {}
  for leg, fn in legs(graph, twin, fields).items():
    t0 = time.perf_counter()
    fns[leg] = fn.lower(params, *xs).compile()  # ahead of time: what is timed is this
    compile_s[leg] = time.perf_counter() - t0
    outs[leg] = jax.block_until_ready(fns[leg](params, *xs))
    costs[leg] = cost(fns[leg])
  err = check(outs)
  times = {leg: [] for leg in fns}
  for r in range(rounds):
    order = list(fns) if r % 2 == 0 else list(fns)[::-1]
    for leg in order:
      times[leg].append(time_leg(fns[leg], params, xs, iters))
  ratios = [j / s for j, s in zip(times["jax"], times["sexpgpu"])]
  return {"case": name, "ratio": statistics.median(ratios), "min": min(ratios),
          "max": max(ratios), "sexpgpu_ms": 1e3 * statistics.median(times["sexpgpu"]),
          "jax_ms": 1e3 * statistics.median(times["jax"]), "grad_err": err,
          "compile_s": compile_s, "cost": costs, "loss": float(outs["sexpgpu"][0])}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds of 2 calls")
  ap.add_argument("--cases", default="moe,recurrence,linear-attention,cnn")
  ap.add_argument("--rounds", type=int, default=None)
  ap.add_argument("--iters", type=int, default=None)
  ap.add_argument("--json", default=None, help="write the results here")
  args = ap.parse_args(argv)
  rounds = args.rounds or (2 if args.quick else 9)
  iters = args.iters or (2 if args.quick else 20)
  table = cases(args.quick)
  names = [n for n in args.cases.split(",") if n]
  unknown = [n for n in names if n not in table]
  if unknown:
    ap.error(f"unknown cases {unknown}; the cases are {sorted(table)}")
  import tempfile
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    print(f"bench_ops: device {jax.devices()[0].platform} rounds {rounds} iters {iters}"
          f"{' quick' if args.quick else ''}")
    for n in names:
      res = run_case(n, *table[n], rounds, iters, tmp)
      results.append(res)
      print(f"{n:17s} twin/sexpgpu {res['ratio']:.3f} (range {res['min']:.3f}-"
            f"{res['max']:.3f})  sexpgpu {res['sexpgpu_ms']:.3f} ms  jax {res['jax_ms']:.3f} ms"
            f"  grad diff {res['grad_err']:.1e}", flush=True)
      cs, cj = res["cost"]["sexpgpu"], res["cost"]["jax"]
      print(f"{'':17s} XLA: flops {cs['flops'] / max(cj['flops'], 1):.4f}x the twin's, bytes "
            f"{cs['bytes'] / max(cj['bytes'], 1):.4f}x, instructions {cs['instructions']} vs "
            f"{cj['instructions']}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].platform, "rounds": rounds, "iters": iters,
                 "quick": args.quick, "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

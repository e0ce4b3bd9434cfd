"""Whether configs/ddpm.sx learns the shapes: a classifier trained on the same set
(configs/cnn.sx) labels the DDPM's DDIM samples, and its mean confidence (the softmax's
largest probability) is compared with chance (0.25, four shapes) and with the same
classifier on the samples of the untrained DDPM (the same sampler, step-0 parameters).

    python benchmarks/ddpm_classifier.py [--steps 600] [--samples 64] [--seed 0]

Prints one line per figure and a last `ddpm-classifier:` line. A benchmark, not a timed
test: it trains both models on the CPU (a few minutes).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _classify(cnn, cnn_params, images: np.ndarray) -> tuple[float, np.ndarray]:
  """The classifier's mean top probability on images [b 12 12 1] in [-1, 1], and how many
  of them it puts in each class."""
  pixels = np.clip(np.round((images + 1.0) * 127.5), 0, 255).astype(np.int32)
  logits = np.asarray(cnn.call("model", cnn_params, pixels), np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return float(p.max(-1).mean()), np.bincount(p.argmax(-1), minlength=4)


def main() -> None:
  """Trains the classifier and the DDPM, samples, and prints the figures."""
  import sexpgpu
  from sexpgpu.lower.init import init_params
  from sexpgpu.models import generate
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=600, help="the DDPM's training steps")
  ap.add_argument("--samples", type=int, default=64, help="images sampled")
  ap.add_argument("--seed", type=int, default=0, help="the sampler's key")
  ap.add_argument("--png", default=None, help="also write the samples' grid here (.npz, .png)")
  a = ap.parse_args()

  t = time.perf_counter()
  cnn = sexpgpu.compile(os.path.join(ROOT, "configs", "cnn.sx"))
  run = cnn.run()
  cnn_params = {k: np.asarray(v) for k, v in run.params.items()}
  print(f"classifier: configs/cnn.sx {run.steps} steps, valid accuracy "
        f"{run.eval['eval/accuracy']:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)

  t = time.perf_counter()
  ddpm = sexpgpu.compile(os.path.join(ROOT, "configs", "ddpm.sx"),
                         set={"samples": a.samples, "steps": a.steps})
  trained = ddpm.run()
  params = {k: np.asarray(v) for k, v in trained.params.items()}
  print(f"ddpm: configs/ddpm.sx {trained.steps} steps, train/loss {trained.train_loss:.4f} "
        f"({time.perf_counter() - t:.0f} s)", flush=True)

  c = ddpm._c
  program = generate.Program(c, "ddim-sample")
  untrained = {k: np.asarray(v) for k, v in init_params(int(c.exp.run["seed"]), c.params).items()}
  before, hist0 = _classify(cnn, cnn_params, program(untrained, a.seed)["out"])
  samples = program(params, a.seed)["out"]
  after, hist = _classify(cnn, cnn_params, samples)
  if a.png:
    generate.write({"out": samples}, a.png)
  print(f"untrained ddpm samples: mean confidence {before:.4f}, classes {hist0.tolist()}")
  print(f"trained ddpm samples:   mean confidence {after:.4f}, classes {hist.tolist()}")
  print(f"ddpm-classifier: {after:.4f} mean confidence on {a.samples} samples after "
        f"{trained.steps} steps (chance 0.25, untrained {before:.4f})")


if __name__ == "__main__":
  main()

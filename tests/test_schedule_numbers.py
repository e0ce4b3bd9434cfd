"""A learning rate's numbers (peak, warmup, length, floor) are arguments of the train step,
not constants compiled into it: another `--steps` or rate reuses the step's executable, and
gives the numbers a run made alone gives.

Each schedule is its numbers, worked out on the host as optax holds them, and a function of
them doing optax's operations (front/optimizers.py). Given Python numbers it is optax's
schedule bit for bit; given the step's traced copies it differs from the constant-folded
compile by a few float32 ulps of the peak at most (XLA folds `pi * t / T` into `t * (pi / T)` when
T is a constant), the same in every run that takes them as arguments."""

import itertools
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.front.optimizers import SCHEDULES

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _optax(name, peak, warmup, end, total, kw):
  """The optax schedule sexpgpu's made before its numbers became arguments."""
  if name == "warmup-cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(warmup, 1),
                                              max(total, warmup + 1), end_value=end)
  if name == "warmup-linear":
    return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                                 optax.linear_schedule(peak, end, max(total - warmup, 1))],
                                [warmup])
  decay = max(int(round(kw["decay-fraction"] * total)), 1)
  start = max(total - decay, warmup)
  down = (optax.cosine_decay_schedule(peak, max(total - start, 1), alpha=end / peak)
          if kw["shape"] == "cosine" else optax.linear_schedule(peak, end, max(total - start, 1)))
  return optax.join_schedules([optax.linear_schedule(0.0, peak, max(warmup, 1)),
                               optax.constant_schedule(peak), down], [warmup, start])


CASES = [(name, peak, warmup, floor, total, shape)
         for name, shape in (("warmup-cosine", None), ("warmup-linear", None),
                             ("warmup-stable-decay", "linear"), ("warmup-stable-decay", "cosine"))
         for peak, warmup, floor, total in itertools.product((1e-3, 0.02), (0, 7, 100),
                                                             (0.0, 1 / 3), (2, 101, 2000))
         if not (name == "warmup-cosine" and warmup == 0 and total < 2)]


@pytest.mark.parametrize("name", ["warmup-cosine", "warmup-linear", "warmup-stable-decay"])
def test_with_python_numbers_each_schedule_is_optaxs_bit_for_bit(name):
  """Across peaks, warmups, floors and lengths, at every step and past the end."""
  for _, peak, warmup, floor, total, shape in [c for c in CASES if c[0] == name]:
    kw = {"decay-fraction": 0.2, "shape": shape}
    counts = jnp.arange(total + 3)
    numbers = SCHEDULES[name].numbers(peak, warmup, peak * floor, total, kw)
    ours = jax.jit(jax.vmap(SCHEDULES[name].make(numbers, kw)))(counts)
    theirs = jax.jit(jax.vmap(_optax(name, peak, warmup, peak * floor, total, kw)))(counts)
    assert np.asarray(ours).tobytes() == np.asarray(theirs).tobytes(), (peak, warmup, floor,
                                                                         total, shape)


def test_with_traced_numbers_each_schedule_is_within_4_ulps_of_its_peak_of_the_constant_compile():
  for name, peak, warmup, floor, total, shape in CASES[::5] + [
      ("warmup-cosine", 1e-3, 0, 0.0, 30, None)]:
    kw = {"decay-fraction": 0.2, "shape": shape}
    counts = jnp.arange(total + 3)
    numbers = SCHEDULES[name].numbers(peak, warmup, peak * floor, total, kw)
    args = {k: np.int32(v) if isinstance(v, int) else np.float32(v) for k, v in numbers.items()}
    traced = jax.jit(lambda n: jax.vmap(SCHEDULES[name].make(n, kw))(counts))(args)
    folded = jax.jit(jax.vmap(SCHEDULES[name].make(numbers, kw)))(counts)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(folded), rtol=0,
                               atol=4 * float(np.spacing(np.float32(peak))))
  # the last case: XLA folds pi / 30 where the length is a constant, so a few steps differ
  assert not np.array_equal(np.asarray(traced), np.asarray(folded))


def _run(tmp_path, cache, name, *args):
  """`sexpgpu run` of tiny-lm under a warmup-cosine schedule, in its own process with its own
  caches; (its timing kernels line, the step events' losses and rates)."""
  exp = tmp_path / "cosine.sx"
  with open(TINY, encoding="utf-8") as f:
    text = f.read().replace(":lr lr", ":lr (warmup-cosine :peak lr :warmup 2 :floor 0.1)")
  exp.write_text(text)
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), SEXPGPU_CACHE_DIR=str(cache))
  metrics = tmp_path / f"{name}.jsonl"
  out = subprocess.run(sexpgpu_cmd("run", str(exp), "--checkpoint-dir", str(tmp_path / name),
                                   "--metrics", f"jsonl:{metrics}", *args),
                       capture_output=True, text=True, env=env, timeout=300, check=True)
  kernels = next(line for line in out.stderr.splitlines() + out.stdout.splitlines()
                 if line.startswith("timing kernels"))
  steps = [json.loads(line) for line in metrics.read_text().splitlines()]
  steps = [e for e in steps if e["kind"] == "step"]
  return kernels, [(e["train/loss"], e["train/lr"]) for e in steps]


def test_another_rate_and_length_reuse_the_step_and_train_as_a_run_made_alone(tmp_path):
  shared, alone = tmp_path / "shared", tmp_path / "alone"
  first, at_first = _run(tmp_path, shared, "a", "--steps", "6")
  assert " 0 cache hits" in first
  # the same file at another rate and length: every executable from the cache
  second, at_second = _run(tmp_path, shared, "b", "--steps", "8", "--set", "lr=0.02")
  assert second.startswith("timing kernels 0 compiled"), second
  fresh, made_alone = _run(tmp_path, alone, "c", "--steps", "8", "--set", "lr=0.02")
  assert " 0 cache hits" in fresh
  assert at_second == made_alone  # bitwise: the numbers reached the shared executable
  assert len(at_second) == 8 and at_second != at_first[:8]
  # the peak (twice the first run's) and the length (the cosine's end moved) both arrived
  assert np.float32(at_second[2][1]) == np.float32(0.02) == 2 * np.float32(at_first[2][1])
  assert at_second[5][1] > 2 * at_first[5][1]

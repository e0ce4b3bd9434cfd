"""The initial state as one executable (lower/init.py's compile_init: parameters, optimizer
state and counters, at CPU_INIT_OPTIONS on the CPU) holds the same bits as the parameters'
initializer and the optimizer's init compiled apart at XLA's default level."""

import jax
import numpy as np
import optax

from sexpgpu.ir.graph import Init, Param
from sexpgpu.lower.init import CPU_INIT_OPTIONS, init_options, init_params
from sexpgpu.lower.step import init_state

# every initializer kind, stacked (a repeat's layers) and not, and a bf16 one (each random
# draw is a second or so of compile at XLA's default level)
KINDS = [Init("zeros"), Init("ones"), Init("constant", 0.5), Init("normal", 0.02),
         Init("truncated-normal", 0.1), Init("uniform", 0.3), Init("fan-in", 1.0)]
PARAMS = {f"p{i}": Param(f"p{i}", (24, 40), "f32", init, None, (3,) if i % 2 else ())
          for i, init in enumerate(KINDS)}
PARAMS["half"] = Param("half", (40, 24), "bf16", Init("normal", 0.5), None, (2,))
XLA_DEFAULT = {"xla_backend_optimization_level": 3}  # XLA's own default, named (the suite's
# XLA_FLAGS set level 0: tests/conftest.py)


def _bits(tree) -> list[np.ndarray]:
  out = []
  for x in jax.tree_util.tree_leaves(tree):
    x = np.asarray(x)
    out.append(x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind in "fV" else x)
  return out


def _run(fn, options):
  return jax.jit(fn).lower().compile(options)()


def test_one_executable_makes_the_bits_of_the_initializer_and_the_optimizer_apart():
  opt = optax.adamw(1e-3)
  params = _run(lambda: init_params(7, PARAMS), XLA_DEFAULT)
  apart = {"params": params, "opt": _run(lambda: opt.init(params), XLA_DEFAULT)}
  one = _run(lambda: init_state(init_params(7, PARAMS), opt), CPU_INIT_OPTIONS)
  assert set(one) == {"params", "opt", "step", "skipped"}
  assert int(one["step"]) == int(one["skipped"]) == 0 and one["step"].dtype == np.int32
  one = {"params": one["params"], "opt": one["opt"]}
  assert jax.tree_util.tree_structure(one) == jax.tree_util.tree_structure(apart)
  got, want = _bits(one), _bits(apart)
  assert len(got) == 3 * len(PARAMS) + 1
  for x, y in zip(got, want):
    assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
  # the options take effect: level 0 changes a last bit of a normal draw, so the equality
  # above is not that of one level compiled twice
  zero = _run(lambda: init_params(7, {"p3": PARAMS["p3"]}), {"xla_backend_optimization_level": 0})
  assert not np.array_equal(_bits(zero)[0], _bits(params["p3"])[0])


def test_a_level_in_xla_flags_or_a_gpu_keeps_xla_s_options():
  assert init_options("cpu", "") == CPU_INIT_OPTIONS
  assert init_options("cpu", "--xla_cpu_foo=1") == CPU_INIT_OPTIONS
  assert init_options("cpu", "--xla_backend_optimization_level=0") is None
  assert init_options("cuda", "") is None

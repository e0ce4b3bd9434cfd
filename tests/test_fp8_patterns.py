"""`:fp8 ["glob" ...]`: the products it names and no others, its refusals (a glob naming no
product, a product FP8 does not take, :fp8 under another precision), FP8 of an MoE's expert
einsums, and FP8 under fsdp and tensor layouts over two host devices."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.errors import SxError
from sexpgpu.lower import fp8

# GPT-2's blocks (std/gpt2) small enough to lower in a second or two, under remat as
# configs/gpt2-small.sx is; `{keys}` takes the defrun's precision and :fp8.
GPT2ISH = """(require std/lm)
(require std/gpt2)
(defloader train (markov :vocab 64 :seq 33 :batch 4 :seed 1 :branching 4))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (gpt2 (lm-inputs t) :vocab 64 :width 64 :layers 2 :heads 1 :context 32
                           :remat true) t)))
(defrun :loss loss :data train :steps 3 :optimizer (adamw :lr 3e-3 :weight-decay 0.0)
        {keys})
"""
MLP = ("gpt2-block/mlp/c_fc/w", "gpt2-block/mlp/c_proj/w")


def _file(tmp_path, keys: str, text: str = GPT2ISH, name: str = "f.sx") -> str:
  path = tmp_path / name
  path.write_text(text.replace("{keys}", keys))
  return str(path)


def _with(config: str, keys: str, tmp_path) -> str:
  """A config of the repository with `keys` added to its defrun (its :precision replaced)."""
  text = re.sub(r":precision \w+", "", open(os.path.join(ROOT, "configs", config)).read())
  return _file(tmp_path, "", text.replace("(defrun ", f"(defrun {keys} ", 1), config)


def _check(path, what=None, **opts):
  from sexpgpu.run.check import CheckOptions, check
  return check(path, None, (), what, CheckOptions(**opts))


def f8_dots(hlo: str) -> list[tuple]:
  """(lhs, rhs) for each dot_general of a StableHLO text: the float8 type each operand is
  dequantised from (a multiply of a convert from f8), or None for a wide operand."""
  kinds = []
  for function in hlo.split("func.func")[1:]:  # value names are each function's own
    defs = {m.group(1): m.group(2)
            for m in re.finditer(r"^\s*(%[\w#]+) = (.*)$", function, re.M)}

    def f8(name):
      m = re.match(r"stablehlo\.multiply (%[\w#]+), (%[\w#]+)", defs.get(name, ""))
      conv = re.match(r"stablehlo\.convert (%[\w#]+) : \(tensor<[^>]*x(f8E\w+)>\) -> "
                      r"tensor<[^>]*xbf16>", defs.get(m.group(1), "")) if m else None
      return conv.group(2) if conv else None
    for line in defs.values():
      m = re.match(r"stablehlo\.dot_general (%[\w#]+), (%[\w#]+),", line)
      if m:
        kinds.append((f8(m.group(1)), f8(m.group(2))))
  return kinds


@pytest.fixture(scope="module")
def mlp_only(tmp_path_factory):
  return _file(tmp_path_factory.mktemp("fp8p"), ':precision fp8 :fp8 ["*/mlp/*"]')


def test_the_report_lists_exactly_the_products_the_pattern_names(mlp_only):
  text = _check(mlp_only, target="cuda", gpu="H100")
  (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("fp8")]
  assert line.count("gpt2-block/") == 2 and all(p in line for p in MLP)
  assert "attn" not in line and "wte" not in line
  assert "2 products traced in float8" in line  # the forward's; their gradients follow


def test_check_print_hlo_under_the_pattern_holds_its_two_fp8_matrices(mlp_only):
  kinds = f8_dots(_check(mlp_only, "hlo", target="cuda", gpu="H100"))
  # the two mlp matrices of the scanned block: each gradient once with the e5m2 cotangent,
  # the forward product (again where remat recomputes it) in e4m3
  assert kinds.count(("f8E5M2", "f8E4M3FN")) == 2  # dx = g · wᵀ
  assert kinds.count(("f8E4M3FN", "f8E5M2")) == 2  # dw = xᵀ · g
  assert kinds.count(("f8E4M3FN", "f8E4M3FN")) >= 2
  assert (None, None) in kinds  # the attention projections stay wide now


def test_a_pattern_naming_no_product_is_refused_at_the_key(tmp_path):
  path = _file(tmp_path, ':precision fp8 :fp8 ["*/mlp/*" "*/ffn/*"]')
  with pytest.raises(SxError) as e:
    _check(path)  # `check` refuses what `run` would
  assert e.value.code == "E-RUN-002" and '"*/ffn/*"' in e.value.message
  assert e.value.location.line == 9 and "mlp/c_fc/w" in e.value.fix


def test_fp8_patterns_under_another_precision_are_refused(tmp_path):
  import sexpgpu
  for keys in (':precision bf16 :fp8 ["*/mlp/*"]', ':fp8 ["*/mlp/*"]'):
    with pytest.raises(SxError) as e:
      sexpgpu.compile(_file(tmp_path, keys))
    assert e.value.code == "E-RUN-002" and "precision" in e.value.message
    assert e.value.location.line == 9 and ":precision fp8" in e.value.fix
  with pytest.raises(SxError) as e:
    sexpgpu.compile(_file(tmp_path, ':precision fp8 :fp8 "*/mlp/*"'))
  assert e.value.code == "E-RUN-002" and "vector of glob patterns" in e.value.message


def test_a_product_fp8_does_not_take_is_refused_not_left_bf16(tmp_path):
  """Mixtral's w2 is one einsum of three operands (the experts' outputs weighted by the
  router): a pattern naming it is E-PREC-002, not a bf16 product under an fp8 label."""
  path = _with("mixtral-tiny.sx", ':precision fp8 :fp8 ["*/experts/*"]', tmp_path)
  with pytest.raises(SxError) as e:
    _check(path)  # `check` refuses what `run` would
  assert e.value.code == "E-PREC-002" and "experts/w2" in e.value.message
  assert "bteh,ehd,bte->btd" in e.value.message and "leave" in e.value.fix
  # its w1 and w3 (btd,edh->bteh, two operands each) are FP8's
  from sexpgpu.run.compile import compile_file
  path = _with("mixtral-tiny.sx", ':precision fp8 :fp8 ["*/experts/w1" "*/experts/w3"]',
               tmp_path)
  c = compile_file(path, "smoke")
  assert [p.rsplit("/", 1)[1] for p in fp8.selected_paths(c.stages[0].graph,
                                                          fp8.patterns(c.exp.run))] == ["w1", "w3"]


def test_fp8_einsum_gradients_take_the_e5m2_cotangent():
  kx, kw, kg = jax.random.split(jax.random.key(1), 3)
  spec = "ecd,edh->ech"  # an MoE's experts (std/moe)
  x, w = jax.random.normal(kx, (4, 6, 16)), jax.random.normal(kw, (4, 16, 8)) * 0.1
  g = jax.random.normal(kg, (4, 6, 8))
  deq = lambda v, dt: fp8.dequantise(*fp8.quantise(v, dt))  # noqa: E731
  want = lambda s, a, b: jnp.einsum(s, a, b, preferred_element_type=jnp.float32)  # noqa: E731

  @jax.jit  # one compile, not one a primitive
  def grads(x, w, g):
    y, vjp = jax.vjp(lambda a, b: fp8.fp8_einsum(spec, a, b), x, w)
    g8 = deq(g, fp8.E5M2)
    return (y, *vjp(g), want("ech,edh->ecd", g8, deq(w, fp8.E4M3)),
            want("ecd,ech->edh", deq(x, fp8.E4M3), g8))
  y, dx, dw, want_dx, want_dw = grads(x, w, g)
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))
  np.testing.assert_array_equal(np.asarray(dw), np.asarray(want_dw))
  exact = np.einsum(spec, np.asarray(x), np.asarray(w))
  err = np.abs(np.asarray(y) - exact).max() / np.abs(exact).max()
  assert 2.0**-9 < err < 2.0**-3
  assert fp8.einsum_ok(spec) and fp8.einsum_ok("btd,edh->bteh")
  assert not fp8.einsum_ok("bteh,ehd,bte->btd") and not fp8.einsum_ok("ii,ij->j")
  assert not fp8.einsum_ok("ij,jk->k")  # i summed in one operand alone


def test_an_moe_trains_its_expert_einsums_in_fp8(tmp_path):
  """std/moe's experts (`ecd,edh->ech` and its kin) named by :fp8: their products traced in
  float8, the loss and the experts' gradients beside bf16's."""
  from sexpgpu.ir.ops import LowerCtx
  from sexpgpu.lower.init import init_params
  from sexpgpu.lower.interp import run_graph
  from sexpgpu.run.compile import compile_file
  path = _with("moe-lm.sx", ':precision fp8 :fp8 ["*/moe-experts/*"]', tmp_path)
  c = compile_file(path, "smoke")
  graph = c.stages[0].graph
  assert sorted(p.rsplit("/", 1)[1] for p in fp8.selected_paths(graph, ("*/moe-experts/*",))) \
      == ["down", "gate", "up"]
  params = init_params(0, c.params)
  rng = np.random.default_rng(0)
  # the readout starts at zeros: drawn here, so that the loss reads the experts
  params["moe-lm/unembed"] = jnp.asarray(rng.normal(0, 0.5, params["moe-lm/unembed"].shape),
                                         jnp.float32)
  tokens = rng.integers(0, 32, (8, 33)).astype(np.int32)
  got = {}
  for prec in ("bf16", "fp8"):
    ctx = LowerCtx(prec, fp8_only=fp8.patterns(c.exp.run), platform="cpu")
    loss = lambda p: run_graph(graph, p, {"tokens": tokens}, ctx)["out"]  # noqa: E731
    got[prec] = jax.jit(jax.value_and_grad(loss))(params)
    specs = sorted(n["spec"] for n in ctx.notes if n.get("kind") == "fp8")
    assert specs == ([] if prec == "bf16" else ["ecd,edh->ech"] * 2 + ["ech,ehd->ecd"])
  (l16, g16), (l8, g8) = got["bf16"], got["fp8"]
  assert abs(float(l8) - float(l16)) / float(l16) < 0.02 and float(l8) != float(l16)
  for k in (k for k in g16 if "moe-experts" in k):
    a, b = np.asarray(g16[k]).ravel(), np.asarray(g8[k]).ravel()
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.9, k


# One process, 2 host devices: each layout's run (3 steps) and the float8 converts in its
# step's lowering; `layouts` is run as given, each with `sets` and `variant`.
_LAYOUTS = """
import json, re, sys
import sexpgpu
from sexpgpu.run.check import CheckOptions, check
out = {{}}
for layout in {layouts!r}:
  sets = dict({sets!r}, sharding=layout)
  hlo = check({path!r}, {variant!r}, [(k, str(v)) for k, v in sets.items()], "hlo",
              CheckOptions())
  sexpgpu.compile({path!r}, variant={variant!r}, set=sets).run(
      metrics="jsonl:{tmp}/" + layout + ".jsonl")
  losses = [e["train/loss"] for e in map(json.loads, open("{tmp}/" + layout + ".jsonl"))
            if e["kind"] == "step"]
  out[layout] = {{"losses": losses, "e5m2": len(re.findall(r"convert[^\\n]*xf8E5M2>", hlo)),
                 "e4m3": len(re.findall(r"convert[^\\n]*xf8E4M3FN>", hlo))}}
print(json.dumps(out))
"""


def run_layouts(path: str, tmp_path, layouts: tuple, sets: dict, variant=None) -> dict:
  """{layout: {"losses": [...], "e5m2": n, "e4m3": n}} from a process of 2 host devices."""
  env = dict(os.environ, SEXPGPU_DEVICES="0,1", XLA_FLAGS="--xla_force_host_platform_device_"
             "count=2 " + os.environ.get("XLA_FLAGS", ""))
  env.pop("SEXPGPU_STACKING", None)
  script = _LAYOUTS.format(path=path, tmp=tmp_path, layouts=layouts, sets=sets,
                           variant=variant)
  p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                     cwd=ROOT, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a process of its own on 2 host devices, three layouts' steps compiled
def test_fp8_runs_under_fsdp_and_tensor_layouts(tmp_path):
  path = _file(tmp_path, ':precision fp8 :fp8 ["*/mlp/*" "*/attn/*"]')
  out = run_layouts(path, tmp_path, ("replicate", "fsdp", "tensor:2"), {"microbatches": 2})
  base = out["replicate"]
  assert len(base["losses"]) == 3 and base["e5m2"] > 0 and base["e4m3"] > 0
  for layout in ("fsdp", "tensor:2"):
    got = out[layout]
    # float8 in each layout's step, as many cotangents quantised as replicated
    assert got["e5m2"] == base["e5m2"] and got["e4m3"] > 0, (layout, got)
    # the same run up to the order of sums (fsdp: the same amax over the whole tensor;
    # tensor: each device's half of a matrix scaled by its own amax)
    rel = np.abs(np.array(got["losses"]) - base["losses"]) / np.array(base["losses"])
    assert len(got["losses"]) == 3 and rel.max() < 0.02, (layout, got["losses"], base)

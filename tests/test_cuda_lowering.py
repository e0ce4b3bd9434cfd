"""The GPU path lowered for CUDA on this CPU machine: the attention rule as a CUDA machine
chooses, whole steps under replicate, fsdp and hsdp, `check --target cuda`, and pass steps
that take their rules from their arguments' devices."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.errors import SxError
from sexpgpu.ir.ops import LowerCtx
from sexpgpu.lower import attention, cuda_target
from sexpgpu.lower.rules import lowering

GPT2 = os.path.join(ROOT, "configs", "gpt2-small.sx")
TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
CUDNN = {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}

def _gpt2_attention_place() -> str:
  """Where std/gpt2.sx writes attention's `(einsum "bhqk,bhkd->bhqd" ...)`, as a region
  report names it (line:column of the einsum form)."""
  with open(os.path.join(ROOT, "sexpgpu", "std", "gpt2.sx"), encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      col = line.find('(einsum "bhqk,bhkd->bhqd"')
      if col >= 0:
        return f"std/gpt2.sx:{n}:{col + 1}"
  raise AssertionError("std/gpt2.sx writes no attention einsum")


GPT2_ATTENTION = _gpt2_attention_place()

CUDNN_BIAS = {"__cudnn$fmhaScaleBiasSoftmax": 1, "__cudnn$fmhaScaleBiasSoftmaxBackward": 1}
TRITON3 = {"__gpu$xla.gpu.triton": 3}  # the flash forward, its dK/dV and dQ kernels

# packed documents: the loader's segments reach the attention and the loss
PACKED_SX = """
(require std/nn)
(require std/lm)
(defknob cache "cache")
(defloader train (text cache :seq 65 :batch 4 :pack docs :split [0 0.75] :vocab 2048))
(defloader valid (text cache :seq 65 :batch 4 :pack docs :split [0.75 1] :vocab 2048))
(defn loss [batch]
  (let [t (get batch :tokens)
        s (get batch :segments)]
    (next-token-loss (transformer-lm (lm-inputs t) :vocab 2048 :width 64 :layers 1 :heads 4
                                     :segments (lm-inputs s))
                     t :segments s)))
(defpass eval :data valid :every 50 :batches 1 :metrics [loss])
(defrun :loss loss :data train :steps 10 :microbatches 2 :optimizer (adamw :lr 1e-3) :seed 0
        :precision bf16)
"""


# --- the sdpa rule on the gpu platform, its probes answered by lowering for CUDA --------
CASES = [(prec, packed, ranks) for prec in ("bf16", "f32") for packed in (False, True)
         for ranks in (0, 2)]


@pytest.fixture(scope="module")
def rule_lowered():
  """(precision, packed, ranks) → (the rule's note, custom calls of value_and_grad for CUDA)."""
  out = {}
  for prec, packed, ranks in CASES:
    ctx = LowerCtx(prec, platform="gpu")
    lead = (ranks,) if ranks else ()
    x = jax.ShapeDtypeStruct(lead + (2, 4, 64, 32), jnp.float32)
    seg = jax.ShapeDtypeStruct(lead + (2, 64), jnp.int32)

    def loss(q, k, v, s, w):
      out = lowering("sdpa", "gpu")(ctx, q, k, v, s if packed else None, causal=True, scale=0.2)
      return jnp.sum(out * w)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    if ranks:  # as the fsdp/hsdp step maps each rank's microbatches
      with attention.under_rank_vmap(ranks):
        low = cuda_target.lower_for_cuda(jax.vmap(fn), x, x, x, seg, x)
    else:
      low = cuda_target.lower_for_cuda(fn, x, x, x, seg, x)
    out[(prec, packed, ranks)] = (ctx.notes[-1], cuda_target.custom_calls(low.as_text()))
  return out


@pytest.mark.parametrize("prec,packed,ranks", CASES)
def test_sdpa_on_cuda_chooses_as_a_cuda_machine(rule_lowered, prec, packed, ranks):
  note, calls = rule_lowered[(prec, packed, ranks)]
  want = {("bf16", False): ("cudnn", "cudnn", CUDNN),
          ("bf16", True): ("cudnn", "cudnn", CUDNN_BIAS),
          ("f32", False): ("pallas", "pallas-flash", TRITON3),
          ("f32", True): ("pallas", "pallas-segments", TRITON3)}[(prec, packed)]
  assert (note["impl"], note["kernel"], calls) == want
  assert note["backend"] == ("triton" if note["impl"] == "pallas" else "")
  if prec == "f32":
    assert note["why"] == "cuDNN: it takes bf16 or f16, not float32"
  else:
    assert note["why"] == ("segments as cuDNN's bias" if packed else "")


def test_cudnn_is_assumed_when_no_cuda_extra_is_installed():
  text = cuda_target.cudnn_source()
  assert text.startswith("cuDNN 9.")
  assert text.endswith("installed") or "assumed" in text


# --- pass steps: the rules of their arguments' platform ----------------------------------
def test_a_pass_on_cpu_devices_keeps_the_cpu_rules_on_a_gpu_host(monkeypatch):
  """A `--device cpu` run on a GPU host: JAX's default backend says gpu, the pass's
  arguments live on the CPU, and the pass must not be lowered with cuDNN's rules."""
  from sexpgpu.lower.step import PassStep
  from sexpgpu.run.compile import compile_file
  from sexpgpu.run.training import build
  c = compile_file(TINY, None, [], None, None)
  training = build(c)
  name, ps = next(iter(training.pass_steps.items()))
  batch = c.loaders[c.exp.passes[name].data].batch(0)
  params = jax.device_put(_init_params(c), jax.devices("cpu")[0])
  expected = PassStep(ps.graphs, ps.precision, platform="cpu")(params, batch)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  chose = []
  monkeypatch.setattr(attention, "_cudnn_refusal", lambda *a: chose.append(a) or None)
  fresh = PassStep(ps.graphs, ps.precision)
  assert fresh.platform_of(params, batch) == "cpu"
  got = fresh(params, batch)
  assert chose == []  # the GPU's rule never ran
  notes = [(n["impl"], n["why"]) for n in fresh.notes if n["kind"] == "attention"]
  assert notes and set(notes) == {("xla", "on cpu")}
  assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in expected.items()}


def _init_params(c):
  from sexpgpu.lower.init import init_params
  return init_params(int(c.exp.run["seed"]), c.params)


# --- check --target cuda -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_bf16():
  from sexpgpu.run.check import CheckOptions, check
  return check(GPT2, opts=CheckOptions(target="cuda", gpu="H100"))


def test_check_target_cuda_gpt2_small_bf16_is_cudnn(gpt2_bf16):
  lines = gpt2_bf16.splitlines()
  assert lines[0].startswith("target: cuda, 1 rank (replicate), bf16; cuDNN 9.")
  assert [ln.split()[0] for ln in lines[1:]] == [
      "train", "attention", "custom", "flops", "memory", "estimate", "pass", "attention",
      "custom"]
  assert lines[2].endswith(f"12 regions at {GPT2_ATTENTION} → cudnn (causal)")
  # the forward twice (remat recomputes it for the backward), one backward
  assert lines[3].split(None, 2)[2] == ("__cudnn$fmhaSoftmax 2, "
                                        "__cudnn$fmhaSoftmaxBackward 1")
  assert "not known without the GPU compiler" in lines[5]
  # the estimate is the train step's: it stands under the train step, before the passes
  assert "H100 (989 TFLOP/s bf16" in lines[6] and "an estimate, not a measurement" in lines[6]
  assert lines[8].endswith(f"12 regions at {GPT2_ATTENTION} → cudnn (causal)")
  assert lines[9].split(None, 2)[2] == "__cudnn$fmhaSoftmax 1"


def test_check_target_cuda_print_hlo_is_the_cuda_stablehlo():
  from sexpgpu.run.check import CheckOptions, check
  text = check(GPT2, "smoke", what="hlo", opts=CheckOptions(target="cuda"))
  assert "stablehlo" in text
  assert cuda_target.custom_calls(text) == {"__gpu$xla.gpu.triton": 4}


def test_check_target_refuses_unknown_targets_and_cards():
  from sexpgpu.run.check import CheckOptions, check
  for kw, flag in ((dict(target="rocm"), "--target"), (dict(target="cuda", gpu="V100"), "--gpu")):
    with pytest.raises(SxError) as e:
      check(GPT2, opts=CheckOptions(**kw))
    assert e.value.code == "E-FORM-001" and e.value.where == flag


def test_a_step_that_cannot_lower_for_cuda_names_the_attention(monkeypatch):
  from sexpgpu.run.check import CheckOptions, check
  monkeypatch.setattr(attention, "_cudnn_refusal", lambda *a: None)

  def refuse(*a):
    raise NotImplementedError("Unsupported sequence length Q 64, KV 64.\nmore")
  monkeypatch.setattr(attention, "_cudnn", refuse)
  with pytest.raises(SxError) as e:
    check(GPT2, "smoke", sets=[("precision", "bf16")], opts=CheckOptions(target="cuda"))
  err = e.value
  assert err.code == "E-DEV-001"
  assert str(err.location) == GPT2_ATTENTION
  assert err.message == ("the train step cannot be lowered for cuda: attention: "
                         "NotImplementedError: Unsupported sequence length Q 64, KV 64.")


# --- whole steps on 2 ranks: replicate, fsdp and hsdp, bf16 and f32, packed documents ------
_TWO_RANKS = """
import json, sys
from sexpgpu.run.check import CheckOptions, check
out = {}
for name, path, variant, sets in json.loads(sys.argv[1]):
  out[name] = check(path, variant, [tuple(s) for s in sets], opts=CheckOptions(target="cuda"))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("packed")
  r = subprocess.run(sexpgpu_cmd("tokenize", *(os.path.join(ROOT, "configs", "data", f)
                                               for f in ("garden.txt", "lighthouse.txt",
                                                         "river.txt", "corpus.txt")),
                                 "-o", "cache/", "--train-bpe", "2048"),
                     cwd=tmp, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  (tmp / "packed.sx").write_text(PACKED_SX)
  runs = []
  for sharding in ("replicate", "fsdp", "hsdp"):
    for prec in ("bf16", "f32"):
      runs.append((f"gpt2 {sharding} {prec}", GPT2, "smoke",
                   [("sharding", sharding), ("precision", prec), ("microbatches", "2")]))
  for prec in ("bf16", "f32"):
    runs.append((f"packed fsdp {prec}", str(tmp / "packed.sx"), None,
                 [("sharding", "fsdp"), ("precision", prec)]))
  env = dict(os.environ, SEXPGPU_DEVICES="0,1",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  p = subprocess.run([sys.executable, "-c", _TWO_RANKS, json.dumps(runs)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


def _field(text, label, section="train step"):
  part = text.split(section, 1)[1].split("\npass ", 1)[0]
  return next(ln.strip()[len(label):].strip() for ln in part.splitlines()
              if ln.strip().startswith(label + " "))


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
@pytest.mark.parametrize("sharding", ["replicate", "fsdp", "hsdp"])
def test_gpt2_steps_lower_for_cuda_on_two_ranks(two_ranks, sharding):
  bf16, f32 = two_ranks[f"gpt2 {sharding} bf16"], two_ranks[f"gpt2 {sharding} f32"]
  assert bf16.startswith(f"target: cuda, 2 ranks ({sharding}), bf16")
  assert _field(bf16, "attention").endswith("→ cudnn (causal)")
  assert _field(f32, "attention").endswith(
      "→ pallas-flash (causal): cuDNN: it takes bf16 or f16, not float32")
  if sharding == "replicate":  # inside shard_map: the plain calls
    assert _field(f32, "pallas") == ("sexpgpu_flash_backward_dkv, sexpgpu_flash_backward_dq, "
                                     "sexpgpu_flash_forward on triton")
    assert _field(f32, "custom calls") == "__gpu$xla.gpu.triton 4"
    assert _field(bf16, "custom calls") == "__cudnn$fmhaSoftmax 2, __cudnn$fmhaSoftmaxBackward 1"
  else:  # custom partitioning (cuDNN's, and the flash kernels'), each call with its rule
    assert _field(f32, "pallas").startswith("pallas-flash on triton, each call with its "
                                            "sharding rule")
    for text in (bf16, f32):  # the forward twice (remat), the backward once
      assert _field(text, "custom calls") == "CustomSPMDPartitioning 3"
      assert _field(text, "sharding") == "3 custom calls carry a sharding rule"


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_packed_documents_under_fsdp_lower_for_cuda(two_ranks):
  bf16, f32 = two_ranks["packed fsdp bf16"], two_ranks["packed fsdp f32"]
  assert _field(bf16, "attention").endswith("→ cudnn (segments): segments as cuDNN's bias")
  assert _field(bf16, "custom calls") == "CustomSPMDPartitioning 2"
  assert _field(f32, "attention").endswith(
      "→ pallas-segments (segments): cuDNN: it takes bf16 or f16, not float32")
  assert _field(f32, "custom calls") == "CustomSPMDPartitioning 2"
  assert _field(f32, "sharding") == "2 custom calls carry a sharding rule"
  assert _field(bf16, "attention", "pass eval").endswith("→ cudnn (segments): segments as "
                                                          "cuDNN's bias")


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_the_gpu_check_reads_the_prediction_with_the_gpu_hidden():
  """benchmarks/gpu_served.py's prediction is `check --target cuda`'s attention line."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    import gpu_served
  finally:
    sys.path.pop(0)
  kernels, text = gpu_served.predicted(GPT2, "smoke", [("precision", "bf16")])
  assert kernels == ["cudnn"] and text.startswith("target: cuda, 1 rank (replicate), bf16")
  assert subprocess.run(["bash", "-n", os.path.join(ROOT, "benchmarks", "gpu_check.sh")]
                        ).returncode == 0

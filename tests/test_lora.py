"""LoRA as a graph rewrite (`:lora (lora ...)`): on a Llama imported from a Hugging Face
folder the adapted model starts as the base computes, only the adapters train and hold
optimizer state, the loss falls, the base stays bitwise, a resume continues bitwise; each
keyword's mistake is an error at its place."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError

MODEL = """
(require std/lm)
(require std/llama)
(defloader train (markov :vocab 40 :seq 17 :batch 16 :seed 7))
(defn lm [tokens]
  (llama tokens :vocab 40 :width 32 :layers 2 :heads 4 :kv-heads 2 :hidden 64 :context 32))
(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))
"""
RUN = ('(defrun :loss loss :data train :steps 16 :optimizer (adamw :lr 0.01 :weight-decay 0.0)'
       ' :precision f32 :seed 1{extra})')
LORA = (' :lora (lora :rank 4 :alpha 8 :dropout 0.0'
        ' :targets ["*/q_proj/w" "*/v_proj/w" "*/lm_head/w"])')
BLOCK = "lm/llama/layers/llama-block/self_attn/"
ADAPTERS = {p + f"w.lora_{x}" for p in (BLOCK + "q_proj/", BLOCK + "v_proj/", "lm/llama/lm_head/")
            for x in "ab"}


def write(tmp, name, extra=LORA):
  path = os.path.join(str(tmp), name)
  with open(path, "w") as f:
    f.write(MODEL + RUN.format(extra=extra))
  return path


def _steps(path):
  return [e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"]


def _state(path, sets, step_dir):
  from sexpgpu.ckpt import restore_checkpoint
  st = sexpgpu.compile(path, set=sets).init()
  abstract = jax.eval_shape(lambda: {"params": st.params, "opt": st.opt_state,
                                     "step": jnp.int32(0), "skipped": jnp.int32(0)})
  return restore_checkpoint(step_dir, abstract)[0]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
  """A base Llama trained 3 steps and exported as a Hugging Face folder; LoRA on it from
  that folder: step 0, 16 steps straight, and 6 steps then a resume to 16."""
  tmp = tmp_path_factory.mktemp("lora")
  base = write(tmp, "base.sx", "")
  exported = sexpgpu.compile(base).run(steps=3)
  hf = str(tmp / "hf")
  exported.export(hf, format="hf")
  path = write(tmp, "tuned.sx")
  sets = {"init-from": f"hf:{hf}", "init-partial": "true"}
  exp = sexpgpu.compile(path, set=sets)
  start = exp.run(steps=0, checkpoint_dir=str(tmp / "s"))
  straight = exp.run(checkpoint_dir=str(tmp / "a"), metrics=f"jsonl:{tmp / 'a.jsonl'}")
  exp.run(steps=6, checkpoint_dir=str(tmp / "b"))
  resumed = exp.run(checkpoint_dir=str(tmp / "b"), resume="latest")
  return {"base": base, "path": path, "sets": sets, "exported": exported.params,
          "checkpoint": straight.checkpoint,
          "start": _state(path, sets, start.checkpoint),
          "end": _state(path, sets, straight.checkpoint),
          "resumed": _state(path, sets, resumed.checkpoint),
          "losses": _steps(tmp / "a.jsonl")}


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_the_adapted_model_starts_as_the_imported_base_computes(tuned):
  from sexpgpu.models import forward
  from sexpgpu.run.compile import compile_file
  tokens = np.arange(2 * 12, dtype=np.int32).reshape(2, 12) % 40
  base_c = compile_file(tuned["base"])
  lora_c = compile_file(tuned["path"], sets=list(tuned["sets"].items()))
  want = forward.forward(base_c, "lm", 12, 2)(
      forward.device_params(base_c, tuned["exported"]), tokens)
  start = {k: np.asarray(v) for k, v in tuned["start"]["params"].items()}
  assert not np.any(start[BLOCK + "q_proj/w.lora_a"] == 0)  # A drawn, B zeros
  assert not np.any(start[BLOCK + "q_proj/w.lora_b"])
  got = forward.forward(lora_c, "lm", 12, 2)(forward.device_params(lora_c, start), tokens)
  np.testing.assert_array_equal(got, want)
  end = {k: np.asarray(v) for k, v in tuned["end"]["params"].items()}
  moved = forward.forward(lora_c, "lm", 12, 2)(forward.device_params(lora_c, end), tokens)
  assert np.abs(moved - want).max() > 1e-3  # the sample path reads the adapters too


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_only_the_adapters_hold_optimizer_state(tuned):
  adam = tuned["end"]["opt"][-1][0]
  assert set(adam.mu) == ADAPTERS and set(adam.nu) == ADAPTERS
  # A [2 layers, 32, 4] and B [2, 4, 32] for q, A [2, 32, 4] and B [2, 4, 16] for v, and
  # the head's (no layers) A [32, 4] and B [4, 40]
  want = 2 * (256 + 256 + 256 + 128 + 128 + 160)
  assert sum(x.size for x in jax.tree_util.tree_leaves(tuned["end"]["opt"]) if x.ndim) == want


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_the_loss_falls_and_the_base_stays_bitwise(tuned):
  losses = tuned["losses"]
  assert len(losses) == 16 and np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.05, losses
  start, end = tuned["start"]["params"], tuned["end"]["params"]
  for path in start:
    same = np.asarray(start[path]).tobytes() == np.asarray(end[path]).tobytes()
    assert same == (path not in ADAPTERS), path
  for path, v in tuned["exported"].items():  # the base is the imported folder's, bitwise
    assert np.asarray(end[path]).tobytes() == np.asarray(v).tobytes(), path


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_a_resume_in_the_middle_is_bitwise(tuned):
  la, ta = jax.tree.flatten(tuned["end"])
  lb, tb = jax.tree.flatten(tuned["resumed"])
  assert ta == tb
  assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_the_merged_export_computes_as_the_adapted_model(tuned, tmp_path, capsys):
  from sexpgpu.cli.main import main
  from sexpgpu.models import forward, source
  from sexpgpu.run.compile import compile_file
  out = str(tmp_path / "merged")
  assert main(["export", tuned["path"], "--resume", tuned["checkpoint"], "-o", out,
               "--format", "hf"]) == 1
  err = capsys.readouterr().err
  assert "E-EXPORT-001" in err and "--merge-lora" in err and not os.path.exists(out)
  assert main(["export", tuned["path"], "--resume", tuned["checkpoint"], "-o", out,
               "--format", "hf", "--merge-lora"]) == 0
  base_c = compile_file(tuned["base"])
  lora_c = compile_file(tuned["path"], sets=list(tuned["sets"].items()))
  folded = source.twin_params(base_c, out, "-o", "test", lambda g, p: AssertionError(p))
  assert sorted(folded) == sorted(base_c.params)
  tokens = np.arange(2 * 12, dtype=np.int32).reshape(2, 12) * 7 % 40
  end = {k: np.asarray(v) for k, v in tuned["end"]["params"].items()}
  want = forward.forward(lora_c, "lm", 12, 2)(forward.device_params(lora_c, end), tokens)
  got = forward.forward(base_c, "lm", 12, 2)(forward.device_params(base_c, folded), tokens)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  q = BLOCK + "q_proj/w"
  assert np.abs(folded[q] - end[q]).max() > 1e-4  # the adapters were folded in
  np.testing.assert_array_equal(folded[BLOCK + "k_proj/w"], end[BLOCK + "k_proj/w"])


def test_the_peft_export_loads_with_peft_onto_the_base_and_computes_the_same(tuned, tmp_path,
                                                                              capsys):
  """`export --format peft` onto the base's `--format hf` folder: PeftModel.from_pretrained
  on transformers' Llama gives the adapted model's logits to 1e-4."""
  import torch
  from peft import PeftModel
  from transformers import AutoModelForCausalLM
  from sexpgpu.cli.main import main
  from sexpgpu.models import forward
  from sexpgpu.run.compile import compile_file
  out = str(tmp_path / "peft")
  assert main(["export", tuned["path"], "--resume", tuned["checkpoint"], "-o", out,
               "--format", "peft", "--merge-lora"]) == 1
  assert "drop --merge-lora" in capsys.readouterr().err and not os.path.exists(out)
  assert main(["export", tuned["path"], "--resume", tuned["checkpoint"], "-o", out,
               "--format", "peft"]) == 0
  config = json.load(open(os.path.join(out, "adapter_config.json")))
  assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
  assert len(config["target_modules"]) == 2 * 2 + 1  # q and v in 2 layers, the head
  base = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(tuned["path"]),
                                                           "hf"), torch_dtype=torch.float32)
  model = PeftModel.from_pretrained(base, out).eval()
  tokens = np.arange(2 * 12, dtype=np.int32).reshape(2, 12) * 5 % 40
  with torch.no_grad():
    got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  lora_c = compile_file(tuned["path"], sets=list(tuned["sets"].items()))
  end = {k: np.asarray(v) for k, v in tuned["end"]["params"].items()}
  want = forward.forward(lora_c, "lm", 12, 2)(forward.device_params(lora_c, end), tokens)
  np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=1e-4)
  with model.disable_adapter(), torch.no_grad():  # without them: the base, which differs
    bare = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  assert np.abs(bare - np.asarray(want)).max() > 1e-3


def test_trainable_adds_to_the_adapters_and_the_ir_has_them(tmp_path):
  from sexpgpu.ir.verify import verify
  from sexpgpu.run.check import check
  from sexpgpu.run.compile import compile_file
  path = write(tmp_path, "more.sx", LORA.replace("0.0", "0.1") + ' :trainable ["*/norm/scale"]')
  text = check(path, what="params")
  assert "train: 7 of 18 parameters trained (1,216 of" in text
  c = compile_file(path)
  verify(c.stages[0].graph)
  ir = c.ir_text()
  assert ir.count("dropout[rate=0.1") == 3 and ir.count("w.lora_a'] ") == 3
  (rep,) = [n for n in ir.splitlines() if " = repeat[" in n]
  assert "repeat[n=2" in rep  # the adapters are read inside the repeat, stacked [2, ...]
  assert c.params[BLOCK + "v_proj/w.lora_b"].full_shape == (2, 4, 16)


@pytest.mark.parametrize("extra,code,message,fix", [
    (' :lora (lora :rank 4 :targets ["*/q_prj/w"])', "E-RUN-002",
     'pattern "*/q_prj/w" names no matmul weight', BLOCK + "q_proj/w"),
    (' :lora (lora :rank 4 :targets ["*/embed_tokens"])', "E-RUN-002",
     "names no matmul weight", "targets are globs over the paths of weights that a matmul"),
    (' :lora (lora :rank 0 :targets ["*/q_proj/w"])', "E-RUN-002", ":rank is 0", ":rank 8"),
    (' :lora (lora :rank 2.5 :targets ["*/q_proj/w"])', "E-RUN-002", ":rank is 2.5", ":rank 8"),
    (' :lora (lora :rank 4 :alpha 0 :targets ["*/q_proj/w"])', "E-RUN-002", ":alpha is 0",
     ":alpha 16"),
    (' :lora (lora :rank 4 :dropout 1.0 :targets ["*/q_proj/w"])', "E-RUN-002",
     ":dropout is 1.0", ":dropout 0.05"),
    (' :lora (lora :rank 4 :targets [])', "E-RUN-002", ":targets is ()", ":targets ["),
    (' :lora (lora :rank 4)', "E-RUN-002", "lora has no :targets", "(lora :rank 8"),
    (' :lora (lora :targets ["*/q_proj/w"])', "E-RUN-002", "lora has no :rank", "(lora :rank 8"),
    (' :lora (lora :rank 4 :targest ["*/q_proj/w"])', "E-FORM-002", "lora has no keyword :targest",
     "did you mean `:targets`?"),
    (' :lora (lora 4 :targets ["*/q_proj/w"])', "E-FORM-001", "keyword arguments only",
     "each value after its keyword"),
    (' :lora 4', "E-RUN-002", ":lora takes a (lora ...) form", ":lora (lora :rank 8"),
])
def test_a_bad_lora_is_an_error_at_its_place(tmp_path, extra, code, message, fix):
  from sexpgpu.run.check import check
  path = write(tmp_path, "bad.sx", extra)
  with pytest.raises(SxError) as e:
    check(path, what="params")
  assert e.value.code == code and message in e.value.message, e.value.message
  assert fix in e.value.fix
  assert e.value.location is not None and e.value.location.line == MODEL.count("\n") + 1


TIED = """
(defloader train (markov :vocab 16 :seq 8 :batch 2 :seed 1))
(defparam table [16 16] :init (normal 0.02))
(defn loss [batch]
  (let [t (get batch :tokens)
        h (take table t)]
    (mean (matmul h table))))
(defrun :loss loss :data train :steps 1 :optimizer (adamw :lr 0.01)
        :lora (lora :rank 2 :targets ["table"]))
"""


def test_a_target_read_other_than_by_a_matmul_is_refused(tmp_path):
  from sexpgpu.run.check import check
  path = tmp_path / "tied.sx"
  path.write_text(TIED)
  with pytest.raises(SxError) as e:
    check(str(path), what="params")
  assert e.value.code == "E-RUN-002" and "lora target table is read other than" in e.value.message
  assert e.value.location.line == 9


_SHARDED = """
import json, sys
sys.path.insert(0, {tests!r})
import jax
import sexpgpu
from test_lora import write, LORA
from sexpgpu.run.compile import compile_file
from sexpgpu.run.backend import open_devices
from sexpgpu.run.training import build
path = write({tmp!r}, "sharded.sx", LORA)
out = {{"losses": {{}}, "specs": {{}}, "shards": {{}}}}
for layout in ("replicate", "fsdp:2,tensor:2", "fsdp"):
  m = {tmp!r} + "/" + layout.replace(":", "-").replace(",", "-") + ".jsonl"
  sexpgpu.compile(path, set={{"sharding": layout, "microbatches": 4}}).run(
      steps=4, metrics="jsonl:" + m)
  out["losses"][layout] = [e["train/loss"] for e in map(json.loads, open(m))
                           if e["kind"] == "step"]
  if layout == "replicate":
    continue
  c = compile_file(path, sets=[("sharding", layout), ("microbatches", "4")])
  training = build(c, open_devices("cpu", [0, 1, 2, 3]))
  out["specs"][layout] = {{p: [a if a is None or isinstance(a, str) else list(a) for a in s]
                          for p, s in training.specs().items()}}
  state = training.init_state()
  out["shards"][layout] = {{p: list(x.addressable_shards[0].data.shape)
                           for p, x in state["params"].items()}}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_adapters_split_as_their_base_and_train_as_replicate(tmp_path):
  """4 host devices: replicate, fsdp:2,tensor:2 and fsdp train the same losses (1e-5), and
  under the mesh each adapter is split as its base weight (A its input axis, B its output)."""
  import subprocess
  import sys
  tests = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, SEXPGPU_DEVICES="0,1,2,3",
             XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             + os.environ.get("XLA_FLAGS", ""))
  env.pop("SEXPGPU_STACKING", None)
  p = subprocess.run([sys.executable, "-c", _SHARDED.format(tests=tests, tmp=str(tmp_path))],
                     cwd=os.path.dirname(tests), env=env, capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stderr[-4000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  rep = out["losses"]["replicate"]
  assert len(rep) == 4
  for layout in ("fsdp:2,tensor:2", "fsdp"):
    np.testing.assert_allclose(out["losses"][layout], rep, rtol=0, atol=1e-5)
  specs, shards = out["specs"]["fsdp:2,tensor:2"], out["shards"]["fsdp:2,tensor:2"]
  for base in (BLOCK + "q_proj/w", BLOCK + "v_proj/w", "lm/llama/lm_head/w"):
    s = specs[base]
    k = 1 if base.startswith(BLOCK) else 0
    assert s[k:] in (["fsdp", "tensor"], ["tensor", "fsdp"])  # a column half: q, v, the head
    assert specs[base + ".lora_a"] == s[:k] + [s[k], None]
    assert specs[base + ".lora_b"] == s[:k] + [None, s[k + 1]]
  q = BLOCK + "q_proj/w"
  assert shards[q] == [2, 16, 16] and shards[q + ".lora_a"] == [2, 16, 4]
  assert shards[q + ".lora_b"] == [2, 4, 16]

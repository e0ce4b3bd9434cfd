"""Parameter roles read from the graph (issue 38): every parameter of every standard-library
model and shipped config has one; the named ones have theirs; `:role` settles what the graph
does not, and an undecided role that weight decay needs is E-ROLE-001 at its `param`."""

import glob
import os
import subprocess

import pytest

from sexpgpu.errors import SxError
from sexpgpu.ir.roles import ROLES, roles
from sexpgpu.lower.optim import decay_mask
from sexpgpu.run.check import check
from sexpgpu.run.compile import compile_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_HEAD = """
(require std/nn)
(require std/lm)
(defloader train (markov :vocab 40 :seq 17 :batch 2 :seed 7))
(defn loss [batch] (let [t (get batch :tokens)] (LOSS)))
(defrun :loss loss :data train :steps 1 :precision f32 :seed 1
        :optimizer (adamw :lr 0.01 :weight-decay 0.1))
"""
_LM = "next-token-loss (MODEL (lm-inputs t)) t"
# each standard-library model, small, as a loss of token batches
STD = {
    "gpt2": ("std/gpt2", "gpt2 x :vocab 40 :width 16 :layers 2 :heads 2 :context 16"),
    "llama": ("std/llama", "llama x :vocab 40 :width 16 :layers 2 :heads 2 :kv-heads 1 "
              ":hidden 32 :context 16"),
    "mixtral": ("std/mixtral", "mixtral x :vocab 40 :width 16 :layers 2 :heads 2 :kv-heads 1 "
                ":hidden 32 :experts 4 :top-k 2 :context 16"),
    "mamba": ("std/mamba", "mamba x :vocab 40 :width 16 :layers 2 :state 4"),
    "transformer-lm": ("std/lm", "transformer-lm x :vocab 40 :width 16 :layers 2 :heads 2"),
    "moe": ("std/moe", "(fn [x] (let [h (take (param emb [40 16] :init (normal 0.02)) x) "
            "[y b z] (moe-block h :heads 2 :experts 4)] (matmul y (param head [16 40]))))"),
    "mlp-classifier": ("std/nn", "(fn [x] (mlp-classifier (cast (expand x -1) f32) "
                       ":hidden 8 :classes 40 :layers 2))"),
}


def _std_source(name: str) -> str:
  lib, call = STD[name]
  model = call if call.startswith("(fn") else f"(fn [x] ({call}))"
  text = _HEAD.replace("(LOSS)", "(let [m " + model + "] (" + _LM.replace("MODEL", "m") + "))")
  return text.replace("(require std/lm)", f"(require std/lm)\n(require {lib})")


@pytest.fixture(scope="module")
def std_roles():
  out = {}
  for name in STD:
    c = compile_source(_std_source(name), f"{name}.sx")
    out[name] = (c, roles(c.stages[0].graph))
  return out


@pytest.mark.parametrize("name", list(STD))
def test_every_parameter_of_a_std_model_has_a_role(std_roles, name):
  c, found = std_roles[name]
  assert sorted(found) == sorted(c.params) and len(found) >= 5
  assert all(r.role in ROLES for r in found.values())
  # every stacked parameter keeps its layers apart from its own axes
  for path, p in c.params.items():
    assert found[path].stack == p.stack
  assert sum(r.role == "readout" or r.tied for r in found.values()) == 1


def test_gpt2s_named_parameters(std_roles):
  c, found = std_roles["gpt2"]
  wte = found["gpt2/wte"]
  assert (wte.role, wte.tied, wte.fan_in, wte.fan_out) == ("embedding", True, 40, 16)
  attn = found["gpt2/h/gpt2-block/attn/c_attn/w"]
  assert (attn.role, attn.stack, attn.fan_in, attn.fan_out) == ("hidden", (2,), 16, 48)
  assert attn.stacked_text(c.params[attn.path]) == "repeat[2]"
  assert found["gpt2/ln_f/scale"].role == "norm"
  assert found["gpt2/h/gpt2-block/ln_1/scale"].role == "norm"  # f32[2,16]: stacked, a norm
  assert found["gpt2/h/gpt2-block/ln_1/bias"].role == "bias"
  assert found["gpt2/wpe"].role == "embedding"
  counts = {}
  for r in found.values():
    counts[r.role] = counts.get(r.role, 0) + 1
  assert counts == {"embedding": 2, "norm": 3, "bias": 7, "hidden": 4}


def test_the_other_families_named_parameters(std_roles):
  _, llama = std_roles["llama"]
  assert llama["llama/lm_head/w"].role == "readout" and not llama["llama/lm_head/w"].tied
  assert llama["llama/embed_tokens"].role == "embedding"
  assert llama["llama/layers/llama-block/mlp/down_proj/w"].fan_in == 32
  c, mixtral = std_roles["mixtral"]
  w2 = mixtral["mixtral/layers/mixtral-block/block_sparse_moe/experts/w2"]
  w1 = mixtral["mixtral/layers/mixtral-block/block_sparse_moe/experts/w1"]
  assert (w1.role, w1.stack, w1.experts, w1.fan_in, w1.fan_out) == ("expert", (2,), (0,), 16, 32)
  assert (w2.role, w2.experts, w2.fan_in, w2.fan_out) == ("expert", (0,), 32, 16)
  assert w2.stacked_text(c.params[w2.path]) == "repeat[2] experts[4]"
  _, mamba = std_roles["mamba"]
  assert mamba["mamba/layers/mamba-block/mixer/conv1d/w"].role == "conv"
  assert mamba["mamba/layers/mamba-block/mixer/A_log"].role == "other"
  assert mamba["mamba/embeddings"].tied
  _, moe = std_roles["moe"]
  gate = moe["moe-block/moe/moe-experts/gate"]
  assert (gate.role, gate.experts, gate.fan_in, gate.fan_out) == ("expert", (0,), 16, 32)
  _, mlp = std_roles["mlp-classifier"]
  assert mlp["mlp-classifier/out/w"].role == "readout"
  assert mlp["mlp-classifier/repeat/dense/b"].role == "bias"


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("cache"))
  subprocess.run(["sexpgpu", "tokenize", *sorted(glob.glob(os.path.join(ROOT, "configs", "data",
                                                                       "*.txt"))),
                  "-o", out, "--train-bpe", "300"], check=True, capture_output=True,
                 timeout=120)
  return out


CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.sx")))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_configs_parameters_have_a_role_in_check(name, token_cache):
  corpus = os.path.join(ROOT, "tests", "data", "corpus.txt")  # for the char configs' text
  sets = ([("cache", token_cache)] if name == "text-lm.sx" else
          [("text", corpus), ("eval-batches", "1")]
          if name in ("shakespeare-char.sx", "char-speedrun.sx") else [])
  text = check(os.path.join(ROOT, "configs", name), sets=sets, what="params")
  lines = text.splitlines()
  head = ["path", "shape", "init", "count", "role", "stacked", "fan-in→out", "decay"]
  # after them, the optimizer's split (Muon's), trained or frozen, and μP's multipliers
  assert lines[0].split()[:8] == head
  assert set(lines[0].split()[8:]) <= {"opt", "train", "init×", "lr×", "out×"}, lines[0]
  # cells cut where the header's columns start (the count is right-aligned under its own)
  at = [lines[0].index(h) for h in lines[0].split()]
  at[3] = at[2] + len(lines[0][at[2]:at[4]].rstrip()) - 12
  end = next(i for i, ln in enumerate(lines) if ln.startswith("total"))  # the summary after
  rows = [[ln[a:b].strip() for a, b in zip(at, at[1:] + [None])] for ln in lines[1:end]]
  assert rows and all(r[4].split("+")[0].split(" ")[0] in ROLES for r in rows)
  train = lines[0].split().index("train") if "train" in lines[0].split() else None
  for r in rows:  # a frozen parameter (or a DPO reference's copy) has no decay to speak of
    frozen = train is not None and r[train] in ("frozen", "reference")
    assert r[7] == "-" if frozen else r[7] in ("yes", "no"), r
  if name == "gpt2-small.sx":
    by = {r[0]: r for r in rows}
    assert by["lm/gpt2/wte"][4:] == ["embedding+readout (tied)", "-", "50257→768", "no"]
    assert by["lm/gpt2/h/gpt2-block/attn/c_attn/w"][4:] == ["hidden", "repeat[12]",
                                                            "768→2304", "yes"]
    assert by["lm/gpt2/ln_f/scale"][4:] == ["norm", "-", "-", "no"]
    assert by["lm/gpt2/h/gpt2-block/ln_1/scale"][4:] == ["norm", "repeat[12]", "-", "no"]
    assert by["lm/gpt2/wte"][1:4] == ["f32[50257,768]", "(normal 0.02)", "38,597,376"]
    assert lines[-1] == "decay: adamw :weight-decay 0.1 reaches 4 of 16 parameters"


# --- a role the graph does not decide ------------------------------------------------------
AMBIGUOUS = """
(defloader train (markov :vocab 8 :seq 9 :batch 2 :seed 7))
(defn loss [batch]
  (let [x (one-hot (slice (get batch :tokens) 1 0 8) 8)
        w (param w [8 8] :init (normal 0.1)ROLE)]
    (mean (square (+ (matmul x w) w)))))
(defrun :loss loss :data train :steps 1 :precision f32 :seed 1
        :optimizer (adamw :lr 0.01 :weight-decay WD))
"""


def _ambiguous(role="", wd="0.1", extra=""):
  text = AMBIGUOUS.replace("ROLE", role).replace("WD", wd + extra)
  return compile_source(text, "ambiguous.sx")


def test_a_matrix_read_as_a_weight_and_as_an_added_table_is_e_role_001_at_its_param():
  c = _ambiguous()
  with pytest.raises(SxError) as e:
    decay_mask(c.exp.optimizer, c.stages[0].graph)
  err = e.value
  assert err.code == "E-ROLE-001"
  assert err.message.startswith("parameter w is read as embedding and as hidden")
  assert (err.location.file, err.location.line, err.location.col) == ("ambiguous.sx", 5, 11)
  assert "write :role embedding" in err.fix
  assert roles(c.stages[0].graph)["w"].text() == "embedding? (or hidden)"


def test_what_settles_an_undecided_role():
  declared = _ambiguous(" :role hidden")
  assert roles(declared.stages[0].graph)["w"].text() == "hidden (declared)"
  assert decay_mask(declared.exp.optimizer, declared.stages[0].graph) == {"w": True}
  named = _ambiguous(extra=' :no-decay ["w"]')
  assert decay_mask(named.exp.optimizer, named.stages[0].graph) == {"w": False}
  no_decay = _ambiguous(wd="0.0")  # nothing decays: the role is not needed
  assert decay_mask(no_decay.exp.optimizer, no_decay.stages[0].graph) == {"w": False}


def test_an_unknown_role_is_e_form_001_with_the_nearest():
  with pytest.raises(SxError) as e:
    _ambiguous(" :role hiden")
  assert e.value.code == "E-FORM-001"
  assert e.value.message == ("param :role is `hiden`; a role is one of embedding, readout, "
                             "hidden, expert, conv, norm, bias, other")
  assert e.value.fix == "did you mean `hidden`?"
  assert (e.value.location.line, e.value.location.col) == (5, 51)

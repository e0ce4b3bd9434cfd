"""The memory plan before any initializer (E-MEM-001) and every way of choosing the stacking."""

import json
import os
import subprocess

import jax
import pytest

import sexpgpu
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.errors import SxError
from test_flag_values import _cli
from test_std_namespace import CONFIGS

GPT = os.path.join(ROOT, "configs", "gpt2-small.sx")
TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _annotations(path, name):
  return [e for e in map(json.loads, open(path)) if e["kind"] == "annotation"
          and e["name"] == name]


@pytest.mark.slow  # compiles gpt2's smoke step to plan it
def test_64mib_refuses_gpt2_smoke_before_any_initializer(monkeypatch, tmp_path):
  import sexpgpu.run.training as training
  concrete = []
  real = training.init_params

  def spy(seed, params):
    out = real(seed, params)
    if any(not isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(out)):
      concrete.append(True)
    return out

  monkeypatch.setattr(training, "init_params", spy)
  monkeypatch.setenv("SEXPGPU_MEMORY", "64MiB")
  exp = sexpgpu.compile(GPT, variant="smoke")
  status = tmp_path / "s.json"
  with pytest.raises(sexpgpu.SxError) as e:
    exp.run(steps=2, status=str(status))
  assert e.value.code == "E-MEM-001"
  assert "parameters" in str(e.value) and "SEXPGPU_MEMORY=64MiB" in str(e.value)
  assert "--set batch=1" in str(e.value)  # the experiment's own knob that would shrink it
  assert concrete == []
  assert json.load(open(status))["state"] == "failed"


@pytest.mark.slow  # compiles gpt2's smoke step to plan it
def test_64mib_refusal_from_the_command_line(tmp_path):
  env = dict(os.environ, SEXPGPU_MEMORY="64MiB")
  p = subprocess.run(sexpgpu_cmd("run", GPT, "--variant", "smoke", "--steps", "2"), cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 1 and "error[E-MEM-001]" in p.stderr, p.stderr
  assert "step 0/" not in p.stderr and "Traceback" not in p.stderr


def _run(tmp_path, capsys, monkeypatch, name, env=None):
  """`sexpgpu run` of tiny-lm's smoke variant in this process (the stacking is chosen at the
  run, from its environment, as in a process of its own): its stacking annotation and its
  metrics file."""
  m = tmp_path / f"{name}.jsonl"
  with monkeypatch.context() as mp:
    for k, v in (env or {}).items():
      mp.setenv(k, v)
    code, _, err = _cli(capsys, "run", TINY, "--variant", "smoke", "--set", "microbatches=4",
                        "--steps", "2", "--eval-every", "0", "--metrics", f"jsonl:{m}")
  assert code == 0, err
  return _annotations(m, "stacking")[-1], m


def test_fixed_stacking(tmp_path, capsys, monkeypatch):
  st, _ = _run(tmp_path, capsys, monkeypatch, "fixed", {"SEXPGPU_STACKING": "2"})
  assert st["how"] == "fixed" and st["degree"] == 2 and st["text"] == "2: SEXPGPU_STACKING"


@pytest.mark.slow  # two runs
def test_only_one_fits(tmp_path, capsys, monkeypatch):
  st, _ = _run(tmp_path, capsys, monkeypatch, "all")
  plans = {int(d): t for d, t in st["plans"].items()}
  assert set(plans) == {1, 2, 4}
  small = min(plans, key=plans.get)
  others = sorted(t for d, t in plans.items() if d != small)
  assert plans[small] < others[0]
  memory = (plans[small] + others[0]) // 2
  st2, m = _run(tmp_path, capsys, monkeypatch, "only", {"SEXPGPU_MEMORY": str(memory)})
  assert st2["how"] == "only" and st2["degree"] == small
  assert st2["text"] == f"{small}: the only one that fits"
  mem = _annotations(m, "memory")[-1]
  assert mem["total"] <= memory and set(mem["parts"]) >= {"parameters", "optimizer states",
                                                          "gradients and accumulators"}


def test_cost_model_chooses_when_predictions_differ(tmp_path, capsys, monkeypatch):
  st, _ = _run(tmp_path, capsys, monkeypatch, "model",
               {"SEXPGPU_CACHE_DIR": str(tmp_path / "cache")})
  assert st["how"] in ("model", "measured")
  preds = {int(d): t for d, t in st["predicted"].items()}
  if st["how"] == "model":
    assert st["degree"] == min(preds, key=preds.get)
    assert st["text"].startswith(f"{st['degree']}: the cost model (")


@pytest.mark.slow  # two runs, one measuring three degrees
def test_measured_when_close_then_remembered(monkeypatch, tmp_path):
  import sexpgpu.run.planning.plan as plan
  monkeypatch.setattr(plan, "predict", lambda *a, **k: 0.001)  # a tie: measure
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  exp = sexpgpu.compile(TINY, variant="smoke", set={"microbatches": 4})
  m1 = tmp_path / "1.jsonl"
  first = exp.run(steps=3, metrics=f"jsonl:{m1}")
  notes = _annotations(m1, "stacking")
  assert notes[0]["how"] == "measure" and notes[-1]["how"] == "measured"
  assert "measured at the first step, the model within 5% could not separate them" in \
      notes[-1]["text"]
  choices = json.load(open(tmp_path / "cache" / "choices.json"))
  (entry,) = choices.values()
  assert entry["degree"] == notes[-1]["degree"] and set(entry["measured_s"]) == {"1", "2", "4"}
  m2 = tmp_path / "2.jsonl"
  second = exp.run(steps=3, metrics=f"jsonl:{m2}")
  again = _annotations(m2, "stacking")[-1]
  assert again["how"] == "remembered" and again["degree"] == entry["degree"]
  assert second.train_loss == first.train_loss  # the same degree, the same sums


@pytest.mark.slow  # two runs as subprocesses (one over two host devices)
def test_remembered_choices_are_kept_apart_by_rank_count(tmp_path):
  """A degree chosen for one device's share of the microbatches is not another count's."""
  env = dict(os.environ, SEXPGPU_CACHE_DIR=str(tmp_path / "cache"))
  for k in ("SEXPGPU_DEVICES", "SEXPGPU_STACKING"):
    env.pop(k, None)
  args = ("--variant", "smoke", "--set", "microbatches=4", "--steps", "2")
  notes = []
  for name, devices in (("one", None), ("two", "0,1")):
    m = tmp_path / f"{name}.jsonl"
    e = dict(env, **({"SEXPGPU_DEVICES": devices} if devices else {}))
    p = subprocess.run(sexpgpu_cmd("run", TINY, *args, "--metrics", f"jsonl:{m}"), cwd=ROOT,
                       env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    notes.append(_annotations(m, "stacking")[-1])
  assert notes[1]["how"] != "remembered"
  keys = sorted(json.load(open(tmp_path / "cache" / "choices.json")))
  assert len(keys) == 2 and keys[0].endswith("|cpu:cpu") and keys[1].endswith("|cpu:cpu x2")


# --- a fixed stacking degree ---------------------------------------------------------------

def test_a_stacking_degree_that_does_not_divide_is_e_env_001_before_any_compile(
    capsys, monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_STACKING", "3")
  monkeypatch.chdir(tmp_path)
  code, out, err = _cli(capsys, "run", os.path.join(CONFIGS, "tiny-lm.sx"), "--steps", "2",
                        "--metrics", f"jsonl:{tmp_path / 'm.jsonl'}")
  assert code == 1
  assert ("error[E-ENV-001]: SEXPGPU_STACKING=3 does not divide the 2 microbatches each rank "
          "runs in a step\n  --> SEXPGPU_STACKING\n   = fix: unset it (auto), or use a divisor: "
          "SEXPGPU_STACKING=2, SEXPGPU_STACKING=1\n") in err


def test_check_refuses_the_stacking_degree_that_run_refuses(capsys, monkeypatch, tmp_path):
  monkeypatch.setenv("SEXPGPU_STACKING", "3")
  for argv in (("check",), ("check", "--print", "plan")):
    code, out, err = _cli(capsys, *argv, os.path.join(CONFIGS, "tiny-lm.sx"))
    assert code == 1, argv
    assert "error[E-ENV-001]: SEXPGPU_STACKING=3 does not divide the 2 microbatches" in err
  monkeypatch.setenv("SEXPGPU_STACKING", "2")
  code, out, err = _cli(capsys, "check", os.path.join(CONFIGS, "tiny-lm.sx"))
  assert code == 0, err


def test_check_fixed_names_every_divisor():
  from sexpgpu.run.planning.plan import check_fixed
  check_fixed(3, 6)
  with pytest.raises(SxError) as e:
    check_fixed(4, 6)
  assert e.value.fix.endswith("SEXPGPU_STACKING=6, SEXPGPU_STACKING=3, SEXPGPU_STACKING=2, "
                              "SEXPGPU_STACKING=1")
  with pytest.raises(SxError) as e:
    check_fixed(2, 1)
  assert "the 1 microbatch each rank" in e.value.message

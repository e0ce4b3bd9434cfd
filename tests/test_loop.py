"""The loop keeps the device busy: batches drawn ahead, metrics read one step late; where the
time went (--profile, MFU, goodput)."""

import ast
import glob
import json
import os
import subprocess
import time
import types

import numpy as np
import pytest

import sexpgpu
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.data import synthetic

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
# Fields that measure time, not what was computed.
TIMED = ("time", "time/step", "time/data-wait", "time/pass", "throughput/tokens-per-second",
         "throughput/mfu", "seconds", "bytes")  # bytes: orbax's files carry their write times


def _events(path):
  """What the run computed, in order (annotations carry the free memory and timings)."""
  home = str(path.parent)
  return [{k: v.replace(home, "RUN") if isinstance(v, str) else v
           for k, v in e.items() if k not in TIMED + ("goodput",)}
          for e in map(json.loads, open(path))
          if e["kind"] in ("step", "pass", "checkpoint", "stage", "diagnostic", "summary")]


def _run_both(tmp_path, name, sets, steps):
  """The same run with the pipelined loop and with the plain one; their outputs."""
  out = {}
  for pipeline in (True, False):
    d = tmp_path / f"{name}-{pipeline}"
    d.mkdir()
    exp = sexpgpu.compile(TINY, variant="smoke", set=sets)
    err = None
    try:
      s = exp.run(steps=steps, metrics=f"jsonl:{d / 'm.jsonl'}", status=str(d / "s.json"),
                  checkpoint_dir=str(d / "ckpt"), pipeline=pipeline)
    except sexpgpu.SxError as e:
      s, err = None, e.code
    out[pipeline] = (d, s, err, exp)
  return out


def _checkpoints(d, exp):
  """Every step folder's arrays and meta (without versions), by step."""
  from sexpgpu.ckpt import restore_checkpoint
  from sexpgpu.run.training import build
  abstract = build(exp._c).abstract_state()
  got = {}
  for step_dir in sorted(glob.glob(str(d / "ckpt" / "*" / "*"))):
    if not os.path.basename(step_dir).isdigit():
      continue
    state, meta = restore_checkpoint(step_dir, abstract)
    meta.pop("versions", None)
    leaves = [np.asarray(x) for x in __import__("jax").tree_util.tree_leaves(state)]
    got[int(os.path.basename(step_dir))] = (leaves, meta)
  return got


def _status(d):
  s = json.loads((d / "s.json").read_text().replace(str(d), "RUN"))
  return {k: s[k] for k in ("state", "step", "stage", "train_loss", "last_pass", "counters",
                            "checkpoint", "error")}


def _assert_same(runs):
  (d1, s1, e1, x1), (d0, s0, e0, x0) = runs[True], runs[False]
  assert e1 == e0
  if s1 is not None:
    assert s1.train_loss == s0.train_loss and s1.eval == s0.eval and s1.counters == s0.counters
  assert _events(d1 / "m.jsonl") == _events(d0 / "m.jsonl")
  assert _status(d1) == _status(d0)
  c1, c0 = _checkpoints(d1, x1), _checkpoints(d0, x0)
  assert sorted(c1) == sorted(c0) and c1
  for step in c1:
    (l1, m1), (l0, m0) = c1[step], c0[step]
    assert m1 == m0
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(l1, l0))


@pytest.mark.slow  # two runs with checkpoints, pipelined and plain
def test_pipelined_loop_writes_what_the_plain_loop_writes(tmp_path):
  """Metrics, status and every checkpoint (arrays and loader positions), bitwise."""
  runs = _run_both(tmp_path, "ok", {"checkpoint-every": 3}, 12)
  assert runs[True][1].steps == 12
  _assert_same(runs)


@pytest.mark.slow  # two runs, pipelined and plain, to a NaN
def test_on_nan_stop_saves_the_same_last_finite_state_pipelined(tmp_path):
  runs = _run_both(tmp_path, "nan", {"lr": 1e30}, 6)
  assert runs[True][2] == "E-NUM-001"
  _assert_same(runs)


def _slow_loader(monkeypatch, seconds):
  real = synthetic.MarkovLoader.next

  def slow(self):
    time.sleep(seconds)
    return real(self)

  monkeypatch.setattr(synthetic.MarkovLoader, "next", slow)


def _waits(path):
  steps = [json.loads(line) for line in open(path)]
  steps = [e for e in steps if e["kind"] == "step"]
  return [e["time/data-wait"] for e in steps], [e["time/step"] for e in steps]


@pytest.mark.slow  # three runs timed against a slowed loader
def test_the_loop_does_not_wait_on_a_loader_faster_than_the_step(monkeypatch, tmp_path):
  sets = {"width": 256, "seq": 64}
  exp = sexpgpu.compile(TINY, variant="smoke", set=sets)
  exp.run(steps=8, metrics=f"jsonl:{tmp_path / 'base.jsonl'}")
  _, base = _waits(tmp_path / "base.jsonl")
  step = float(np.median(base[2:]))
  k = int(exp.knobs["microbatches"].value) if "microbatches" in exp.knobs else 2
  per_draw = 0.3 * step / k  # a step's draws take 30% of a step
  _slow_loader(monkeypatch, per_draw)
  got = {}
  for pipeline in (True, False):
    m = tmp_path / f"{pipeline}.jsonl"
    exp.run(steps=12, metrics=f"jsonl:{m}", pipeline=pipeline)
    waits, _ = _waits(m)
    got[pipeline] = sum(waits[2:])  # from the third step: the feed has filled its queue
  slept = 10 * k * per_draw
  assert got[False] >= 0.9 * slept  # the plain loop waits for every draw
  assert got[True] < 0.35 * slept, (got, slept)  # the pipelined one hides them behind steps


@pytest.mark.slow  # eight steps behind a loader slowed to 0.25 s a draw
def test_goodput_leaves_out_the_waits_on_a_slow_loader(monkeypatch, tmp_path):
  """The plain loop waits on the loader between steps, outside any step's time: goodput is
  at most the steps' share of steps and waits together, on a machine of any speed."""
  exp = sexpgpu.compile(TINY, variant="smoke")
  k = int(exp.knobs["microbatches"].value) if "microbatches" in exp.knobs else 2
  _slow_loader(monkeypatch, 0.25)
  m = tmp_path / "slow.jsonl"
  slow = exp.run(steps=8, metrics=f"jsonl:{m}", status=str(tmp_path / "slow.json"),
                 pipeline=False)
  waits, times = _waits(m)
  assert len(waits) == len(times) == 8
  assert sum(waits) >= 8 * k * 0.25  # every draw slept
  assert 0 < slow.goodput <= sum(times) / (sum(times) + sum(waits)) + 5e-5  # 4 places
  summary = [json.loads(line) for line in open(m)][-1]
  assert summary["kind"] == "summary" and summary["goodput"] == slow.goodput
  assert json.load(open(tmp_path / "slow.json"))["goodput"] == slow.goodput


@pytest.mark.slow  # a profiled run in a subprocess
def test_profile_writes_a_trace_and_names_the_top_ops(tmp_path):
  prof = tmp_path / "prof"
  p = subprocess.run(sexpgpu_cmd("run", TINY, "--variant", "smoke", "--steps", "6",
                                 "--profile", "2..4", "--profile-dir", str(prof)),
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr
  lines = p.stderr.splitlines()
  (i,) = [n for n, line in enumerate(lines) if line.startswith("profile: ")]
  assert lines[i - 1].startswith("timing total ") and lines[i + 1].startswith("done: ")
  assert lines[i].startswith(f"profile: steps 2..4 in {prof}; top: ")
  tops = lines[i].split("; top: ")[1].split(", ")
  assert 1 <= len(tops) <= 5 and all(t.endswith("%") for t in tops)
  assert glob.glob(str(prof / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert glob.glob(str(prof / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))


@pytest.mark.parametrize("flag,env", [(("--profile", "4..2"), {}),
                                      ((), {"SEXPGPU_PROFILE": "many"})])
def test_a_bad_profile_range_is_e_env_001_naming_where_it_came_from(flag, env, monkeypatch,
                                                                    capsys):
  from sexpgpu.cli.main import main
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  code = main(["run", TINY, "--steps", "1", *flag])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-ENV-001]" in err, err
  assert (flag[0] if flag else "SEXPGPU_PROFILE") in err
  assert "Traceback" not in err and "step 0/" not in err


def test_mfu_peaks_are_matched_on_the_exact_device_name():
  from sexpgpu.lower.flops import device_peak, gpu_peak
  assert gpu_peak("NVIDIA L4", "bf16") == 121e12
  assert gpu_peak("NVIDIA L40S", "bf16") == 362e12
  assert gpu_peak("NVIDIA H100 80GB HBM3", "f32") == 989e12 / 2
  for unknown in ("L4", "NVIDIA L4X", "NVIDIA L40S (MIG 1g.12gb)", "Tesla L4 vGPU", ""):
    assert gpu_peak(unknown, "bf16") is None
  card = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA L40S")
  assert device_peak(card, "bf16") == 362e12


def test_a_causal_attentions_products_count_half():
  from sexpgpu.lower.flops import node_flops
  q = types.SimpleNamespace(shape=(2, 4, 16, 8))

  def sdpa(causal):
    return types.SimpleNamespace(op="sdpa", inputs=[q, q, q],
                                 attr=lambda name: {"causal": causal}[name])

  full = 2 * 2 * 2 * 4 * 16 * 16 * 8
  assert node_flops(sdpa(False)) == full and node_flops(sdpa(True)) == full // 2


@pytest.mark.slow  # runs to a NaN pass metric
def test_a_pass_metric_that_is_not_finite_stops_the_run(tmp_path):
  """Every step finite, the evaluation not: the run must not end as if that were a result."""
  text = open(TINY).read().replace(
      "(defpass eval :data valid :every 10 :batches 2 :metrics [loss])",
      "(defn blowup [batch]\n"
      "  (let [t (get batch :tokens)] (log (* 0.0 (next-token-loss (lm (lm-inputs t)) t)))))\n"
      "(defpass eval :data valid :every 10 :batches 2 :metrics [loss blowup])")
  assert "blowup" in text
  sx = tmp_path / "blowup.sx"
  sx.write_text(text)
  status = tmp_path / "s.json"
  with pytest.raises(sexpgpu.SxError) as e:
    sexpgpu.compile(str(sx), variant="smoke").run(steps=4, status=str(status))
  assert e.value.code == "E-NUM-001" and "eval/blowup is not finite at step 0" in str(e.value)
  assert json.load(open(status))["state"] == "failed"
  skip = sexpgpu.compile(str(sx), variant="smoke", set={"on-nan": "skip"}).run(steps=4)
  assert skip.eval["eval/blowup"] == float("-inf") and np.isfinite(skip.eval["eval/loss"])


def _functions(path):
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_loop_reads_top_to_bottom_in_one_function():
  """Set up, plan, initialize or restore, the loop and finish in `_train`: no closure
  inside it, its parts (feed, passes, steps, saver, stop) in helpers of their own, and the
  step runner's pipelining its own (no `pending` set, no `drain` called by the loop)."""
  train = _functions(os.path.join(ROOT, "sexpgpu", "run", "loop.py"))["_train"]
  nested = [n.name for n in ast.walk(train)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not train]
  assert nested == []
  called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(train) if isinstance(n, ast.Call)}
  assert {"Feed", "Passes", "Steps", "Saver", "Stop", "step", "flush", "save"} <= called
  assert "drain" not in called and "dispatch" not in called
  touched = {n.attr for n in ast.walk(train) if isinstance(n, ast.Attribute)}
  assert "pending" not in touched


# The most parameters a function of run/ takes. `self` and `cls` are not counted; every
# other name is, keyword-only ones too, and `*args` and `**kwargs` count one each: a
# function that takes many things by name takes many things.
MOST_PARAMETERS = 6


def parameters(fn) -> int:
  """The parameters `fn` (an ast function or lambda) takes, as MOST_PARAMETERS counts them."""
  a = fn.args
  names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
  if names and names[0] in ("self", "cls") and not isinstance(fn, ast.Lambda):
    names = names[1:]
  return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_counting_parameters_leaves_out_self_and_counts_star_args_once():
  tree = ast.parse("class A:\n  def m(self, a, b=1, *rest, c, **kw): pass\n"
                   "def f(a, /, b, *, c): pass\nlambda: 0\n")
  found = {getattr(n, "name", "lambda"): parameters(n) for n in ast.walk(tree)
           if isinstance(n, (ast.FunctionDef, ast.Lambda))}
  assert found == {"m": 5, "f": 3, "lambda": 0}


def test_no_function_of_run_takes_more_than_six_parameters():
  """Helpers take a run context (run/context.py) or a small frozen dataclass, not the run's
  parts one by one."""
  wide = {}
  folder = os.path.join(ROOT, "sexpgpu", "run")
  for dirpath, _, files in os.walk(folder):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        with open(path, encoding="utf-8") as f:
          tree = ast.parse(f.read(), path)
        for n in ast.walk(tree):
          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and (
              parameters(n) > MOST_PARAMETERS):
            where = f"{os.path.relpath(path, folder)}:{n.lineno}"
            wide[f"{where} {getattr(n, 'name', 'lambda')}"] = parameters(n)
  assert wide == {}


def test_a_retried_fetch_is_an_annotation_on_the_metrics_stream(monkeypatch, tmp_path):
  from sexpgpu import retrying
  real = synthetic.MarkovLoader.next
  tries = []

  def flaky_next(self):
    def fetch():
      tries.append(1)
      if len(tries) == 1:
        raise ConnectionResetError("the store hung up")
      return real(self)
    return retrying.call("a fetch of shard 0", fetch, timeout_s=30, prefix="data")

  monkeypatch.setattr(synthetic.MarkovLoader, "next", flaky_next)
  monkeypatch.setattr(retrying, "FIRST_PAUSE_S", 0.0)
  m = tmp_path / "m.jsonl"
  sexpgpu.compile(TINY, variant="smoke").run(steps=2, metrics=f"jsonl:{m}", pipeline=False)
  notes = [(e["name"], e["text"]) for e in map(json.loads, open(m))
           if e["kind"] == "annotation" and e["name"].startswith("retry")]
  assert [name for name, _ in notes] == ["retry", "retry-succeeded"]
  assert notes[0][1] == ("data: a fetch of shard 0 failed (ConnectionResetError: the store hung "
                         "up); retrying for up to 30s")
  assert notes[1][1].startswith("data: a fetch of shard 0 succeeded after 2 tries in ")
  assert retrying._LISTENERS == []  # the run stopped listening when it ended

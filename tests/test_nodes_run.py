"""Several nodes rehearsed on the CPU: two processes over loopback (gloo), one device each."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, sexpgpu_cmd
from s3server import free_port

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
ARGS = ("--variant", "smoke", "--steps", "12", "--eval-every", "6")


def _env(rank, port, gradients="f32", extra=None):
  e = dict(os.environ)
  for k in ("SEXPGPU_DEVICES", "SEXPGPU_STACKING"):
    e.pop(k, None)
  e.update({"SEXPGPU_NODES": "2", "SEXPGPU_NODE_RANK": str(rank),
            "SEXPGPU_RENDEZVOUS": f"127.0.0.1:{port}", "SEXPGPU_CPU_COLLECTIVES": "gloo",
            "SEXPGPU_NODE_GRADIENTS": gradients, "SEXPGPU_RENDEZVOUS_TIMEOUT": "60"})
  e.update(extra or {})
  return e


def _start(tmp, rank, port, args, gradients="f32", extra_env=None, name="m"):
  metrics = tmp / f"{name}{rank}.jsonl"
  return subprocess.Popen(
      sexpgpu_cmd("run", TINY, *args, "--metrics", f"jsonl:{metrics}", "--json"), cwd=ROOT,
      env=_env(rank, port, gradients, extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)


def _two_nodes(tmp, args=ARGS, gradients="f32", env1=None, env=None, name="m"):
  """Both nodes run to their end: `env` on both, `env1` on node 1 only."""
  port = free_port()
  envs = [dict(env or {}), {**(env or {}), **(env1 or {})}]
  procs = [_start(tmp, r, port, args, gradients, envs[r], name) for r in (0, 1)]
  return [(p, *p.communicate(timeout=600)) for p in procs]


def _losses(path):
  return [e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"]


def _steps_logged(path):
  """How many steps node 0 has logged so far, read while it writes (a line being written,
  cut off, is not one yet)."""
  try:
    lines = path.read_text().split("\n")[:-1]
  except OSError:
    return 0
  return sum('"kind":"step"' in ln for ln in lines)


@pytest.fixture(scope="module")
def one_process_two_devices(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("one")
  m = tmp / "m.jsonl"
  env = dict(os.environ, SEXPGPU_DEVICES="0,1")
  p = subprocess.run(sexpgpu_cmd("run", TINY, *ARGS, "--metrics", f"jsonl:{m}", "--json"),
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr
  return json.loads(p.stdout), _losses(m)


@pytest.mark.slow  # two processes over gloo
def test_two_nodes_bf16_within_tolerance_of_f32(one_process_two_devices, tmp_path):
  summary, losses = one_process_two_devices
  (p0, out0, err0), (p1, _, err1) = _two_nodes(tmp_path, gradients="bf16")
  assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
  bf = _losses(tmp_path / "m0.jsonl")
  assert bf != losses  # the sum between nodes really travelled in bf16
  np.testing.assert_allclose(bf, losses, rtol=0, atol=0.02)


def test_cpu_nodes_need_gloo_e_dp_005(tmp_path):
  env = _env(0, free_port())
  env.pop("SEXPGPU_CPU_COLLECTIVES")
  p = subprocess.run(sexpgpu_cmd("run", TINY, *ARGS), cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=120)
  assert p.returncode == 1 and "error[E-DP-005]" in p.stderr


@pytest.mark.slow  # two processes over gloo
@pytest.mark.parametrize("other,said", [
    (("--set", "lr=0.5"), "experiment"),
    # outside the fingerprint (a resume may change it), yet the nodes must share it
    (("--set", "sharding=fsdp"), ":sharding fsdp on node 1, replicate on node 0")])
def test_a_node_with_another_experiment_is_e_dp_006(tmp_path, other, said):
  port = free_port()
  procs = [_start(tmp_path, 0, port, ARGS), _start(tmp_path, 1, port, ARGS + other)]
  results = [(p, *p.communicate(timeout=600)) for p in procs]
  for p, out, err in results:
    assert p.returncode == 1 and "error[E-DP-006]" in err, err
    assert said in err, err
  assert "node 1" in results[0][2]


@pytest.mark.slow  # a process waits for its absent peer
def test_an_absent_node_is_e_dp_007(tmp_path):
  t = time.time()
  p = _start(tmp_path, 0, free_port(), ARGS, extra_env={"SEXPGPU_RENDEZVOUS_TIMEOUT": "3"})
  out, err = p.communicate(timeout=120)
  assert p.returncode == 1 and "error[E-DP-007]" in err, err
  assert time.time() - t < 60


@pytest.mark.slow  # two processes over gloo, stopped and resumed
def test_two_nodes_f32_train_bitwise_as_one_node_of_two_through_a_sigterm_and_resume(
    one_process_two_devices, tmp_path):
  """Two nodes of one device each train bitwise as one process of two devices: every step's
  loss, the evaluations, the counters, on both nodes; node 0 alone writes the metrics and
  nothing of gloo's reaches the user. The same pair is stopped by SIGTERM to node 1 alone
  partway (both stop, at the same step), and both resumed with --resume latest finish the
  one-process run's steps bitwise (one pair checked for both: a resume is bitwise, so the
  steps after it are the uninterrupted two-node run's)."""
  summary, losses = one_process_two_devices
  ck = tmp_path / "ck"
  args = ARGS + ("--checkpoint-dir", str(ck))
  port = free_port()
  procs = [_start(tmp_path, r, port, args) for r in (0, 1)]
  m0 = tmp_path / "m0.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and procs[0].poll() is None:
    if _steps_logged(m0) >= 3:
      break
    time.sleep(0.005)
  procs[1].send_signal(signal.SIGTERM)  # the signal reaches node 1 only
  results = [(p, *p.communicate(timeout=300)) for p in procs]
  assert "device cpu ranks 2 nodes 2" in results[0][2].splitlines()[0]
  stopped = [json.loads(out) for _, out, _ in results]
  for (p, out, err), s in zip(results, stopped):
    assert p.returncode == 143, err
    assert s["stopped_by"] == "SIGTERM"
    assert "Gloo" not in out + err and "Traceback" not in err
  assert stopped[0]["steps"] == stopped[1]["steps"] < 12
  assert _losses(m0) == losses[:stopped[0]["steps"]]
  port = free_port()
  procs = [_start(tmp_path, r, port, args + ("--resume", "latest")) for r in (0, 1)]
  results = [(p, *p.communicate(timeout=600)) for p in procs]
  for p, out, err in results:
    assert p.returncode == 0, err
    assert f"resume latest={ck}/tiny-lm-smoke/{stopped[0]['steps']}" in err
    assert "Gloo" not in out + err and "Traceback" not in err
  assert _losses(m0) == losses
  assert not (tmp_path / "m1.jsonl").exists()  # node 0 writes the metrics
  s0, s1 = (json.loads(out) for _, out, _ in results)
  for key in ("train_loss", "eval", "counters"):
    assert s0[key] == summary[key] == s1[key], key


def _annotation(path, name):
  return [e for e in map(json.loads, open(path)) if e["kind"] == "annotation"
          and e["name"] == name][-1]


@pytest.mark.slow  # two processes over gloo
def test_two_nodes_stacked_below_their_share_train_bitwise_as_one_node(tmp_path):
  """Four microbatches, two a rank, one a call: each rank sums its own, combined once."""
  args = ARGS + ("--set", "microbatches=4")
  m = tmp_path / "one.jsonl"
  env = dict(os.environ, SEXPGPU_DEVICES="0,1", SEXPGPU_STACKING="1")
  p = subprocess.run(sexpgpu_cmd("run", TINY, *args, "--metrics", f"jsonl:{m}", "--json"),
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr
  port = free_port()
  procs = [_start(tmp_path, r, port, args, extra_env={"SEXPGPU_STACKING": "1"}) for r in (0, 1)]
  (p0, out0, err0), (p1, out1, err1) = [(q, *q.communicate(timeout=600)) for q in procs]
  assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
  assert _annotation(tmp_path / "m0.jsonl", "stacking")["degree"] == 1
  assert _losses(tmp_path / "m0.jsonl") == _losses(m)
  assert json.loads(out0)["eval"] == json.loads(p.stdout)["eval"] == json.loads(out1)["eval"]


@pytest.mark.slow  # two processes over gloo
def test_two_nodes_choose_one_stacking_without_measuring(tmp_path):
  (p0, _, err0), (p1, _, err1) = _two_nodes(tmp_path, ARGS + ("--set", "microbatches=4"))
  assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
  st = _annotation(tmp_path / "m0.jsonl", "stacking")
  assert st["how"] in ("only", "model", "remembered") and st["degree"] in (1, 2), st


# A node killed: a short run that checkpoints often, so that a kill lands in a checkpoint's
# write when asked to, and the watchdog short, so that the wait it ends costs little.
KILL_ARGS = ("--variant", "smoke", "--steps", "60", "--eval-every", "0", "--set",
             "checkpoint-every=5")
KILL_ENV = {"SEXPGPU_RENDEZVOUS_TIMEOUT": "20"}
KILL_SLUG = "tiny-lm-smoke-checkpoint-every=5"


def _kill_args(tmp):
  return KILL_ARGS + ("--checkpoint-dir", str(tmp / "ck"), "--status", str(tmp / "status.json"))


def _step_losses(path):
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


@pytest.fixture(scope="module")
def two_nodes_uninterrupted(tmp_path_factory):
  """The kill tests' command, run to its end on two nodes: {step: loss} and the summary."""
  tmp = tmp_path_factory.mktemp("whole")
  (p0, out0, err0), (p1, _, err1) = _two_nodes(tmp, _kill_args(tmp), env=KILL_ENV)
  assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
  return _step_losses(tmp / "m0.jsonl"), json.loads(out0)


def _writing(run_dir):
  """Whether node 0 is writing a checkpoint: orbax's tmp folder for a step, or the newest
  step folder without the manifest that completes it (not an old one being pruned)."""
  try:
    names = [n for n in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, n))]
  except OSError:
    return False
  steps = sorted(int(n) for n in names if n.isdigit())
  return (any(not n.isdigit() for n in names)
          or bool(steps) and not os.path.isfile(os.path.join(run_dir, str(steps[-1]),
                                                             "MANIFEST.json")))


def _kill_at(procs, tmp, victim, when):
  """kill -9 of node `victim` once 12 steps are logged: "checkpoint" while node 0 writes a
  checkpoint, "step" while it writes none; returns the time of the kill."""
  m0, run_dir = tmp / "m0.jsonl", tmp / "ck" / KILL_SLUG
  deadline, started = time.time() + 300, False
  while time.time() < deadline and all(p.poll() is None for p in procs):
    started = started or _steps_logged(m0) >= 12
    if started and _writing(run_dir) == (when == "checkpoint"):
      procs[victim].kill()
      return time.time()
    time.sleep(0.002)
  pytest.fail("the run ended before the kill")


# each node killed once and each moment met once: a peer (node 1) dies during a step, the
# coordinator (node 0) during a checkpoint; the other two pairings ran here until the suite
# outgrew its 20 minutes
@pytest.mark.slow  # two processes over gloo, one killed, both resumed
@pytest.mark.parametrize("victim,when", [(1, "step"), (0, "checkpoint")])
def test_a_node_killed_ends_the_survivor_with_e_dp_007_then_both_resume(
    two_nodes_uninterrupted, tmp_path, victim, when):
  """kill -9 of one node, mid-step or in a checkpoint's write: the other exits 1 with
  E-DP-007 naming the node that left and the last committed checkpoint, within the watchdog
  time, never with JAX's abort (a signal, a C++ stack). After a kill in a write (a partial
  step on disk, or node 0's last step written but not agreed), both restarted with
  --resume latest train on bitwise as the uninterrupted run."""
  reference, summary = two_nodes_uninterrupted
  args = _kill_args(tmp_path)
  port = free_port()
  procs = [_start(tmp_path, r, port, args, extra_env=KILL_ENV) for r in (0, 1)]
  try:
    t = _kill_at(procs, tmp_path, victim, when)
    survivor = procs[1 - victim]
    out, err = survivor.communicate(timeout=300)
    took = time.time() - t
  finally:
    for p in procs:  # the victim, and a survivor that did not end
      if p.poll() is None:
        p.kill()
      if not p.stdout.closed:
        p.communicate(timeout=60)
  assert survivor.returncode == 1, err  # not -6: JAX's abort never came first
  assert "Check failure" not in err and "Traceback" not in err and "***" not in err, err
  line = next(ln for ln in err.splitlines() if ln.startswith("error[E-DP-007]"))
  assert f"node {victim} " in line and f"node {1 - victim} of 2" in line, line
  ck = tmp_path / "ck" / KILL_SLUG
  assert f"the last committed checkpoint is {ck}/" in line, line
  # Node 0's loss is seen at once (the relay); node 1's too in a collective, but node 0
  # waiting for it at a checkpoint's barrier or exchange waits out the watchdog's timeout.
  assert took < (float(KILL_ENV["SEXPGPU_RENDEZVOUS_TIMEOUT"]) + 15 if victim else 15), took
  if victim == 1:  # node 0 writes the status
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and status["error"]["code"] == "E-DP-007", status
  if when != "checkpoint":
    return
  committed = int(line.rsplit("/", 1)[1].split()[0])
  (p0, out0, err0), (p1, _, err1) = _two_nodes(tmp_path, args + ("--resume", "latest"),
                                               env=KILL_ENV, name="r")
  assert p0.returncode == 0 and p1.returncode == 0, err0 + err1
  resumed = _step_losses(tmp_path / "r0.jsonl")
  start = min(resumed) - 1
  assert f"resume latest={ck}/{start}" in err0
  assert start >= committed  # never an older checkpoint than the one the error named
  assert resumed == {s: v for s, v in reference.items() if s > start}
  assert json.loads(out0)["eval"] == summary["eval"]


# The watchdog told by the relay that node 0 left, in a process of its own (it exits).
LEFT = r"""
import sys, time
from sexpgpu import env
from sexpgpu.devices import nodes
nodes.LEFT_GRACE_S = 0.5
wd = nodes.Watchdog(env.NodeConfig(nodes=2, rank=1, host="127.0.0.1", port=9),
                    60, lambda err: print("status failed", err.code, flush=True))
wd.checkpoint = lambda: "ck/run/10"
wd.left("node 0", "node 0 at 127.0.0.1:9 closed the connection")
if sys.argv[1] == "finishing":
  wd.finish()
time.sleep(0.2)
print("alive", flush=True)
if sys.argv[1] == "waits":
  wd.arm("barrier saved-15")
time.sleep(2)
print("ended", flush=True)
"""


@pytest.mark.parametrize("then", ["waits", "idle", "finishing"])
def test_node_0_seen_leaving_ends_the_run_at_the_next_wait_or_after_a_grace(then):
  """Seen while this node waits on none (computing, finishing), node 0's loss is no error
  yet: the next wait ends the run with E-DP-007, or the grace does; a finishing process
  (its exit handlers run) ends as it would."""
  t = time.monotonic()
  p = subprocess.run([sys.executable, "-c", LEFT, then], cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  took = time.monotonic() - t
  assert p.stdout.startswith("alive\n"), (p.stdout, p.stderr)
  if then == "finishing":
    assert p.returncode == 0 and p.stdout.endswith("ended\n"), p.stderr
    return
  assert p.returncode == 1 and "ended" not in p.stdout and "status failed E-DP-007" in p.stdout
  what = "barrier saved-15" if then == "waits" else "its link to node 0"
  assert (f"error[E-DP-007]: node 0 left the run: node 1 of 2 saw {what} fail (node 0 at "
          "127.0.0.1:9 closed the connection); the last committed checkpoint is ck/run/10"
          ) in p.stderr, p.stderr
  assert took < 2, took  # the wait at once, the grace after 0.5 s: never the 2 s sleep

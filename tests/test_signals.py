"""A stop signal at any moment of a run: exit 128 + n, status `stopped` by that signal, and
a last line that says where the run stopped and where its checkpoint is."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import sexpgpu
from conftest import ROOT, sexpgpu_cmd
from sexpgpu.data import synthetic
from sexpgpu.run import signals

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
STARTUP_LINE = "stopped: {} during start-up; nothing saved"
# A stop during start-up once the run knows it has no checkpoint location (the plan, the compile).
NO_LOCATION = "stopped: {} at step 0; no checkpoint location: nothing saved"

MOMENTS = 20  # spread over the first two seconds
SPAN = 2.0


def _spawn_blocked(cmd, **kw):
  """A child that starts with the stop signals blocked, so that one sent before the
  interpreter reaches our first import stays pending until the CLI's handlers unblock it.
  The mask is set in this thread around the spawn, which the child inherits, not in a
  preexec_fn: that forks this process, which has JAX's threads (and W&B's, after
  tests/test_wandb_target.py), and a fork that runs Python in the child can hang on a lock
  one of them held, leaving the child deaf to every signal."""
  old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, list(signals.SIGNALS))
  try:
    return subprocess.Popen(cmd, cwd=ROOT, **kw)
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _start(status):
  return _spawn_blocked(
      sexpgpu_cmd("run", "configs/tiny-lm.sx", "--variant", "smoke", "--steps", "100000",
                  "--eval-every", "0", "--status", str(status)),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_signal_at_twenty_moments(tmp_path):
  sigs = list(signals.SIGNALS)
  cases = [(i * SPAN / (MOMENTS - 1), sigs[i % len(sigs)]) for i in range(MOMENTS)]
  results = []
  for batch in range(0, MOMENTS, 4):  # four runs at once keep the test short
    procs = []
    for j, (at, sig) in enumerate(cases[batch:batch + 4]):
      status = tmp_path / f"s{batch + j}.json"
      procs.append((at, sig, status, _start(status), time.monotonic()))
    for at, sig, status, p, t0 in sorted(procs, key=lambda x: x[0]):
      time.sleep(max(0.0, t0 + at - time.monotonic()))
      p.send_signal(sig)
    for at, sig, status, p, _ in procs:
      err = p.communicate(timeout=300)[1].decode()
      results.append((at, sig, p.returncode, status, err))
  for at, sig, code, status, err in results:
    what = f"{signals.SIGNALS[sig]} at {at:.2f}s"
    assert code == 128 + sig, f"{what}: exit {code}\n{err}"
    assert "Traceback" not in err and "error[" not in err, f"{what}\n{err}"
    st = json.loads(status.read_text())
    assert st["state"] == "stopped", f"{what}: {st}"
    name = signals.SIGNALS[sig]
    assert st["stopped_by"] == name, f"{what}: {st}"
    last = err.splitlines()[-1]
    in_loop = last == (f"stopped: {name} at step {st['step']}; no checkpoint location: "
                       "nothing saved")
    assert in_loop or (st["step"] == 0 and last in (STARTUP_LINE.format(name),
                                                    NO_LOCATION.format(name))), f"{what}\n{err}"


def test_a_stop_during_start_up_says_so_and_records_its_signal(tmp_path):
  status = tmp_path / "s.json"
  p = _start(status)
  p.send_signal(signal.SIGHUP)  # pending until the CLI's first import unblocks it
  err = p.communicate(timeout=300)[1].decode()
  assert p.returncode == 129, err
  assert err.splitlines()[-1] == STARTUP_LINE.format("SIGHUP")
  st = json.loads(status.read_text())
  assert (st["state"], st["stopped_by"], st["step"]) == ("stopped", "SIGHUP", 0)


def _signal_at_draw(monkeypatch, n: int, sig: int) -> None:
  """The training loader's n-th draw (1-based) sends `sig` to this process."""
  real = synthetic.MarkovLoader.next
  draws = []

  def next_(self):
    draws.append(1)
    if len(draws) == n:
      signal.raise_signal(sig)
    return real(self)

  monkeypatch.setattr(synthetic.MarkovLoader, "next", next_)


def _stop_in_the_loop(monkeypatch, tmp_path, location, at_step=3):
  """A run of 50 steps that SIGTERM stops while step `at_step` draws its batches (the plain
  loop draws in this thread, so the signal lands at a known step); its summary."""
  exp = sexpgpu.compile(TINY, variant="smoke")
  k = int(exp.knobs["microbatches"].value) if "microbatches" in exp.knobs else 2
  _signal_at_draw(monkeypatch, k * (at_step - 1) + 1, signal.SIGTERM)
  return exp.run(steps=50, checkpoint_dir=location, status=str(tmp_path / "s.json"),
                 pipeline=False, quiet=False)


def test_a_stop_inside_the_loop_names_its_signal_step_and_checkpoint(monkeypatch, tmp_path,
                                                                     capsys):
  s = _stop_in_the_loop(monkeypatch, tmp_path, str(tmp_path / "ck"))
  step_dir = str(tmp_path / "ck" / s.slug / "3")
  assert (s.steps, s.stopped_by, s.exit_code, s.checkpoint) == (3, "SIGTERM", 143, step_dir)
  st = json.loads((tmp_path / "s.json").read_text())
  assert (st["state"], st["stopped_by"], st["step"]) == ("stopped", "SIGTERM", 3)
  assert st["checkpoint"] == {"step": 3, "location": step_dir}
  err = capsys.readouterr().err.splitlines()
  assert err[-1] == (f"stopped: SIGTERM at step 3; checkpoint {step_dir}; continue with "
                     "--resume latest")
  assert err[-5].startswith("done: 3 steps, train/loss ")  # the done block, as before


def test_a_stop_without_a_location_says_nothing_was_checkpointed(monkeypatch, tmp_path, capsys):
  s = _stop_in_the_loop(monkeypatch, tmp_path, None, at_step=2)
  assert (s.steps, s.stopped_by, s.checkpoint) == (2, "SIGTERM", None)
  assert capsys.readouterr().err.splitlines()[-1] == (
      "stopped: SIGTERM at step 2; no checkpoint location: nothing saved")


@pytest.mark.slow  # S3 on the session's moto server
def test_a_stop_on_s3_names_the_remote_step_folder(monkeypatch, tmp_path, capsys, s3_bucket):
  bucket, fs = s3_bucket
  s = _stop_in_the_loop(monkeypatch, tmp_path, f"s3://{bucket}/runs", at_step=2)
  step_dir = f"s3://{bucket}/runs/{s.slug}/2"
  assert (s.steps, s.stopped_by, s.checkpoint) == (2, "SIGTERM", step_dir)
  assert fs.exists(f"{bucket}/runs/{s.slug}/2")
  assert capsys.readouterr().err.splitlines()[-1] == (
      f"stopped: SIGTERM at step 2; checkpoint {step_dir}; continue with --resume latest")


def test_flag_records_the_first_signal():
  before = signal.getsignal(signal.SIGHUP)
  flag = signals.Flag()
  assert flag.install(raising=False)
  try:
    signal.raise_signal(signal.SIGHUP)
    signal.raise_signal(signal.SIGTERM)
    assert flag.received == signal.SIGHUP and flag.name == "SIGHUP"
  finally:
    flag.restore()
  assert signal.getsignal(signal.SIGHUP) is before


def test_armed_flag_raises_stopped():
  flag = signals.Flag()
  flag.install(raising=True)
  try:
    with pytest.raises(signals.Stopped) as e:
      signal.raise_signal(signal.SIGTERM)
    assert e.value.exit_code == 143
    signal.raise_signal(signal.SIGINT)  # a second one while unwinding is only recorded
    assert flag.received == signal.SIGTERM
  finally:
    flag.restore()


def test_stop_waits_for_an_import_to_finish(tmp_path, monkeypatch):
  (tmp_path / "slow_mod.py").write_text(
      "import signal, time\nsignal.raise_signal(signal.SIGTERM)\nx = sum(range(10))\n"
      "DONE = True\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  flag = signals.Flag()
  flag.install(raising=True)
  try:
    with pytest.raises(signals.Stopped):
      import slow_mod  # noqa: F401
      time.sleep(1.0)  # the timer's retry raises here, after the import
    import sys
    assert sys.modules["slow_mod"].DONE
  finally:
    flag.restore()


# In a fresh interpreter, where a collection runs only this callback (in a long-lived pytest
# worker it also runs weakref callbacks, the case of the test above).
_GC_STOP = """
import gc, signal, sys, time
from sexpgpu.run import signals
ran = []
def callback(phase, info):
  if phase == "start" and not ran:
    ran.append(phase)
    signal.raise_signal(signal.SIGTERM)
flag = signals.Flag()
flag.install(raising=True)
gc.callbacks.append(callback)
try:
  gc.collect()
  time.sleep(1.0)  # the timer's retry raises here, after the callback
  print("not stopped", ran)
except signals.Stopped as e:
  print("stopped", e.exit_code, ran)
"""


# A weakref callback run by a collection: its frame is like any other, so the stop is raised
# there, dropped by Python (sys.unraisablehook), armed again and raised after it.
_WEAKREF_STOP = """
import gc, signal, sys, time, weakref
from sexpgpu.run import signals
class Node:
  pass
ran = []
def callback(ref):
  ran.append("weakref")
  signal.raise_signal(signal.SIGTERM)
flag = signals.Flag()
flag.install(raising=True)
gc.disable()
node = Node()
node.me = node  # a cycle: only a collection frees it
ref = weakref.ref(node, callback)
del node
try:
  gc.collect()
  time.sleep(1.0)  # the re-armed stop raises here
  print("not stopped", ran)
except signals.Stopped as e:
  print("stopped", e.exit_code, ran)
"""


def test_a_stop_dropped_in_a_weakref_callback_is_raised_again():
  p = subprocess.run([sys.executable, "-c", _WEAKREF_STOP], cwd=ROOT, capture_output=True,
                     text=True, timeout=120)
  assert p.stdout.split() == ["stopped", "143", "['weakref']"], p.stdout + p.stderr
  assert "Exception ignored" not in p.stderr, p.stderr


def test_a_stop_inside_a_gc_callback_is_not_dropped():
  """jax's garbage-collector callback was where a Ctrl-C during a compile often landed: the
  Stopped raised there was printed and dropped by the collector, and the run went on to
  compile for seconds more. The stop waits for the callback and is raised after it."""
  p = subprocess.run([sys.executable, "-c", _GC_STOP], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert p.stdout.split() == ["stopped", "143", "['start']"], p.stdout + p.stderr
  assert "Exception ignored" not in p.stderr, p.stderr


def test_deferred_records_only():
  with signals.deferred() as flag:
    signal.raise_signal(signal.SIGINT)
    assert flag.received == signal.SIGINT
  assert signal.getsignal(signal.SIGINT) is not flag._handle


def _cold_run(tmp_path, tag):
  """tiny-lm with an empty XLA cache (so it compiles), eval at step 0, SIGINT as in a shell."""
  cache = tmp_path / f"cache-{tag}"
  status = tmp_path / f"{tag}.json"
  # SIGINT as a terminal's Ctrl-C meets it: a handler, which exec resets to the default (not
  # ignored, as for a background job).
  old_int = signal.getsignal(signal.SIGINT)
  if old_int is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    p = _spawn_blocked(
        sexpgpu_cmd("run", "configs/tiny-lm.sx", "--variant", "smoke", "--steps", "100000",
                    "--eval-every", "5", "--status", str(status)),
        env={**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
             "SEXPGPU_CACHE_DIR": str(cache)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, old_int)
  return p, status


def _state(status):
  try:
    return json.loads(status.read_text()).get("state")
  except (OSError, ValueError):
    return None


@pytest.mark.parametrize("moment", ["importing", "compiling", "compiling+1s"])
def test_ctrl_c_during_start_up_and_compile_stops_within_two_seconds(tmp_path, moment):
  p, status = _cold_run(tmp_path, moment)
  deadline = time.monotonic() + 300
  if moment != "importing":
    while _state(status) != "compiling" and p.poll() is None and time.monotonic() < deadline:
      time.sleep(0.01)
    if moment == "compiling+1s":
      time.sleep(1.0)
  else:
    time.sleep(0.05)
  assert p.poll() is None, p.stderr.read()
  sent = time.monotonic()
  p.send_signal(signal.SIGINT)
  err = p.communicate(timeout=300)[1]
  took = time.monotonic() - sent
  assert p.returncode == 130, err
  assert took < 2.0, f"{moment}: the stop took {took:.2f}s\n{err}"
  lines = err.strip().splitlines()
  assert "Traceback" not in err and "error[" not in err, err
  st = json.loads(status.read_text())
  assert (st["state"], st["stopped_by"]) == ("stopped", "SIGINT"), st
  if st["step"] == 0:  # stopped before the loop: no step-0 pass ran after the signal
    assert not [x for x in lines if x.startswith("step 0/")], err
    assert lines[-1] in (STARTUP_LINE.format("SIGINT"), NO_LOCATION.format("SIGINT")), err
  else:
    assert lines[-1] == (f"stopped: SIGINT at step {st['step']}; no checkpoint location: "
                         "nothing saved"), err

"""A stop signal at any moment of a run's first two seconds: exit 128 + n, status `stopped`."""

import json
import signal
import subprocess
import time

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.run import signals

MOMENTS = 20  # spread over the first two seconds
SPAN = 2.0


def _start(status):
  # The child starts with the stop signals blocked, as a signal sent before the interpreter
  # reaches our first import stays pending; the CLI's handlers unblock and receive it.
  return subprocess.Popen(
      sexpgpu_cmd("run", "configs/tiny-lm.sx", "--variant", "smoke", "--steps", "100000",
                  "--eval-every", "0", "--status", str(status)),
      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
      preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, list(signals.SIGNALS)))


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


def test_deferred_records_only():
  with signals.deferred() as flag:
    signal.raise_signal(signal.SIGINT)
    assert flag.received == signal.SIGINT
  assert signal.getsignal(signal.SIGINT) is not flag._handle

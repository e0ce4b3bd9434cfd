"""A run stopped by a signal the moment its metrics show step k.

The run is frozen (SIGSTOP) as soon as this process sees step k, sent the signal, then let go
(SIGCONT), so a run whose steps take milliseconds cannot end between the sighting and the
signal. On a loaded machine it can still end before this process sees step k at all: then it
is started again, up to `tries` times (8: a step of a few milliseconds on a loaded machine
misses three in a row), each try in its own files."""

import json
import signal
import time


def steps_seen(metrics):
  """The step numbers of the metrics stream's step events (a half-written last line is skipped)."""
  if not metrics.exists():
    return set()
  seen = set()
  for line in open(metrics):
    try:
      event = json.loads(line)
    except json.JSONDecodeError:
      continue
    if event.get("kind") == "step":
      seen.add(event["step"])
  return seen


def stop_at(start, k, sig, tries=8):
  """start(attempt) -> (Popen, metrics path). Returns (Popen, stdout, stderr, metrics) of the
  first try that the signal stopped, or of the last try."""
  for attempt in range(tries):
    p, metrics = start(attempt)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
      if any(s >= k for s in steps_seen(metrics)):
        p.send_signal(signal.SIGSTOP)
        break
      time.sleep(0.005)
    p.send_signal(sig)
    p.send_signal(signal.SIGCONT)
    out, err = p.communicate(timeout=300)
    if p.returncode != 0 or attempt == tries - 1:  # 0: it ended before the signal
      return p, out, err, metrics

"""A fault campaign against a run on s3:// (moto on 127.0.0.1 behind an outage proxy).

Each trial runs tests/data/faults.sx with a checkpoint every 4 steps on s3://, cuts the
store's connection for a random outage at a random save (the nth commit marker), and
with --kills also `kill -9`s the run at a random checkpoint and resumes it with
`--resume latest`; an outage longer than SEXPGPU_REMOTE_TIMEOUT ends in E-CKPT-004 and
is resumed too. Every trial must end with losses bitwise equal to an uninterrupted run.

  python benchmarks/fault_campaign.py --trials 10 --outages 5,30,90 --kills 3

prints one line per trial and the figures: trials, outages, kills, E-CKPT-004 stops,
resumes, retry lines, and how many trials lost anything (must be 0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from faultproxy import OutageProxy  # noqa: E402  pylint: disable=wrong-import-position
from s3server import moto_server, s3_env  # noqa: E402  pylint: disable=wrong-import-position

EXP = os.path.join(ROOT, "tests", "data", "faults.sx")
COMMIT_PUT = rb"^PUT .*/COMMIT HTTP"


def _cmd(steps: int, *args: str) -> list[str]:
  return [sys.executable, "-m", "sexpgpu.cli.main", "run", EXP, "--json", "--set",
          f"steps={steps}", *args]


def _losses(path: str) -> dict[int, float]:
  if not os.path.exists(path):
    return {}
  return {e["step"]: e["train/loss"] for e in map(json.loads, open(path)) if e["kind"] == "step"}


def _trial(i, rng, args, endpoint, reference, tmp) -> dict:
  proxy = OutageProxy(int(endpoint.rsplit(":", 1)[1]))
  env = dict(os.environ, **s3_env(proxy.endpoint), SEXPGPU_REMOTE_TIMEOUT=str(args.timeout))
  outage = rng.choice(args.outages)
  nth = rng.randint(1, max(1, args.steps // 4 - 1))
  proxy.cut_at(COMMIT_PUT, nth=nth, seconds=outage)
  kill_at = rng.randint(1, args.steps // 4) * 4 if i < args.kills else None
  loc = f"s3://campaign/t{i}"
  metrics = os.path.join(tmp, f"t{i}.jsonl")
  out = {"trial": i, "outage_s": outage, "at_commit": nth, "kill_at": kill_at, "stops": 0,
         "kills": 0, "sessions": 0, "retry_lines": 0}
  resume: list[str] = []
  for _ in range(6):
    out["sessions"] += 1
    p = subprocess.Popen(_cmd(args.steps, "--checkpoint-dir", loc, "--metrics",
                              f"jsonl:{metrics}", *resume), cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_at is not None:
      while p.poll() is None and not any(s >= kill_at for s in _losses(metrics)):
        time.sleep(0.02)
      if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        out["kills"] += 1
      kill_at = None
    _, err = p.communicate(timeout=args.timeout + max(args.outages) + 600)
    out["retry_lines"] += err.count("retrying for up to")
    resume = ["--resume", "latest"]
    if p.returncode == 0:
      break
    if "error[E-CKPT-004]" in err:
      out["stops"] += 1
      proxy.heal()
  got = _losses(metrics)
  out["lost"] = not (set(got) == set(reference) and all(got[s] == reference[s] for s in got))
  proxy.close()
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--trials", type=int, default=10)
  ap.add_argument("--outages", default="5,30,90", help="outage seconds to draw from")
  ap.add_argument("--kills", type=int, default=3, help="trials that are also kill -9'ed")
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--timeout", type=float, default=60.0, help="SEXPGPU_REMOTE_TIMEOUT")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  args.outages = [float(x) for x in args.outages.split(",")]
  rng = random.Random(args.seed)
  with tempfile.TemporaryDirectory() as tmp, moto_server() as endpoint:
    import s3fs  # pylint: disable=import-outside-toplevel
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="testing",
                      secret="testing").mkdir("campaign")
    ref = subprocess.run(_cmd(args.steps, "--metrics", f"jsonl:{tmp}/ref.jsonl"), cwd=ROOT,
                         capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr
    reference = _losses(f"{tmp}/ref.jsonl")
    rows = []
    for i in range(args.trials):
      row = _trial(i, rng, args, endpoint, reference, tmp)
      rows.append(row)
      print(json.dumps(row), flush=True)
  print(f"trials {len(rows)} outages {len(rows)} (seconds {sorted({r['outage_s'] for r in rows})}) "
        f"kills {sum(r['kills'] for r in rows)} E-CKPT-004 stops {sum(r['stops'] for r in rows)} "
        f"sessions {sum(r['sessions'] for r in rows)} retry lines "
        f"{sum(r['retry_lines'] for r in rows)} lost {sum(r['lost'] for r in rows)}")


if __name__ == "__main__":
  main()

"""Time and size of a checkpoint of configs/gpt2-small.sx --variant smoke, on a local folder
and on an S3-compatible server (moto on 127.0.0.1), measured in one run.

  python benchmarks/checkpoint_cost.py
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from s3server import moto_server, s3_env  # noqa: E402


def _saved(location: str, env: dict, tmp: str) -> dict:
  m = os.path.join(tmp, f"m-{abs(hash(location))}.jsonl")
  p = subprocess.run([sys.executable, "-m", "sexpgpu.cli.main", "run", "configs/gpt2-small.sx",
                      "--variant", "smoke", "--steps", "2", "--eval-every", "0",
                      "--checkpoint-dir", location, "--metrics", f"jsonl:{m}"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  if p.returncode:
    raise SystemExit(p.stderr)
  return [e for e in map(json.loads, open(m)) if e["kind"] == "checkpoint"][-1]


def main() -> None:
  with tempfile.TemporaryDirectory() as tmp, moto_server() as endpoint:
    env = dict(os.environ, **s3_env(endpoint))
    import s3fs
    os.environ.update(s3_env(endpoint))
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("ckpt")
    local = _saved(os.path.join(tmp, "ck"), env, tmp)
    remote = _saved("s3://ckpt/runs", env, tmp)
  print(f"local  {local['bytes'] / 2**20:8.1f} MiB in {local['seconds']:.2f}s")
  print(f"s3     {remote['bytes'] / 2**20:8.1f} MiB in {remote['seconds']:.2f}s")
  print(f"ratio  s3/local time {remote['seconds'] / local['seconds']:.2f}")


if __name__ == "__main__":
  main()

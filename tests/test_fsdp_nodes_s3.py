"""`:sharding fsdp|hsdp` over two nodes of two host devices each, with checkpoints on a moto
S3 server: each process uploads only its own shards, and node 0 commits a step only once
every process has reported its part."""

import json
import posixpath
import time

import pytest

from faultproxy import OutageProxy
from s3server import free_port, make_bucket, s3_env
from test_fsdp_nodes import _args, _start, _stop_resume


@pytest.mark.slow  # two processes over gloo, S3 on moto, stop and resume
def test_hsdp_over_two_nodes_resumes_bitwise_from_s3(tmp_path, moto_endpoint):
  env = s3_env(make_bucket(moto_endpoint, "ckpts-resume"))
  whole, summaries, resumed = _stop_resume(tmp_path, "hsdp", "s3://ckpts-resume/runs",
                                           (env, env))
  start = summaries[0]["steps"]
  assert resumed == {s: v for s, v in whole.items() if s > start}


def _committed_complete(fs, run_key):
  """{step: whether every file its manifest lists is there with its size} for each step
  with a COMMIT marker, and the steps without one."""
  fs.invalidate_cache(run_key)
  found = {p: i["size"] for p, i in fs.find(run_key, detail=True).items()}
  steps = {posixpath.relpath(p, run_key).split("/")[0] for p in found}
  out, partial = {}, []
  for step in sorted(s for s in steps if s.isdigit()):
    key = f"{run_key}/{step}"
    if f"{key}/COMMIT" not in found:
      partial.append(int(step))
      continue
    files = json.loads(fs.cat_file(f"{key}/MANIFEST.json"))["files"]
    out[int(step)] = all(found.get(f"{key}/{rel}") == e["bytes"] for rel, e in files.items())
  return out, partial


@pytest.mark.slow
def test_a_process_killed_while_uploading_its_shards_leaves_no_committed_step_without_them(
    tmp_path, moto_endpoint):
  """Node 1 uploads through a proxy that stalls its first upload of step 8's shards; node 1
  is killed then. Node 0, which uploaded its own shards, never writes step 8's COMMIT: it
  ends with E-DP-007 naming step 4, the last committed checkpoint, which is whole."""
  import s3fs
  endpoint = make_bucket(moto_endpoint, "ckpts-kill")
  proxy = OutageProxy(int(endpoint.rsplit(":", 1)[1]))
  try:
    envs = (s3_env(endpoint), s3_env(proxy.endpoint))
    for e in envs:  # node 0 waits for node 1's report this long past its own upload
      e.update(SEXPGPU_RENDEZVOUS_TIMEOUT="20", SEXPGPU_REMOTE_TIMEOUT="2")
    proxy.cut_at(rb"^PUT /ckpts-kill/runs/[^/]+/8/state/", 1, 120)
    args = _args("fsdp") + ("--checkpoint-dir", "s3://ckpts-kill/runs")
    port = free_port()
    procs = [_start(tmp_path, r, port, args, "k", envs[r]) for r in (0, 1)]
    deadline = time.time() + 300
    while time.time() < deadline and not proxy.cuts and procs[0].poll() is None:
      time.sleep(0.01)
    assert proxy.cuts, "node 1 never started uploading step 8"
    procs[1].kill()
    out, err = procs[0].communicate(timeout=300)
    procs[1].communicate(timeout=60)
  finally:
    proxy.close()
  assert procs[0].returncode == 1, err
  assert "error[E-DP-007]" in err and "Traceback" not in err, err
  assert "the last committed checkpoint is s3://ckpts-kill/runs/" in err and "/4" in err, err
  fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="testing",
                         secret="testing")
  run_key = "ckpts-kill/runs/tiny-lm-smoke-checkpoint-every=4-microbatches=4-sharding=fsdp"
  complete, partial = _committed_complete(fs, run_key)
  assert complete == {4: True}, complete
  assert partial == [8]  # node 0's part of step 8 is there, uncommitted

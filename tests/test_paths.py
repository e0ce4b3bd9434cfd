"""sexpgpu.paths: the cache folder, remote locations, atomic writes."""

import os
import threading

import pytest

from sexpgpu import paths


def test_cache_dir_is_the_variable_else_the_home_cache():
  assert paths.cache_dir({"SEXPGPU_CACHE_DIR": "/c"}) == "/c"
  assert paths.cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache", "sexpgpu")


@pytest.mark.parametrize("location,remote", [
    ("s3://b/k", True), ("S3://b/k", True), ("gs://b/k", True), ("gcs://b/k", True),
    ("/tmp/x", False), ("rel/x.bin", False), ("file:///tmp/x", False), ("https://h/x", False),
    ("memory://x", False)])
def test_remote_locations_by_fsspecs_protocol(location, remote):
  assert paths.is_remote(location) is remote


def test_the_data_and_checkpoint_rules_are_this_one():
  from sexpgpu.ckpt import where
  from sexpgpu.data import remote
  assert where.is_remote is paths.is_remote and remote.is_remote is paths.is_remote


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
  target = tmp_path / "sub" / "f.json"
  paths.write_atomic(str(target), "one")
  paths.write_atomic(str(target), b"two", sync=True)
  assert target.read_text() == "two" and os.listdir(target.parent) == ["f.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
  target = tmp_path / "f.txt"
  target.write_text("old")
  with pytest.raises(RuntimeError):
    with paths.replacing(str(target)) as tmp:
      with open(tmp, "w") as f:
        f.write("half")
      raise RuntimeError("interrupted")
  assert target.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_threads_writing_one_file_never_collide(tmp_path):
  target = str(tmp_path / "f")
  errors = []

  def write(i):
    try:
      for _ in range(50):
        paths.write_atomic(target, str(i) * 1000)
    except OSError as e:  # a shared temporary name would collide here
      errors.append(e)

  threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  text = open(target).read()
  assert not errors and len(set(text)) == 1 and len(text) == 1000


def test_one_scrubber_serves_every_writer():
  """paths.scrub is errors.scrub (below every layer, for SxError and the slug), and the
  writers' choke points use it: an error's words, a line of output, a metrics event."""
  import io

  from sexpgpu import errors
  from sexpgpu.ckpt import where
  from sexpgpu.run import output
  from sexpgpu.track import open_metrics
  assert paths.scrub is errors.scrub and where.scrub is errors.scrub
  uri = "s3://AKIAP1:SECp1/x+y@bucket/k?token=TOKp1abcd"
  shown = "s3://***@bucket/k?token=***"
  e = errors.SxError("E-CKPT-004", f"cannot write {uri}", where=uri, fix=f"see {uri}",
                     notes=[("at", uri)])
  assert (e.message, e.where, e.fix, e.notes) == (f"cannot write {shown}", shown,
                                                  f"see {shown}", [("at", shown)])
  e.fix = uri  # changed after it was made (as the CLI does with a hint): rendered scrubbed
  assert "SECp1" not in e.render() and "TOKp1abcd" not in str(e.with_note("n", uri))
  stream = io.StringIO()
  output.write(stream, f"run: checkpoints {uri}\n")
  assert stream.getvalue() == f"run: checkpoints {shown}\n"
  assert open_metrics(None, "run").emit("checkpoint", location=uri)["location"] == shown


def test_the_credentials_remembered_are_bounded():
  """A process that meets endless credentials (a fuzzer) keeps the newest _SEEN_MOST."""
  from sexpgpu import errors
  kept = dict(errors._SEEN_SECRETS), list(errors._SEEN_ORDER)
  try:
    for i in range(errors._SEEN_MOST + 50):
      paths.scrub(f"s3://user{i:05d}:secret{i:05d}@bucket/p")
    assert len(errors._SEEN_SECRETS) == errors._SEEN_MOST
    newest = f"secret{errors._SEEN_MOST + 49:05d}"
    assert paths.scrub(f"a line naming {newest}") == "a line naming ***"
  finally:
    errors._SEEN_SECRETS.clear()
    errors._SEEN_SECRETS.update(kept[0])
    errors._SEEN_ORDER[:] = kept[1]

"""Tests of sexpgpu.data: purity, state, shuffling, splits, streams, errors, s3:// fetching."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sexpgpu.data import LoaderSpec, make_loader
from sexpgpu.data import remote
from sexpgpu.errors import Loc, SxError

try:
  from tests.s3server import bucket_fs, free_port, s3_env
except ImportError:
  from s3server import bucket_fs, free_port, s3_env

LOC = Loc("exp.sx", 3, 1)


def spec(kind, name="train", base_dir=".", **args):
  return LoaderSpec(name=name, kind=kind, args=args, base_dir=base_dir, location=LOC)


@pytest.fixture
def files(tmp_path):
  """A directory with a u16 token file, a byte corpus and an npz."""
  np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
  (tmp_path / "corpus.txt").write_bytes(bytes(range(256)) * 4)
  rng = np.random.default_rng(0)
  np.savez(tmp_path / "data.npz", x=rng.normal(size=(50, 3)), y=np.arange(50, dtype=np.int64),
           flag=np.arange(50) % 2 == 0)
  return tmp_path


def all_specs(d):
  return {
      "markov": spec("markov", vocab=16, seq=9, batch=4, seed=3),
      "copy": spec("copy", vocab=10, seq=11, batch=3),
      "reverse": spec("reverse", vocab=10, seq=11, batch=3),
      "sort": spec("sort", vocab=10, seq=11, batch=3),
      "add": spec("add", digits=4, batch=5),
      "tokens": spec("tokens", base_dir=str(d), path="train.bin", dtype="u16", seq=10, batch=4),
      "bytes": spec("bytes", base_dir=str(d), path="corpus.txt", seq=32, batch=4),
      "arrays": spec("arrays", base_dir=str(d), path="data.npz", fields=["x", "y", "flag"],
                     batch=8),
      "mix": spec("mix", batch=6, components=[
          (0.5, spec("tokens", "a", str(d), path="train.bin", seq=10, batch=4)),
          (0.25, spec("markov", "b", vocab=16, seq=10, seed=1)),
          (0.25, spec("bytes", "c", str(d), path="corpus.txt", seq=10, batch=2))]),
  }


KINDS = ["markov", "copy", "reverse", "sort", "add", "tokens", "bytes", "arrays", "mix"]


def same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("kind", KINDS)
def test_batch_is_pure_and_next_follows_it(kind, files):
  s = all_specs(files)[kind]
  first = make_loader(s, seed=5)
  forward = [first.batch(i) for i in range(12)]
  second = make_loader(s, seed=5)
  for i in reversed(range(12)):
    same(second.batch(i), forward[i])
  third = make_loader(s, seed=5)
  for i in range(12):
    assert third.position == i
    same(third.next(), forward[i])
  same(make_loader(s, seed=5).batch(7), forward[7])


@pytest.mark.parametrize("kind", KINDS)
def test_fields_match_batches(kind, files):
  loader = make_loader(all_specs(files)[kind], seed=1)
  b = loader.batch(3)
  assert set(b) == set(loader.fields)
  for name, (shape, dtype) in loader.fields.items():
    assert b[name].shape == shape and b[name].dtype == dtype, name
    assert shape[0] == loader.batch_size
  desc = loader.describe()
  assert desc["kind"] == kind
  assert json.loads(json.dumps(desc)) == desc


@pytest.mark.parametrize("kind", KINDS)
def test_state_round_trip(kind, files):
  s = all_specs(files)[kind]
  a = make_loader(s, seed=2)
  for _ in range(5):
    a.next()
  state = json.loads(json.dumps(a.state()))
  b = make_loader(s, seed=2)
  b.set_state(state)
  assert b.position == 5 and b.state() == a.state()
  for _ in range(3):
    same(a.next(), b.next())


def test_set_state_rejects_another_loaders_state():
  loader = make_loader(spec("copy", vocab=10, seq=11, batch=3))
  with pytest.raises(ValueError):
    loader.set_state({"kind": "markov", "position": 3})
  with pytest.raises(ValueError):
    loader.set_state({"kind": "copy", "position": -1})


def test_mix_state_lists_components_and_draws_by_weight(files):
  loader = make_loader(all_specs(files)["mix"], seed=0)
  for _ in range(1000):
    loader.next()
  counts = [c["records"] for c in loader.state()["components"]]
  assert sum(counts) == 6000
  np.testing.assert_allclose(np.array(counts) / 6000, [0.5, 0.25, 0.25], atol=0.03)


def test_mix_components_hand_out_records_in_order(files):
  d = str(files)
  m = make_loader(spec("mix", batch=8, components=[
      (0.5, spec("tokens", "a", d, path="train.bin", seq=10, split=[0, 0.5])),
      (0.5, spec("tokens", "b", d, path="train.bin", seq=10, split=[0.5, 1]))]),
      seed=0, shuffle_default=False)
  # 700 microbatches of 8 cross the mix's blocks of 4096 records
  starts = np.concatenate([m.next()["tokens"][:, 0] for _ in range(700)])
  a, b = starts[starts < 500], starts[starts >= 500]
  np.testing.assert_array_equal(a, np.arange(len(a)) % 50 * 10)
  np.testing.assert_array_equal(b, 500 + np.arange(len(b)) % 50 * 10)
  assert [c["records"] for c in m.state()["components"]] == [len(a), len(b)]
  fresh = make_loader(m.spec, seed=0, shuffle_default=False)
  same(fresh.batch(600), m.batch(600))


def test_shuffle_is_a_permutation_per_epoch(files):
  loader = make_loader(spec("tokens", base_dir=str(files), path="train.bin", seq=10, batch=4),
                       seed=9)  # 100 windows, 25 microbatches per epoch
  assert loader.records == 100
  epochs = [np.concatenate([loader.batch(e * 25 + i)["tokens"][:, 0] for i in range(25)])
            for e in range(2)]
  for starts in epochs:
    assert sorted(starts.tolist()) == list(range(0, 1000, 10))
  assert not np.array_equal(epochs[0], epochs[1])
  assert not np.array_equal(epochs[0], np.arange(0, 1000, 10))


def test_no_shuffle_reads_in_order_and_wraps(files):
  loader = make_loader(spec("tokens", base_dir=str(files), path="train.bin", seq=10, batch=4),
                       shuffle_default=False)
  np.testing.assert_array_equal(loader.batch(0)["tokens"][1], np.arange(10, 20))
  np.testing.assert_array_equal(loader.batch(25)["tokens"], loader.batch(0)["tokens"])


def test_split_ranges_do_not_overlap(files):
  def seen(split):
    loader = make_loader(spec("tokens", base_dir=str(files), path="train.bin", seq=10, batch=4,
                              split=split), seed=0)
    return set(np.concatenate([loader.batch(i)["tokens"].ravel() for i in range(40)]).tolist())
  train, valid = seen([0, 0.9]), seen([0.9, 1])
  assert not train & valid
  assert train == set(range(900)) and valid == set(range(900, 1000))


def test_arrays_split_and_types(files):
  loader = make_loader(spec("arrays", base_dir=str(files), path="data.npz", fields=["x", "y"],
                            batch=5, split=[0.8, 1]), shuffle_default=False)
  assert loader.records == 10
  assert loader.fields == {"x": ((5, 3), np.dtype(np.float32)), "y": ((5,), np.dtype(np.int32))}
  np.testing.assert_array_equal(loader.batch(0)["y"], np.arange(40, 45))


def test_streams_differ(files):
  d = str(files)
  for s in [spec("markov", vocab=16, seq=9, batch=4, seed=3),
            spec("copy", vocab=10, seq=11, batch=3),
            spec("tokens", base_dir=d, path="train.bin", seq=10, batch=4)]:
    a = make_loader(s, seed=0).batch(0)["tokens"]
    b = make_loader(LoaderSpec(s.name, s.kind, {**s.args, "stream": 1}, s.base_dir), seed=0)
    assert not np.array_equal(a, b.batch(0)["tokens"])
  markov = spec("markov", vocab=16, seq=9, batch=4, seed=3)
  assert not np.array_equal(make_loader(markov, seed=0).batch(0)["tokens"],
                            make_loader(markov, seed=1).batch(0)["tokens"])


def test_markov_entropy_rate_matches_monte_carlo():
  loader = make_loader(spec("markov", vocab=24, seq=64, batch=256, seed=11, branching=3))
  rate = loader.describe()["entropy_rate"]
  assert 0 < rate < np.log(3)
  p = np.zeros((24, 24))
  np.add.at(p, (np.arange(24)[:, None], loader.successors), loader.weights)
  tokens = np.concatenate([loader.batch(i)["tokens"] for i in range(8)])
  nll = -np.log(p[tokens[:, :-1], tokens[:, 1:]])
  assert np.isfinite(nll).all()  # every transition is one the table allows
  assert abs(nll.mean() - rate) < 0.05 * rate
  # records start from the stationary distribution
  first = np.bincount(tokens[:, 0], minlength=24) / len(tokens)
  assert np.abs(first - loader.stationary).sum() < 0.15


def test_markov_entropy_rate_of_a_large_vocabulary():
  loader = make_loader(spec("markov", vocab=4096, seq=4, batch=2, seed=0, branching=1))
  assert loader.describe()["entropy_rate"] == pytest.approx(0.0, abs=1e-9)
  loader = make_loader(spec("markov", vocab=4096, seq=4, batch=2, seed=0))
  assert 0 < loader.describe()["entropy_rate"] < np.log(4)
  np.testing.assert_allclose(loader.stationary.sum(), 1.0)


def test_algorithmic_tasks_are_right():
  for kind, expect in [("copy", lambda x: x), ("reverse", lambda x: x[::-1]), ("sort", sorted)]:
    b = make_loader(spec(kind, vocab=12, seq=12, batch=6)).batch(0)
    for row, mask in zip(b["tokens"], b["mask"]):
      assert row[5] == 1 and row[-1] == 0 and (row[:5] >= 2).all()
      np.testing.assert_array_equal(row[mask], expect(row[:5]))
  b = make_loader(spec("add", digits=3, batch=8)).batch(2)
  for row, mask in zip(b["tokens"], b["mask"]):
    num = lambda ds: int("".join(str(t - 3) for t in ds))
    assert row[3] == 1 and row[7] == 2
    assert num(row[mask]) == num(row[:3]) + num(row[4:7])


def test_form_errors():
  with pytest.raises(SxError) as e:
    make_loader(spec("markof", vocab=4))
  assert e.value.code == "E-FORM-001" and "markov" in e.value.fix and e.value.location == LOC
  with pytest.raises(SxError) as e:
    make_loader(spec("markov", vocab=4, seq=3, seed=1))
  assert e.value.code == "E-FORM-001" and ":batch" in e.value.message
  with pytest.raises(SxError) as e:
    make_loader(spec("markov", vocab=4, seq=3, seed=1, batch=2, branch=2))
  assert e.value.code == "E-FORM-002" and ":branching" in e.value.fix
  with pytest.raises(SxError) as e:
    make_loader(spec("copy", vocab=4, seq=3, batch=0))
  assert e.value.code == "E-FORM-001"
  with pytest.raises(SxError) as e:
    make_loader(spec("mix", batch=2, components=[(1, spec("copy", vocab=4, seq=5)),
                                                 (1, spec("copy", vocab=4, seq=7))]))
  assert e.value.code == "E-FORM-001" and "int32[5]" in e.value.message


def test_missing_file_is_load_001(files):
  with pytest.raises(SxError) as e:
    make_loader(spec("tokens", "train", str(files), path="nope.bin", seq=4, batch=2))
  assert e.value.code == "E-LOAD-001" and e.value.location == LOC
  assert "`train`" in e.value.message and "nope.bin" in e.value.message and e.value.fix
  with pytest.raises(SxError) as e:
    make_loader(spec("arrays", base_dir=str(files), path="data.npz", fields=["x", "z"], batch=2))
  assert e.value.code == "E-LOAD-001" and "`z`" in e.value.message


def test_too_few_records_is_load_002(files):
  with pytest.raises(SxError) as e:
    make_loader(spec("tokens", base_dir=str(files), path="train.bin", seq=100, batch=11))
  assert e.value.code == "E-LOAD-002" and "10 records" in e.value.message
  assert "microbatch of 11" in e.value.message
  with pytest.raises(SxError) as e:
    make_loader(spec("arrays", base_dir=str(files), path="data.npz", fields=["y"], batch=6,
                     split=[0.9, 1]))
  assert e.value.code == "E-LOAD-002" and "5 records" in e.value.message


def test_bad_tokens_are_load_003(files):
  (files / "odd.bin").write_bytes(b"\x01\x00\x02")
  with pytest.raises(SxError) as e:
    make_loader(spec("tokens", base_dir=str(files), path="odd.bin", seq=1, batch=1))
  assert e.value.code == "E-LOAD-003" and "3 bytes" in e.value.message
  loader = make_loader(spec("tokens", base_dir=str(files), path="train.bin", seq=10, batch=4,
                            vocab=500), shuffle_default=False)
  loader.batch(0)
  with pytest.raises(SxError) as e:
    loader.batch(20)
  assert e.value.code == "E-LOAD-003" and "not below the vocabulary size 500" in e.value.message
  with pytest.raises(SxError) as e:
    loader.validate()
  assert e.value.code == "E-LOAD-003"


def test_redact_removes_credentials():
  assert remote.redact("s3://AKIA:secret@bucket/k?X-Amz-Signature=abc") == "s3://bucket/k"


# --- s3:// against moto's server on 127.0.0.1 ---


@pytest.fixture(scope="module")
def endpoint(moto_endpoint):
  return moto_endpoint


@pytest.fixture
def s3(endpoint, monkeypatch):
  return bucket_fs(endpoint, "data-bucket", monkeypatch)


@pytest.mark.slow  # S3 on the session's moto server
def test_s3_tokens_fetched_once_and_equal_to_local(s3, files, tmp_path, monkeypatch):
  import s3fs  # pylint: disable=import-outside-toplevel
  s3.put_file(str(files / "train.bin"), "data-bucket/runs/train.bin")
  calls = []
  original = s3fs.S3FileSystem.get_file
  monkeypatch.setattr(s3fs.S3FileSystem, "get_file",
                      lambda self, *a, **k: (calls.append(a), original(self, *a, **k))[1])
  cache = str(tmp_path / "cache")
  uri = "s3://data-bucket/runs/train.bin"
  remote_loader = make_loader(spec("tokens", path=uri, seq=10, batch=4), seed=3, cache_dir=cache)
  local = make_loader(spec("tokens", base_dir=str(files), path="train.bin", seq=10, batch=4),
                      seed=3)
  for i in range(5):
    same(remote_loader.batch(i), local.batch(i))
  assert remote_loader.file.startswith(os.path.join(cache, "data"))
  assert os.path.basename(remote_loader.file) == "train.bin"
  mtime = os.stat(remote_loader.file).st_mtime_ns
  again = make_loader(spec("tokens", path=uri, seq=10, batch=4), seed=3, cache_dir=cache)
  assert len(calls) == 1 and again.file == remote_loader.file
  assert os.stat(again.file).st_mtime_ns == mtime
  # a changed object is fetched again
  np.arange(2000, dtype=np.uint16).tofile(tmp_path / "bigger.bin")
  s3.put_file(str(tmp_path / "bigger.bin"), "data-bucket/runs/train.bin")
  third = make_loader(spec("tokens", path=uri, seq=10, batch=4), seed=3, cache_dir=cache)
  assert len(calls) == 2 and third.records == 200


@pytest.mark.slow  # S3 on the session's moto server
def test_s3_missing_object_is_001_and_missing_bucket_is_004(s3, tmp_path):
  with pytest.raises(SxError) as e:
    make_loader(spec("tokens", path="s3://data-bucket/none.bin", seq=4, batch=2),
                cache_dir=str(tmp_path))
  assert e.value.code == "E-LOAD-001"
  with pytest.raises(SxError) as e:
    make_loader(spec("bytes", path="s3://no-such-bucket/corpus.txt", seq=4, batch=2),
                cache_dir=str(tmp_path))
  assert e.value.code == "E-LOAD-004" and "s3://no-such-bucket/corpus.txt" in e.value.message
  assert e.value.location == LOC and "`train`" in e.value.message


def test_unreachable_store_is_004_without_credentials(monkeypatch, tmp_path):
  url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
  for key, value in s3_env(url).items():
    monkeypatch.setenv(key, value)
  with pytest.raises(SxError) as e:
    make_loader(spec("tokens", path="s3://AKIAXXX:hunter2@bucket/train.bin", seq=4, batch=2),
                cache_dir=str(tmp_path))
  assert e.value.code == "E-LOAD-004"
  assert "hunter2" not in str(e.value) and "AKIAXXX" not in str(e.value)
  assert "s3://bucket/train.bin" in e.value.message

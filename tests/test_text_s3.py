"""Text on s3://: `tokenize` reads a prefix, the `text` loader fetches a cache shard by shard."""

import glob
import os

import numpy as np
import pytest

from conftest import ROOT
from sexpgpu.data import make_loader, textcache
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.errors import SxError
from sexpgpu.tools.tokenize import Options, tokenize

pytestmark = pytest.mark.slow  # S3 on the session's moto server

try:
  from tests.s3server import bucket_fs
except ImportError:
  from s3server import bucket_fs

SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "data", "*.txt")))


@pytest.fixture(scope="module")
def endpoint(moto_endpoint):
  return moto_endpoint


@pytest.fixture
def s3(endpoint, monkeypatch):
  return bucket_fs(endpoint, "text-bucket", monkeypatch)


def _bins(cache):
  return {n: open(os.path.join(cache, n), "rb").read() for n in sorted(os.listdir(cache))
          if n.startswith("shard-") or n == "tokenizer.json"}


def test_s3_sources_and_cache_match_local(s3, tmp_path):
  for path in SHIPPED:
    s3.put_file(path, f"text-bucket/corpus/{os.path.basename(path)}")
  remote_cache, local_cache = str(tmp_path / "remote"), str(tmp_path / "local")
  s = tokenize(Options(("s3://text-bucket/corpus/",), remote_cache, train_bpe=300),
               progress=False)
  tokenize(Options(tuple(SHIPPED), local_cache, train_bpe=300), progress=False)
  assert s.sources == len(SHIPPED)
  assert _bins(remote_cache) == _bins(local_cache)
  m = textcache.read_manifest(remote_cache)
  assert [e["source"] for e in m["shards"]] == [
      f"s3://text-bucket/corpus/{os.path.basename(p)}" for p in SHIPPED]
  again = tokenize(Options(("s3://text-bucket/corpus/*.txt",), remote_cache, train_bpe=300),
                   progress=False)
  assert again.skipped == len(SHIPPED)
  # the cache on s3, read by the loader shard by shard into the data cache
  for name in os.listdir(local_cache):
    s3.put_file(os.path.join(local_cache, name), f"text-bucket/cache/{name}")
  args = {"seq": 16, "batch": 4, "pack": "docs"}
  far = make_loader(LoaderSpec("train", "text", {"path": "s3://text-bucket/cache/", **args}),
                    seed=2, cache_dir=str(tmp_path / "data"))
  near = make_loader(LoaderSpec("train", "text", {"path": local_cache, **args}), seed=2)
  assert far.records == near.records
  for i in (0, 3, 11):
    for k in near.fields:
      np.testing.assert_array_equal(far.batch(i)[k], near.batch(i)[k])


def test_s3_cache_written_by_tokenize_and_resumed(s3, tmp_path, monkeypatch):
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "staging"))
  local_cache = str(tmp_path / "local")
  tokenize(Options(tuple(SHIPPED), local_cache, train_bpe=300), progress=False)
  s = tokenize(Options(tuple(SHIPPED), "s3://text-bucket/out", train_bpe=300), progress=False)
  assert s.sources == len(SHIPPED) and s.skipped == 0
  names = sorted(p.rsplit("/", 1)[-1] for p in s3.ls("text-bucket/out"))
  assert names == sorted(os.listdir(local_cache))
  for name in names:
    with open(os.path.join(local_cache, name), "rb") as f:
      assert s3.cat_file(f"text-bucket/out/{name}") == f.read()
  s3.rm("text-bucket/out/shard-00001.bin")  # a shard lost: only it is made again
  again = tokenize(Options(tuple(SHIPPED), "s3://text-bucket/out", train_bpe=300),
                   progress=False)
  assert again.skipped == len(SHIPPED) - 1
  assert s3.cat_file("text-bucket/out/shard-00001.bin") == open(
      os.path.join(local_cache, "shard-00001.bin"), "rb").read()
  staging = glob.glob(str(tmp_path / "staging" / "tokenize" / "*"))
  assert len(staging) == 1 and os.path.isfile(os.path.join(staging[0], "manifest.json"))
  assert not glob.glob(os.path.join(staging[0], "shard-*"))  # uploaded shards are not kept


def test_s3_empty_prefix_is_e_tok_001(s3, tmp_path):
  with pytest.raises(SxError) as e:
    tokenize(Options(("s3://text-bucket/nothing-here/",), str(tmp_path / "c"), train_bpe=300),
             progress=False)
  assert e.value.code == "E-TOK-001" and "s3://text-bucket/nothing-here/" in str(e.value)

"""paths.py's remote pieces: one way to open a store for checkpoints, data and tokenize, and
one scrubber whose `redact` remembers the credentials it removes."""

import pytest

from sexpgpu import paths
from sexpgpu.ckpt import where
from sexpgpu.data import remote
from sexpgpu.data.spec import LoaderSpec
from sexpgpu.tools import textsources

pytest.importorskip("s3fs")

OPENERS = {
    "checkpoints": lambda uri: where.remote_fs(uri, "--checkpoint-dir"),
    "data": lambda uri: remote._filesystem(LoaderSpec(name="train", kind="tokens", args={}),
                                           uri)[0],
    "tokenize": lambda uri: textsources.remote_fs(uri)[0],
}


@pytest.mark.parametrize("who", sorted(OPENERS))
@pytest.mark.parametrize("variables,want", [
    ({"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9", "AWS_ENDPOINT_URL": "http://127.0.0.1:8"},
     "http://127.0.0.1:9"),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:8"}, "http://127.0.0.1:8"),
    ({}, None)])
def test_every_store_is_opened_at_the_same_endpoint(monkeypatch, who, variables, want):
  """Checkpoints honoured AWS_ENDPOINT_URL_S3 and data and tokenize did not: one run could
  read its data from one server and write its checkpoints to another."""
  for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
    monkeypatch.delenv(name, raising=False)
  for name, value in variables.items():
    monkeypatch.setenv(name, value)
  fs = OPENERS[who]("s3://bucket/key")
  assert fs.client_kwargs.get("endpoint_url") == want
  assert fs.config_kwargs["retries"]["max_attempts"] == 1 and fs.retries == 1
  again = OPENERS[who]("s3://bucket/key")
  # data and tokenize read listings anew; checkpoints keep their client for quick look-ups
  assert (fs is again) == (who == "checkpoints")


def test_redact_remembers_the_credentials_it_removes():
  """A loader's URI is shown without its credentials; a library's error that repeats them
  later (naming the bucket `KEY:SECRET@bucket`) is masked too, as `scrub` masks it."""
  assert paths.redact("s3://AKIAREDACT:hunter2hunter@bucket/k?X-Amz-Signature=abc") == (
      "s3://bucket/k")
  assert paths.scrub("botocore: no bucket AKIAREDACT:hunter2hunter@bucket") == (
      "botocore: no bucket ***@bucket")
  assert paths.scrub("the key hunter2hunter again") == "the key *** again"
  assert remote.redact is paths.redact

"""No credential planted in a URI, a location flag or variable, or a `--set` value reaches
anything a run writes or shows (issue 37, finding 3): one scrubber (sexpgpu/errors.py's
`scrub`, which sexpgpu.paths re-exports), a slug that carries no credential, checkpoint
locations with credentials refused at their flag, and debug tracebacks scrubbed.

Each planted secret is unique to its test: the scrubber remembers every credential it has
met in the process, so a shared one could be masked here only because another test saw it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest

from conftest import ROOT
from sexpgpu import paths
from sexpgpu.cli.main import main

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")


def _leaks(text: str, secrets) -> list[str]:
  """The secrets found in `text`, whole or by any run of 5 or more letters and digits of
  theirs (a slug writes `/`, `:`, `@` and `+` as `_`, so `K:SEC/RET` would show as
  `K_SEC_RET`)."""
  out = []
  for secret in secrets:
    runs = [secret] + re.findall(r"[A-Za-z0-9]{5,}", secret)
    out += [r for r in runs if r in text]
  return out


def _everything_under(folder) -> str:
  """Every path under `folder` and every file's text, one string to grep."""
  parts = []
  for dirpath, dirnames, files in os.walk(folder):
    parts += [os.path.join(dirpath, n) for n in dirnames + files]
    for n in files:
      with open(os.path.join(dirpath, n), "rb") as f:
        parts.append(f.read().decode("utf-8", "replace"))
  return "\n".join(parts)


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# -- (a) a userinfo holding `/`, `@`, `+` or `:` is masked whole --------------------------------

@pytest.mark.parametrize("uri,shown,secrets", [
    ("s3://AKIAA1XYZ:SEC/RETa1+x@bucket/p", "s3://***@bucket/p", ["SEC/RETa1+x"]),
    ("s3://AKIAA2XYZ:SECa2@RET+y@bucket/p", "s3://***@bucket/p", ["SECa2@RET+y"]),
    ("gs://usera3:pa:ss/wo@rda3+z@bucket/k?v=1", "gs://***@bucket/k?v=1", ["pa:ss/wo@rda3+z"]),
    ("gcs://tokena4/en+abc@bucket", "gcs://***@bucket", ["tokena4/en+abc"]),
    ("https://u:pw/a5+q@127.0.0.1:5000/api", "https://***@127.0.0.1:5000/api", ["pw/a5+q"]),
    ("mlflow:http://u:x/a6@y@h,mlflow:http://v:z/b6+w@g/x",
     "mlflow:http://***@h,mlflow:http://***@g/x", ["x/a6@y", "z/b6+w"]),
], ids=["slash", "at", "colon-slash-at", "token", "https-port", "two-targets"])
def test_a_userinfo_is_masked_up_to_the_last_at_before_the_host(uri, shown, secrets):
  assert paths.scrub(uri) == shown
  assert paths.scrub(f'cannot open "{uri}": access denied') == \
      f'cannot open "{shown}": access denied'
  assert paths.scrub(json.dumps({"location": uri})) == json.dumps({"location": shown})


def test_a_library_that_repeats_part_of_a_userinfo_is_masked_too():
  paths.scrub("s3://AKIAREPEAT7:SEC7/RETREPEAT+7@bucket/p")
  # botocore names the "bucket" it parsed out of the URI: the userinfo up to its first `/`
  said = paths.scrub('Invalid bucket name "AKIAREPEAT7:SEC7": must match a regex')
  assert _leaks(said, ["AKIAREPEAT7", "SEC7/RETREPEAT+7"]) == []


def test_a_key_holding_at_is_masked_up_to_it_rather_than_a_secret_shown():
  """The rule's price, written down: `s3://bucket/run@v2/x` cannot be told from a userinfo
  `bucket/run`, so it is shown as `s3://***@v2/x`."""
  assert paths.scrub("s3://bkt8/run@v2/x") == "s3://***@v2/x"
  assert paths.scrub("mail me at a@b.com, eval@10") == "mail me at a@b.com, eval@10"


def test_an_event_is_scrubbed_in_one_walk_that_still_learns_from_each_field(monkeypatch):
  """A metrics event is scrubbed every step with the credential lists read once; a field that
  teaches scrub a credential still masks it in the fields after it, an env credential is
  masked in a string field, and the numbers come back as they were."""
  monkeypatch.setenv("HF_TOKEN", "hfTOKENevent11")
  event = {"uri": "s3://AKIAEVENT11:SECEVENT11@bucket/p", "said": "bucket AKIAEVENT11 denied",
           "note": ["token hfTOKENevent11 seen"], "loss": 3.25, "step": 7, "ok": True,
           "counters": {"records": 12}}
  out = paths.scrubbed(event)
  assert out == {"uri": "s3://***@bucket/p", "said": "bucket *** denied",
                 "note": ["token *** seen"], "loss": 3.25, "step": 7, "ok": True,
                 "counters": {"records": 12}}


# -- (b) a credential in a query string is masked, and a location that carries one refused -------

@pytest.mark.parametrize("param", ["X-Amz-Security-Token", "X-Amz-Signature", "X-Amz-Credential",
                                   "token", "access_token", "sig", "key", "password", "api_key",
                                   "X-Goog-Signature"])
def test_a_query_credential_is_masked_and_the_rest_of_the_query_kept(param):
  secret = f"Q{param.replace('-', '')}9f3/a+c=="
  uri = f"s3://bucket/p?v=2&{param}={secret}&part=3"
  assert paths.scrub(uri) == f"s3://bucket/p?v=2&{param}=***&part=3"
  assert paths.scrub(f"`mlflow:http://h:5000/?{param}={secret}`: failed") == \
      f"`mlflow:http://h:5000/?{param}=***`: failed"


def test_without_credentials_removes_them_and_keeps_the_location():
  from sexpgpu.paths import without_credentials
  assert without_credentials("s3://K:S/x@b/p?token=T1&v=2&sig=S1") == "s3://b/p?v=2"
  assert without_credentials("https://h/p?X-Amz-Signature=S2") == "https://h/p"
  assert without_credentials("s3://b/p?v=1") == "s3://b/p?v=1"
  assert paths.redact("s3://AKIA:SEC/RET@bucket/k?X-Amz-Signature=abc") == "s3://bucket/k"


# (name, value with `{b}` for the bucket, the code, the secrets it plants)
REFUSED = [
    ("--checkpoint-dir", "s3://{b}/p?X-Amz-Security-Token=TOKbq1a/b+c==", "E-CKPT-004",
     ["TOKbq1a/b+c=="]),
    ("--checkpoint-dir", "s3://AKIAbq2:SECbq2/RET+x@{b}/p", "E-CKPT-004", ["SECbq2/RET+x"]),
    ("SEXPGPU_CHECKPOINT_DIR", "s3://{b}/p?token=TOKbq3zzz", "E-CKPT-004", ["TOKbq3zzz"]),
    ("SEXPGPU_CHECKPOINT_DIR", "gs://AKIAbq4:SEC@bq4/y@{b}/p", "E-CKPT-004", ["SEC@bq4/y"]),
    ("--resume", "s3://{b}/p/tiny-lm-smoke/2?X-Amz-Signature=SIGbq5abc", "E-CKPT-003",
     ["SIGbq5abc"]),
    ("SEXPGPU_RESUME", "s3://AKIAbq6:SECbq6/x+y@{b}/p/tiny-lm-smoke/2", "E-CKPT-003",
     ["SECbq6/x+y"]),
    ("SEXPGPU_INIT_FROM", "s3://{b}/p/tiny-lm-smoke/2?sig=SIGbq7abc", "E-CKPT-003",
     ["SIGbq7abc"]),
    ("--metrics", "jsonl:s3://AKIAbq8:SECbq8/z@{b}/m.jsonl", "E-METRICS-001", ["SECbq8/z"]),
    ("SEXPGPU_METRICS", "tensorboard:gs://{b}/tb?access_token=TOKbq9abc", "E-METRICS-001",
     ["TOKbq9abc"]),
    ("--status", "s3://AKIAbqa:SECbqa/z+q@{b}/s.json", "E-METRICS-001", ["SECbqa/z+q"]),
    ("SEXPGPU_STATUS", "gs://{b}/s.json?X-Goog-Signature=SIGbqbabc", "E-METRICS-001",
     ["SIGbqbabc"]),
]


@pytest.mark.parametrize("name,value,code,secrets", REFUSED,
                         ids=[f"{n.lstrip('-').lower()}-{i}" for i, (n, *_) in enumerate(REFUSED)])
def test_a_location_with_credentials_is_refused_and_never_shown(
    s3_bucket, tmp_path, monkeypatch, capsys, name, value, code, secrets):
  """Each location flag and variable, given a credential in its URI, is refused with its code
  (a checkpoint location or resume with a userinfo or a query string: E-CKPT-004 or 003, the
  fix naming AWS_* variables), nothing is written to the store, and no secret shows on
  standard output or error or in the status file."""
  bucket, fs = s3_bucket
  value = value.format(b=bucket)
  args = ["run", TINY, "--variant", "smoke", "--steps", "1"]
  if name.startswith("--"):
    args += [name, value]
  else:
    monkeypatch.setenv(name, value)
  if "status" not in name.lower():
    args += ["--status", str(tmp_path / "s.json")]
  assert main(args) == 1
  out, err = capsys.readouterr()
  assert f"error[{code}]" in err and "Traceback" not in err, err
  if code != "E-METRICS-001":
    assert "AWS_* variables" in err and "not in the URI" in err
  shown = out + err + _everything_under(tmp_path)
  assert _leaks(shown, secrets) == [], shown
  assert fs.find(bucket) == []  # no object written under a key that holds the secret


def test_doctor_refuses_a_checkpoint_variable_with_credentials_and_shows_none():
  from sexpgpu.cli.doctor import check_checkpoints
  (check,) = check_checkpoints({"SEXPGPU_CHECKPOINT_DIR": "gs://AKIAd5:SECd5/x@bucket/p"})
  assert check.status == "fail" and check.detail.startswith("error[E-CKPT-004]")
  assert "SEXPGPU_CHECKPOINT_DIR" in check.fix and "gs://***@bucket/p" in check.detail
  assert _leaks(check.line(), ["AKIAd5", "SECd5/x"]) == []


# -- (c) a --set value's credentials never enter the slug; the run gets the value whole ----------

def test_the_slug_keeps_a_set_values_location_without_its_credentials():
  from sexpgpu.lang.select import make_slug
  slug = make_slug("tiny-lm", "smoke", [("init-from", "s3://AKIAc1:SECc1/RET+c@b/x?token=TOKc1")])
  assert slug == "tiny-lm-smoke-init-from=s3___b_x"
  assert _leaks(slug, ["AKIAc1", "SECc1/RET+c", "TOKc1"]) == []


def _with_a_string_knob(tmp_path) -> str:
  """tiny-lm.sx with a string knob `source` that the run keeps but never reads."""
  with open(TINY, encoding="utf-8") as f:
    text = f.read()
  path = tmp_path / "tiny-src.sx"
  path.write_text(text.replace('(defknob lr 0.01 "peak learning rate")',
                               '(defknob lr 0.01 "peak learning rate")\n'
                               '(defknob source "none" "where the data came from")'))
  return str(path)


def test_a_set_value_reaches_the_run_whole_while_its_slug_has_no_credential(tmp_path):
  from sexpgpu.run.compile import compile_file
  value = "https://u:SECc2/x+y@host.example/p?token=TOKc2abcd&v=1"
  c = compile_file(_with_a_string_knob(tmp_path), "smoke", [("source", value)])
  assert c.selection.value("source") == value  # what the run may read
  assert c.slug == "tiny-src-smoke-source=https___host.example_p_v=1"


def test_a_set_value_that_is_refused_is_named_without_its_credentials():
  """The flag an error names as the knob's source (`--set k=v`) is shown scrubbed."""
  from sexpgpu.errors import SxError
  from sexpgpu.run.compile import compile_file
  with pytest.raises(SxError) as e:
    compile_file(TINY, "smoke", [("lr", "s3://AKIAc4:SECc4/x+y@bucket/p?token=TOKc4abcd")])
  assert e.value.code == "E-KNOB-002"
  assert e.value.where == "--set lr=s3://***@bucket/p?token=***"
  assert _leaks(str(e.value), ["AKIAc4", "SECc4/x+y", "TOKc4abcd"]) == []


def test_a_checkpoints_scrubbed_knobs_are_no_difference_from_the_live_values():
  """The meta keeps a knob's value scrubbed; a resume compares it as shown, so only the
  knob that truly differs is named."""
  from sexpgpu.ckpt import meta
  from sexpgpu.errors import SxError
  ident = meta.identity("fp-old", "g", "s", {"source": "https://u:SECc3/x@h/p", "lr": 0.1}, {})
  assert ident["knobs"]["source"] == "https://***@h/p"
  with pytest.raises(SxError) as e:
    meta.check_experiment(ident, "ck/s/2", "fp-new", {"source": "https://u:SECc3/x@h/p",
                                                      "lr": 0.2})
  assert e.value.code == "E-CKPT-002" and "knobs differ: lr 0.1 → 0.2)" in e.value.message


@pytest.mark.slow  # a run with the W&B target
def test_a_wandb_run_keeps_the_command_line_scrubbed(tmp_path, monkeypatch):
  """W&B stores the command line (sys.argv) in its run's files: it gets it scrubbed."""
  pytest.importorskip("wandb")
  for name in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
    monkeypatch.delenv(name, raising=False)
  for name, sub in (("WANDB_DIR", "wb"), ("WANDB_DATA_DIR", "wb-data"),
                    ("WANDB_CACHE_DIR", "wb-cache"), ("WANDB_CONFIG_DIR", "wb-config")):
    os.makedirs(tmp_path / sub, exist_ok=True)
    monkeypatch.setenv(name, str(tmp_path / sub))
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
  monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
  monkeypatch.setattr("sys.argv", ["sexpgpu", "run", "x.sx", "--set",
                                   "init-from=s3://AKIAw1:SECw1/x+y@bucket/p?token=TOKw1abcd"])
  from sexpgpu.track import open_metrics
  with open_metrics("wandb:secrets", "slug-w1") as m:
    m.emit("step", step=1, **{"train/loss": 1.0})
  deadline = time.monotonic() + 60  # W&B's service writes the run's file after finish()
  while "init-from=" not in (written := _everything_under(tmp_path)) and (
      time.monotonic() < deadline):
    time.sleep(0.2)
  assert "init-from=s3://***@bucket/p?token=***" in written  # the command line, scrubbed
  assert _leaks(written, ["AKIAw1", "SECw1/x+y", "TOKw1abcd"]) == []


# -- (d) a SEXPGPU_DEBUG=1 traceback is scrubbed --------------------------------------------------

@pytest.mark.slow  # a failing run with its debug traceback
def test_a_debug_traceback_shows_no_credential_of_its_causes(tmp_path, monkeypatch, capsys):
  """MLflow's own exception quotes the tracking URI whole; the traceback that
  SEXPGPU_DEBUG=1 adds to the error prints it, scrubbed."""
  monkeypatch.setenv("SEXPGPU_DEBUG", "1")
  uri = f"http://mluserd1:MLSECRETd1@127.0.0.1:{_closed_port()}/?token=MLTOKENd1x"
  code = main(["run", TINY, "--variant", "smoke", "--steps", "1", "--metrics", f"mlflow:{uri}",
               "--status", str(tmp_path / "s.json")])
  out, err = capsys.readouterr()
  assert code == 1 and "error[E-METRICS-001]" in err
  assert "Traceback (most recent call last)" in err and "http://***@127.0.0.1" in err
  assert _leaks(out + err + _everything_under(tmp_path),
                ["mluserd1", "MLSECRETd1", "MLTOKENd1x"]) == []


def test_traceback_text_is_the_scrubbed_traceback():
  from sexpgpu.errors import traceback_text
  try:
    try:
      raise ValueError("cannot reach s3://AKIAd2:SECd2/x+y@bucket/p?sig=SIGd2abcd")
    except ValueError as e:
      raise RuntimeError("wrapped") from e
  except RuntimeError as e:
    text = traceback_text(e)
  assert "ValueError: cannot reach s3://***@bucket/p?sig=***" in text and "wrapped" in text
  assert _leaks(text, ["SECd2/x+y", "SIGd2abcd"]) == []


# -- everything a run writes ----------------------------------------------------------------------

@pytest.mark.slow  # S3 on the session's moto server
def test_a_run_with_credentials_planted_everywhere_writes_none_of_them(s3_bucket, tmp_path,
                                                                       monkeypatch, capsys):
  """A real run on the S3 server on 127.0.0.1, its checkpoints under s3://, with a credential
  in a --set value's userinfo (holding `/`, `@`, `+`, `:`) and query, in the environment's
  AWS secret, and SEXPGPU_DEBUG=1: standard output and error, the --json summary, the status
  file, the metrics stream, every object key and every checkpoint file hold none of them."""
  bucket, fs = s3_bucket
  planted = ["AWSSECRETe1/abc+def", "SECe1/x@y+z", "TOKe1abcdef", "SIGe1abcdef"]
  monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", planted[0])  # the server takes any
  monkeypatch.setenv("SEXPGPU_DEBUG", "1")
  monkeypatch.setenv("SEXPGPU_STATUS", str(tmp_path / "s.json"))
  monkeypatch.setenv("SEXPGPU_CHECKPOINT_DIR", f"s3://{bucket}/runs")
  value = f"https://AKIAe1:{planted[1]}@host.example/p?token={planted[2]}&sig={planted[3]}&v=1"
  exp = _with_a_string_knob(tmp_path)
  code = main(["run", exp, "--variant", "smoke", "--steps", "2", "--set", f"source={value}",
               "--metrics", f"jsonl:{tmp_path / 'm.jsonl'}", "--json"])
  out, err = capsys.readouterr()
  assert code == 0, err
  summary = json.loads(out)
  slug = "tiny-src-smoke-source=https___host.example_p_v=1"
  assert summary["slug"] == slug and summary["checkpoint"] == f"s3://{bucket}/runs/{slug}/2"
  events = [json.loads(line) for line in open(tmp_path / "m.jsonl", encoding="utf-8")]
  config = next(e for e in events if e["kind"] == "config")
  assert config["knobs"]["source"] == {"value": "https://***@host.example/p?token=***&sig=***&v=1",
                                       "source": "set"}
  keys = fs.find(bucket)
  assert any(k.endswith("/2/COMMIT") for k in keys)
  stored = "\n".join(keys + [fs.cat_file(k).decode("utf-8", "replace") for k in keys
                             if fs.size(k) < 1 << 20])
  assert '"knobs"' in stored  # the meta was read: its knobs are there, scrubbed
  assert _leaks(out + err + _everything_under(tmp_path) + stored, planted) == []


def test_a_bundle_keeps_no_credential_of_its_set_values(tmp_path):
  """A bundle travels: its manifest (sets, slug) and every member carry the location of a
  --set value without its userinfo or query credentials."""
  import zipfile
  from sexpgpu.tools.bundle import make_bundle
  value = "https://u:SECb1/x+y@host.example/p?token=TOKb1abcd&v=1"
  out = tmp_path / "run.sxb"
  make_bundle(_with_a_string_knob(tmp_path), str(out), "smoke", [("source", value)])
  with zipfile.ZipFile(out) as z:
    blob = b"".join(z.read(n) for n in z.namelist())
  manifest = json.loads(zipfile.ZipFile(out).read("manifest.json"))
  assert manifest["sets"] == [["source", "https://host.example/p?v=1"]]
  for secret in (b"SECb1", b"TOKb1abcd", b"x+y"):
    assert secret not in blob

"""Sizes and integers are bounded where they are read: a placed E-code naming the value,
before anything large is built, never a traceback, an abort or a compile that eats memory."""

from __future__ import annotations

import os
import time

import pytest

from conftest import ROOT
from sexpgpu.cli.main import main
from sexpgpu.data import LoaderSpec, make_loader
from sexpgpu import env as denv
from sexpgpu.errors import SxError
from sexpgpu.paths import cache_dir, usable_cache_dir
from sexpgpu.reader.read import INT_LIMIT, parse_int, read_text

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
HUGE = "9" * 5000  # past Python's 4,300-digit limit on int()


def _check(tmp_path, capsys, old, new, *flags):
  text = open(TINY, encoding="utf-8").read()
  assert old in text
  p = tmp_path / "exp.sx"
  p.write_text(text.replace(old, new), encoding="utf-8")
  code = main(["check", str(p), *flags])
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  return code, err, str(p)


# -- integers ---------------------------------------------------------------------------------


def test_parse_int_counts_digits_before_it_converts():
  assert parse_int("12_345") == 12345 and parse_int("-7") == -7 and parse_int("+0007") == 7
  assert parse_int(str(INT_LIMIT - 1)) == INT_LIMIT - 1 and parse_int(str(INT_LIMIT)) is None
  assert parse_int(HUGE) is None and parse_int("-" + HUGE) is None
  assert parse_int("0" * 5000 + "5") == 5  # leading zeros are no size
  assert parse_int("1e3") is None and parse_int("") is None and parse_int("x") is None
  assert parse_int("99", limit=100) == 99 and parse_int("100", limit=100) is None


def test_a_literal_past_4300_digits_is_e_read_003_with_its_length():
  with pytest.raises(SxError) as e:
    read_text(f"(defknob x {HUGE})", "t.sx")
  assert e.value.code == "E-READ-003" and "(5000 characters)" in e.value.message
  assert len(e.value.message) < 200 and str(e.value.location) == "t.sx:1:12"


def test_a_set_value_past_4300_digits_is_e_knob_002(tmp_path, capsys):
  code, err, _ = _check(tmp_path, capsys, "(defknob seq 16", "(defknob seq 16",
                        "--set", f"seq={HUGE}")
  assert code == 1 and "error[E-KNOB-002]" in err and "does not fit in a 64-bit" in err


@pytest.mark.parametrize("name,parse", [
    ("SEXPGPU_STACKING", lambda v: denv.parse_stacking(v)),
    ("SEXPGPU_NODES", lambda v: denv.parse_nodes({"SEXPGPU_NODES": v}, "cuda")),
    ("SEXPGPU_NODE_RANK", lambda v: denv.parse_nodes({"SEXPGPU_NODES": "2",
                                                      "SEXPGPU_NODE_RANK": v}, "cuda")),
    ("SEXPGPU_DEVICES", lambda v: denv.parse_device_list(v)),
    ("SEXPGPU_PROFILE", lambda v: denv.parse_step_range(v)),
    ("SEXPGPU_MEMORY", lambda v: denv.parse_memory(v + "GiB")),
])
def test_a_variable_past_4300_digits_is_an_error_naming_it(name, parse):
  with pytest.raises(SxError) as e:
    parse(HUGE)
  assert e.value.where == name and e.value.code in ("E-ENV-001", "E-DP-001", "E-DP-005")
  assert "(5000 characters)" in e.value.message or "(5003 characters)" in e.value.message


def test_a_forced_host_device_count_past_4300_digits_is_ignored():
  assert denv.cpu_visible({"XLA_FLAGS": f"--xla_force_host_platform_device_count={HUGE}"}) \
      == (os.cpu_count() or 1)


def test_the_variables_still_read_their_ordinary_values():
  assert denv.parse_stacking("2") == 2 and denv.parse_step_range("5..10") == (5, 10)
  assert denv.parse_device_list("0, 1") == [0, 1] and denv.parse_memory("40GiB") == 40 << 30
  cfg = denv.parse_nodes({"SEXPGPU_NODES": "2", "SEXPGPU_NODE_RANK": "1",
                          "SEXPGPU_RENDEZVOUS": "h:1234"}, "cuda")
  assert (cfg.nodes, cfg.rank, cfg.port) == (2, 1, 1234)


# -- loader sizes -----------------------------------------------------------------------------


def _markov(**args):
  return make_loader(LoaderSpec("train", "markov", {"vocab": 32, "seq": 17, "batch": 4,
                                                    "seed": 1, **args}))


@pytest.mark.parametrize("args,said", [
    ({"seq": 2**31}, "`:seq` is 2147483648, more than the 2147483647"),
    ({"batch": 2**40}, "`:batch` is 1099511627776, more than the 2147483647"),
    ({"vocab": 4294967296}, "`:vocab` is 4294967296, more than the 131072"),
    ({"vocab": 100_000_000}, "`:vocab` is 100000000, more than the 131072"),
    ({"seq": 2**30}, "shape [4 1073741824], 4294967296 elements"),
    ({"seed": 2**64}, "`:seed` is 18446744073709551616, more than the 9223372036854775807"),
])
def test_a_loader_size_too_large_is_e_form_001_before_anything_is_built(args, said):
  t0 = time.perf_counter()
  with pytest.raises(SxError) as e:
    _markov(**args)
  assert e.value.code == "E-FORM-001" and said in e.value.message, e.value.message
  assert time.perf_counter() - t0 < 5  # refused, not built


def test_the_largest_allowed_sizes_still_open():
  assert _markov(seq=2**31 - 1, batch=1).fields["tokens"][0] == (1, 2**31 - 1)
  assert _markov(seed=2**63 - 1).chain_seed == 2**63 - 1


def test_check_of_a_markov_seq_past_int32_is_placed(tmp_path, capsys):
  code, err, p = _check(tmp_path, capsys, "(markov :vocab vocab :seq (+ seq 1)",
                        "(markov :vocab vocab :seq 2147483648")
  assert code == 1 and "error[E-FORM-001]" in err and f"{p}:14:18" in err


def test_check_of_a_vocabulary_knob_of_1e8_is_refused_at_once(tmp_path, capsys):
  t0 = time.perf_counter()
  code, err, _ = _check(tmp_path, capsys, "(defknob vocab 32", "(defknob vocab 100000000")
  assert code == 1 and "error[E-FORM-001]" in err and "`:vocab` is 100000000" in err
  assert time.perf_counter() - t0 < 60


# -- the cache folder -------------------------------------------------------------------------


@pytest.mark.parametrize("value,said", [
    ("/proc/self", "cannot be the cache folder"),
    ("/proc/version/x", "cannot be the cache folder: Not a directory"),
    ("/tmp/sexpgpu-\udcff\udcfe", "its name is not UTF-8"),
    ("s3://KEY:SECRET@bucket/c", "is a remote location"),
    ("/tmp/a\0b", "a NUL in the name"),
])
def test_a_cache_folder_that_cannot_be_one_is_e_env_001(value, said):
  with pytest.raises(SxError) as e:
    usable_cache_dir(value)
  assert e.value.code == "E-ENV-001" and e.value.where == "SEXPGPU_CACHE_DIR"
  assert said in e.value.message and "SECRET" not in str(e.value)
  assert not os.path.exists("/tmp/sexpgpu-\udcff\udcfe".encode("utf-8", "surrogateescape"))


def test_a_file_as_the_cache_folder_is_refused_by_check_as_by_run(tmp_path, monkeypatch, capsys):
  f = tmp_path / "file"
  f.write_text("x")
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(f))
  assert main(["check", TINY]) == 1
  err = capsys.readouterr().err
  assert "error[E-ENV-001]" in err and "SEXPGPU_CACHE_DIR" in err and "Traceback" not in err
  assert [n for n, _ in denv.variable_errors()] == ["SEXPGPU_CACHE_DIR"]


def test_jaxs_cache_variable_that_cannot_be_a_folder_is_refused_by_run_and_check(
    tmp_path, monkeypatch, capsys):
  """JAX_COMPILATION_CACHE_DIR moves the XLA cache (a run honours it), so a value that
  cannot be that folder is E-ENV-001 naming it, as SEXPGPU_CACHE_DIR's is; a remote one is
  JAX's to reach and passes."""
  monkeypatch.setenv("SEXPGPU_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/proc/version/xla")
  work = tmp_path / "work"
  work.mkdir()
  monkeypatch.chdir(work)  # where a run writes its checkpoints and metrics
  for argv in (["check", TINY], ["run", TINY, "--variant", "smoke", "--steps", "1"]):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error[E-ENV-001]" in err and "JAX_COMPILATION_CACHE_DIR=/proc/version/xla" in err
    assert "Not a directory" in err and "unset it for the XLA cache" in err
    assert "Traceback" not in err
  assert os.listdir(work) == []  # refused before anything was made
  with pytest.raises(SxError) as e:
    usable_cache_dir("/proc/self", "JAX_COMPILATION_CACHE_DIR")  # exists, takes no file
  assert e.value.where == "JAX_COMPILATION_CACHE_DIR"
  assert usable_cache_dir("gs://bucket/xla", "JAX_COMPILATION_CACHE_DIR") == "gs://bucket/xla"
  assert not os.path.exists("gs:")
  assert denv.variable_errors({"JAX_COMPILATION_CACHE_DIR": "gs://bucket/xla"}) == []


def test_a_missing_cache_folder_is_made(tmp_path):
  want = str(tmp_path / "a" / "b")
  assert cache_dir({"SEXPGPU_CACHE_DIR": want}, check=True) == want and os.path.isdir(want)
  assert cache_dir({"SEXPGPU_CACHE_DIR": "/proc/self"}) == "/proc/self"  # unchecked: doctor's

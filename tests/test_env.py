"""sexpgpu/env.py: every SEXPGPU_* variable read there, one code for one mistake, one
parser of seconds, and the metrics spec parsed once for the flag and the variable."""

import ast
import os

import pytest

from conftest import ROOT
from sexpgpu import env
from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.tools import sweep

PKG = os.path.join(ROOT, "sexpgpu")
TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
# paths.py stands above env.py (env.py checks SEXPGPU_CACHE_DIR with paths' own check).
READERS = {os.path.join(PKG, "env.py"), os.path.join(PKG, "paths.py")}


def _raw_reads(path: str) -> list[str]:
  """`file:line` of each read of a SEXPGPU_* variable other than through env.py: a
  subscript or `.get` of some environment with a literal SEXPGPU_ name, or os.getenv."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  out = []
  for node in ast.walk(tree):
    name = None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
      if node.func.attr in ("get", "getenv") and isinstance(node.args[0], ast.Constant):
        name = node.args[0].value
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
      if "environ" in ast.unparse(node.value):
        name = node.slice.value
    if isinstance(name, str) and name.startswith("SEXPGPU_") and not (
        isinstance(node, ast.Call) and ast.unparse(node.func) in ("env.get", "env_get", "denv.get")):
      out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {name}")
  return out


def test_every_variable_is_read_through_env_py():
  found = []
  for dirpath, _, files in os.walk(PKG):
    for f in files:
      path = os.path.join(dirpath, f)
      if f.endswith(".py") and path not in READERS:
        found += _raw_reads(path)
  assert found == []


def test_the_raw_read_finder_finds_one(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text('import os\nA = os.environ.get("SEXPGPU_X")\nB = os.environ["SEXPGPU_Y"]\n'
                   'C = env.get("SEXPGPU_Z")\nD = os.getenv("SEXPGPU_W")\n')
  assert [r.split(" ")[1] for r in _raw_reads(str(probe))] == ["SEXPGPU_X", "SEXPGPU_Y",
                                                               "SEXPGPU_W"]


def test_get_treats_blank_as_unset():
  assert env.get("SEXPGPU_X", {}) is None
  assert env.get("SEXPGPU_X", {"SEXPGPU_X": "  "}) is None
  assert env.get("SEXPGPU_X", {"SEXPGPU_X": " a "}) == " a "


@pytest.mark.parametrize("text,want", [("0", 0), ("17", 17), (str(2**31 - 1), 2**31 - 1),
                                       (str(2**31), None), ("-1", None), ("1_000", None),
                                       ("0x10", None), ("١٢", None), ("", None), (None, None),
                                       ("9" * 5000, None)])
def test_count_is_decimal_and_bounded(text, want):
  assert env.count(text) == want


@pytest.mark.parametrize("name,default", [("SEXPGPU_RENDEZVOUS_TIMEOUT", 300),
                                          ("SEXPGPU_REMOTE_TIMEOUT", 300)])
def test_one_parser_of_seconds(name, default):
  read = {"SEXPGPU_RENDEZVOUS_TIMEOUT": env.rendezvous_timeout,
          "SEXPGPU_REMOTE_TIMEOUT": env.remote_timeout}[name]
  assert read({}) == default and read({name: "2.5"}) == 2.5
  for bad in ("soon", "0", "-5", "nan", "inf", "1e999"):
    with pytest.raises(SxError) as e:
      read({name: bad})
    assert (e.value.code, e.value.where) == ("E-ENV-001", name)
    assert e.value.message == f"{name}={bad} is not a positive number of seconds"
    assert e.value.fix == f"{name}=300"


@pytest.mark.parametrize("argv,variable,where", [
    (["--device", "tpu"], None, "--device"), ([], "tpu", "SEXPGPU_DEVICE")])
@pytest.mark.parametrize("command", ["run", "check", "doctor"])
def test_a_device_neither_cpu_nor_cuda_is_one_code(monkeypatch, capsys, argv, variable, where,
                                                    command):
  """The flag and the variable name the same mistake with the same code (the catalogue's
  E-DEV-001: a device that is neither cpu nor cuda); fails where the variable was E-ENV-001."""
  monkeypatch.delenv("SEXPGPU_DEVICE", raising=False)
  if variable:
    monkeypatch.setenv("SEXPGPU_DEVICE", variable)
  files = [] if command == "doctor" else [TINY]
  assert main([command, *files, *argv]) == 1
  err = capsys.readouterr().err
  assert "error[E-DEV-001]: device `tpu` is not cpu or cuda" in err
  assert f"  --> {where}\n" in err


def test_decode_choice_is_checked():
  """SEXPGPU_DECODE=recompute or unset; a misspelling is refused, not silently ignored."""
  assert dict(env.variable_errors({"SEXPGPU_DECODE": "recompute"})) == {}
  [(name, e)] = env.variable_errors({"SEXPGPU_DECODE": "recompte"})
  assert (name, e.code, e.where) == ("SEXPGPU_DECODE", "E-ENV-001", "SEXPGPU_DECODE")


def test_sweep_reads_devices_with_the_one_parser(monkeypatch):
  """A sweep's slots come from SEXPGPU_DEVICES as run reads it: a bad list is E-DP-001."""
  monkeypatch.setenv("SEXPGPU_DEVICES", "2, 0,x")
  opts = sweep.SweepOptions(file="x.sx", grid=[], device="cuda", parallel=2)
  with pytest.raises(SxError) as e:
    sweep.device_shares(opts)
  assert e.value.code == "E-DP-001" and e.value.where == "SEXPGPU_DEVICES"
  monkeypatch.setenv("SEXPGPU_DEVICES", "3,2,1,0")
  assert sweep.device_shares(opts) == ["3,2", "1,0"]


def test_metrics_spec_is_parsed_once_for_flag_and_variable():
  from sexpgpu.track import metrics
  assert metrics.parse_metrics is env.parse_metrics
  assert tuple(metrics.SCHEMES) == env.METRICS_SCHEMES  # each scheme parsed has its target
  assert env.parse_metrics("jsonl:a.jsonl, mlflow:file:x") == [
      ("jsonl:a.jsonl", "jsonl", "a.jsonl"), ("mlflow:file:x", "mlflow", "file:x")]
  for where in ("--metrics", "SEXPGPU_METRICS"):
    with pytest.raises(SxError) as e:
      env.parse_metrics("jsnl:a", where)
    assert (e.value.code, e.value.where) == ("E-METRICS-001", where)
    assert "jsonl" in e.value.fix

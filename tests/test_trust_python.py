"""The Python an experiment requires runs only when the user asked (issue 37, finding 1).

`run FILE.sx` runs the `.py` files inside FILE's folder; `--trust-python` or
SEXPGPU_TRUST_PYTHON=1 runs any; `check`, `bundle` and a bundle's run run none without it.
A refusal (E-OP-002) lists every file with its sha256 before any runs: each `.py` here
appends to a marker file when it runs, and the tests read the marker.
"""

import hashlib
import os

import pytest

from sexpgpu.cli.main import main
from sexpgpu.errors import SxError
from sexpgpu.front import pyops
from sexpgpu.run.compile import compile_file

OPS = '''import jax.numpy as jnp
import sexpgpu

with open({marker!r}, "a") as f:
  f.write({name!r} + "\\n")


@sexpgpu.op({op!r}, doc="x * sigmoid(x)", pointwise=True)
def gate(x):
  return x * (1.0 / (1.0 + jnp.exp(-x)))
'''

EXP = '''(require std/nn)
(require std/lm)
(require {ops})

(defloader train (markov :vocab 16 :seq 9 :batch 4 :seed 7))

(defn lm [tokens]
  (let [h (take (param embed [16 16] :init (normal 0.02)) tokens)
        h (+ h (my-gate h))]
    (matmul h (param unembed [16 16] :init (normal 0.02)))))

(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))

(defrun :loss loss :data train :steps 2 :optimizer (adam :lr 0.03) :seed 1)
'''


def cli(capsys, *args):
  """`sexpgpu ARGS` in this process: (exit code, stdout, stderr)."""
  code = main(list(args))
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err
  return code, out, err


def ops_file(path, marker, op="my-gate"):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(OPS.format(marker=str(marker), name=path.name, op=op))
  return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def lab(tmp_path, monkeypatch):
  """exp/exp.sx requiring exp/my_ops.py; the marker beside; no opt-in in the environment."""
  monkeypatch.delenv("SEXPGPU_TRUST_PYTHON", raising=False)
  monkeypatch.chdir(tmp_path)
  marker = tmp_path / "ran.txt"
  sha = ops_file(tmp_path / "exp" / "my_ops.py", marker)
  (tmp_path / "exp" / "exp.sx").write_text(EXP.format(ops='"my_ops.py"'))
  return tmp_path, marker, sha


def ran(marker):
  return marker.read_text().split() if marker.exists() else []


def test_check_runs_no_python_without_the_opt_in(lab, capsys):
  root, marker, sha = lab
  code, out, err = cli(capsys, "check", str(root / "exp" / "exp.sx"))
  assert code == 1 and out == ""
  assert "error[E-OP-002]" in err and "sexpgpu check runs no Python" in err, err
  assert f"--> {root / 'exp' / 'exp.sx'}:3:1" in err
  assert f"my_ops.py sha256 {sha[:16]}" in err and "--trust-python" in err
  assert "SEXPGPU_TRUST_PYTHON=1" in err and "--print requires" in err
  assert ran(marker) == []


@pytest.mark.parametrize("flags,variable,want", [
    (["--trust-python"], None, 0),
    ([], "1", 0),
    (["--notrust-python"], "1", 1),  # the flag wins over the variable
    (["--trust-python"], "0", 0),
    ([], "0", 1),
])
def test_the_flag_or_the_variable_lets_check_run_it(lab, capsys, monkeypatch, flags, variable,
                                                    want):
  root, marker, _ = lab
  if variable is not None:
    monkeypatch.setenv("SEXPGPU_TRUST_PYTHON", variable)
  code, out, err = cli(capsys, "check", str(root / "exp" / "exp.sx"), *flags)
  assert code == want, err
  assert ran(marker) == (["my_ops.py"] if want == 0 else [])
  assert ("error[E-OP-002]" in err) == (want == 1)


def test_a_variable_neither_0_nor_1_is_refused(lab, capsys, monkeypatch):
  root, marker, _ = lab
  monkeypatch.setenv("SEXPGPU_TRUST_PYTHON", "yes")
  code, _, err = cli(capsys, "check", str(root / "exp" / "exp.sx"))
  assert code == 1 and "error[E-ENV-001]" in err and "SEXPGPU_TRUST_PYTHON=yes" in err
  assert ran(marker) == []


def test_print_requires_lists_every_file_and_runs_nothing(lab, capsys):
  root, marker, sha = lab
  exp = str(root / "exp" / "exp.sx")
  code, out, err = cli(capsys, "check", exp, "--print", "requires")
  assert code == 0, err
  rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.strip()
          and not line[0].isdigit()}
  assert set(rows) == {exp, "std/nn.sx", "std/lm.sx", os.path.join("exp", "my_ops.py")}, out
  py = rows[os.path.join("exp", "my_ops.py")]
  assert py[1:3] == ["python", sha] and "by run" in " ".join(py[3:])
  assert rows[exp][1] == "experiment" and rows["std/nn.sx"][1] == "std"
  assert rows[exp][2] == hashlib.sha256((root / "exp" / "exp.sx").read_bytes()).hexdigest()
  assert rows["std/lm.sx"][3] == "no"
  assert ran(marker) == []


def test_run_runs_python_from_its_own_folder(lab, capsys):
  root, marker, _ = lab
  code, _, err = cli(capsys, "run", str(root / "exp" / "exp.sx"), "--steps", "1")
  assert code == 0, err
  assert "done: 1 steps" in err and ran(marker) == ["my_ops.py"]


def _outside(root, how, marker):
  """exp/exp.sx reaching shared/ops.py, outside its folder, `how`; (the require's file:line)."""
  exp = root / "exp" / "exp.sx"
  ops_file(root / "shared" / "ops.py", marker)
  if how == "dotdot":
    exp.write_text(EXP.format(ops='"../shared/ops.py"'))
  elif how == "absolute":
    exp.write_text(EXP.format(ops=f'"{root / "shared" / "ops.py"}"'))
  elif how == "symlink":  # a name inside the folder, a file outside it
    os.symlink(root / "shared" / "ops.py", root / "exp" / "linked.py")
    exp.write_text(EXP.format(ops='"linked.py"'))
  else:  # a required .sx elsewhere requires it
    (root / "shared" / "lib.sx").write_text('(require "ops.py")\n')
    exp.write_text(EXP.format(ops='"../shared/lib.sx"'))
    return f"{os.path.join('shared', 'lib.sx')}:1:1"
  return f"{exp}:3:1"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "via-sx"])
def test_python_from_outside_the_folder_needs_the_opt_in(lab, capsys, how):
  root, marker, _ = lab
  place = _outside(root, how, marker)
  code, _, err = cli(capsys, "run", str(root / "exp" / "exp.sx"), "--steps", "1")
  assert code == 1 and "error[E-OP-002]" in err, err
  assert f"--> {place}" in err and "outside the experiment's folder" in err
  assert "copy the file into the experiment's folder" in err
  assert ran(marker) == []


def test_every_file_is_listed_before_any_runs(lab, capsys):
  root, marker, sha_in = lab
  sha_out = ops_file(root / "shared" / "ops.py", marker, op="other-gate")
  (root / "exp" / "exp.sx").write_text(
      EXP.format(ops='"my_ops.py")\n(require "../shared/ops.py"'))
  code, _, err = cli(capsys, "run", str(root / "exp" / "exp.sx"))
  assert code == 1 and "error[E-OP-002]" in err, err
  listed = [line for line in err.splitlines() if "= would run:" in line]
  assert len(listed) == 2, err
  assert f"my_ops.py sha256 {sha_in[:16]}" in listed[0]
  assert f"ops.py sha256 {sha_out[:16]}" in listed[1] and "outside" in listed[1]
  assert ":4:1" in err.split("= would run")[0]  # placed at the refused require
  assert ran(marker) == []  # not even the one from its own folder


def test_a_bundle_with_python_is_made_and_run_only_with_the_opt_in(lab, capsys, tmp_path):
  root, marker, sha = lab
  exp, sxb = str(root / "exp" / "exp.sx"), str(tmp_path / "run.sxb")
  code, _, err = cli(capsys, "bundle", exp, "-o", sxb)
  assert code == 1 and "error[E-OP-002]" in err and "sexpgpu bundle" in err, err
  assert not os.path.exists(sxb) and ran(marker) == []
  code, _, err = cli(capsys, "bundle", exp, "-o", sxb, "--trust-python")
  assert code == 0, err
  marker.unlink()
  code, _, err = cli(capsys, "run", sxb, "--steps", "1")
  assert code == 1 and "error[E-OP-002]" in err and f"sha256 {sha[:16]}" in err, err
  assert f"sexpgpu run {sxb} runs no Python" in err
  assert ran(marker) == []


@pytest.mark.parametrize("argv", [["export", "--resume", "nowhere", "-o", "out.safetensors"],
                                  ["sample", "--resume", "nowhere", "--prompt", "1 2"],
                                  ["eval", "--resume", "nowhere"]])
def test_the_checkpoint_commands_follow_run(lab, capsys, argv):
  """sample, eval and export compile as run does: Python from outside needs the opt-in,
  asked before the checkpoint is looked for."""
  root, marker, _ = lab
  _outside(root, "dotdot", marker)
  exp = str(root / "exp" / "exp.sx")
  code, _, err = cli(capsys, argv[0], exp, *argv[1:])
  assert code == 1 and "error[E-OP-002]" in err and f"sexpgpu {argv[0]}" in err, err
  assert ran(marker) == []
  code, _, err = cli(capsys, argv[0], exp, *argv[1:], "--trust-python")
  assert code == 1 and "error[E-OP-002]" not in err and "E-CKPT" in err, err
  assert ran(marker) == ["ops.py"]


def test_the_api_runs_its_own_folder_and_refuses_outside(lab):
  root, marker, _ = lab
  compile_file(str(root / "exp" / "exp.sx"))
  assert ran(marker) == ["my_ops.py"]
  _outside(root, "dotdot", marker)
  with pytest.raises(SxError) as e:
    compile_file(str(root / "exp" / "exp.sx"))
  assert e.value.code == "E-OP-002" and "sexpgpu.compile" in e.value.message
  with pyops.trusting(pyops.ALL, "a test"):
    compile_file(str(root / "exp" / "exp.sx"))
  assert ran(marker) == ["my_ops.py", "ops.py"]
  assert pyops.policy().mode == pyops.OWN  # the block's policy ended with it


@pytest.mark.slow  # a sweep's runs
def test_a_sweep_passes_the_opt_in_to_its_points(lab, capsys):
  """A sweep's points are `sexpgpu run` processes: without the opt-in each point is refused
  as run refuses it; with it they run, and the variable is put back after."""
  root, marker, _ = lab
  _outside(root, "dotdot", marker)
  exp = root / "exp" / "exp.sx"
  exp.write_text("(defknob lr 0.03)\n" + exp.read_text().replace("(adam :lr 0.03)",
                                                                   "(adam :lr lr)"))
  argv = ["sweep", str(exp), "--set", "lr=0.03", "--steps", "1"]
  code, out, err = cli(capsys, *argv, "--status-dir", str(root / "a"))
  assert code == 1 and "failed" in out and "E-OP-002" in out + err, out + err
  assert ran(marker) == []
  code, out, err = cli(capsys, *argv, "--status-dir", str(root / "b"), "--trust-python")
  assert code == 0 and " done " in out, out + err
  assert ran(marker) == ["ops.py"] and "SEXPGPU_TRUST_PYTHON" not in os.environ

"""Ops written in Python: `(require "my_ops.py")` and `@sexpgpu.op`, used, checked, bundled,
run from the bundle elsewhere, and their mistakes placed at the `.sx` call."""

import json
import os
import subprocess

import pytest

from conftest import sexpgpu_cmd
from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_file

OPS_PY = '''import jax.numpy as jnp
import sexpgpu


@sexpgpu.op("my-mixer", doc="a causal running mean over positions, then a gate")
def my_mixer(x, *, width: int, gain: float = 1.0):
  if x.shape[-1] != width:
    raise ValueError(f"width {width} is not the last axis {x.shape[-1]}")
  n = jnp.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
  return gain * jnp.cumsum(x, axis=1) / n


@sexpgpu.op("my-gate", doc="x * sigmoid(x), pointwise", pointwise=True)
def my_gate(x):
  return x * (1.0 / (1.0 + jnp.exp(-x)))
'''

EXP_SX = '''(require std/nn)
(require std/lm)
(require "my_ops.py")

(defknob width 16)
(defloader train (markov :vocab 16 :seq 9 :batch 4 :seed 7))

(defn lm [tokens]
  (let [h (take (param embed [16 width] :init (normal 0.02)) tokens)
        h (+ h (my-gate (my-mixer h :width width)))]
    (matmul h (param unembed [width 16] :init (normal 0.02)))))

(defn loss [batch]
  (let [t (get batch :tokens)]
    (next-token-loss (lm (lm-inputs t)) t)))

(defrun :loss loss :data train :steps 30 :optimizer (adam :lr 0.03) :seed 1)
'''


@pytest.fixture()
def exp_dir(tmp_path):
  (tmp_path / "my_ops.py").write_text(OPS_PY)
  (tmp_path / "exp.sx").write_text(EXP_SX)
  return tmp_path


def test_a_python_op_compiles_into_the_graph_with_its_shape(exp_dir):
  out = subprocess.run(sexpgpu_cmd("check", str(exp_dir / "exp.sx"), "--print", "ir",
                                   "--trust-python"),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "f32[4,8,16] = my-mixer" in out.stdout, out.stdout


@pytest.mark.slow  # a run in a subprocess
def test_a_python_op_trains_and_its_file_is_in_the_fingerprint(exp_dir, tmp_path):
  fp = compile_file(str(exp_dir / "exp.sx")).fingerprint
  out = subprocess.run(sexpgpu_cmd("run", str(exp_dir / "exp.sx"), "--json"),
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  summary = json.loads(out.stdout.strip().splitlines()[-1])
  assert summary["steps"] == 30
  (exp_dir / "my_ops.py").write_text(OPS_PY.replace("gain * ", "gain * 0.5 * "))
  assert compile_file(str(exp_dir / "exp.sx")).fingerprint != fp


@pytest.mark.slow  # a bundle run elsewhere in a subprocess
def test_a_bundle_carries_the_python_file_and_runs_elsewhere(exp_dir, tmp_path):
  bundle = tmp_path / "run.sxb"
  out = subprocess.run(sexpgpu_cmd("bundle", str(exp_dir / "exp.sx"), "-o", str(bundle),
                                   "--trust-python"),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  os.remove(exp_dir / "my_ops.py")  # the bundle alone must do
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  out = subprocess.run(sexpgpu_cmd("run", str(bundle), "--steps", "2", "--trust-python"),
                       capture_output=True,
                       text=True, timeout=600, cwd=elsewhere)
  assert out.returncode == 0, out.stderr
  assert "done: 2 steps" in out.stdout + out.stderr


def test_an_exception_inside_the_op_is_placed_at_the_sx_call(exp_dir):
  (exp_dir / "exp.sx").write_text(EXP_SX.replace("(my-mixer h :width width)",
                                                 "(my-mixer h :width 8)"))
  with pytest.raises(SxError) as e:
    compile_file(str(exp_dir / "exp.sx"))
  text = e.value.render()
  assert e.value.code == "E-OP-001", text
  assert "my_ops.py:8" in text and "width 8 is not the last axis 16" in text, text
  assert e.value.location.line == 10 and "Traceback" not in text


@pytest.mark.parametrize("body,needle", [
    ("import jax\nraise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import sexpgpu\n@sexpgpu.op('matmul')\ndef f(x):\n  return x\n", "sexpgpu's own table"),
    ("import sexpgpu\n@sexpgpu.op('f2')\ndef f(x, *, n):\n  return x\n", "needs an annotation"),
    ("x = 1\n", "declares no op"),
    ("def f(:\n", "SyntaxError"),
])
def test_a_file_that_cannot_be_loaded_is_placed_at_the_require(exp_dir, body, needle):
  (exp_dir / "my_ops.py").write_text(body)
  with pytest.raises(SxError) as e:
    compile_file(str(exp_dir / "exp.sx"))
  assert e.value.code == "E-OP-001" and needle in e.value.render(), e.value.render()
  assert e.value.location.line == 3


def test_a_python_op_with_a_wrong_keyword_is_placed_at_the_call(exp_dir):
  (exp_dir / "exp.sx").write_text(EXP_SX.replace(":width width)", ":widht width)"))
  with pytest.raises(SxError) as e:
    compile_file(str(exp_dir / "exp.sx"))
  assert e.value.code == "E-FORM-002" and ":width :gain" in e.value.render()


# --- what a user's Python raises or exits with is its error (issue 37, finding 5) ------------

def _check(capsys, exp_dir, *flags):
  from sexpgpu.cli.main import main
  code = main(["check", str(exp_dir / "exp.sx"), "--trust-python", *flags])
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err
  return code, err


@pytest.mark.parametrize("body,line,needle", [
    ("import sys\nsys.exit(0)\n", 2, "SystemExit: sys.exit(0)"),
    ("import sys\n\nsys.exit(3)\n", 3, "SystemExit: sys.exit(3)"),
    ("raise KeyboardInterrupt\n", 1, "KeyboardInterrupt: raised by the Python itself"),
    ("raise GeneratorExit('gen')\n", 1, "GeneratorExit: gen"),
    ("class Mine(BaseException):\n  pass\n\nraise Mine('own')\n", 4, "Mine: own"),
])
def test_an_exit_while_loading_is_an_error_at_the_require(exp_dir, capsys, body, line, needle):
  (exp_dir / "my_ops.py").write_text(body)
  code, err = _check(capsys, exp_dir)
  assert code == 1 and "error[E-OP-001]" in err and needle in err, err
  assert "exp.sx:3:1" in err and f"= at: my_ops.py:{line}" in err


EXITS = {"exit0": "sys.exit(0)", "exit3": "sys.exit(3)", "interrupt": "raise KeyboardInterrupt",
         "generator": "raise GeneratorExit('gen')"}


@pytest.mark.parametrize("kind", sorted(EXITS))
def test_an_exit_inside_the_op_is_an_error_at_the_sx_call(exp_dir, capsys, kind):
  (exp_dir / "my_ops.py").write_text(OPS_PY.replace(
      "  n = jnp.arange", f"  import sys\n  {EXITS[kind]}\n  n = jnp.arange"))
  code, err = _check(capsys, exp_dir)
  assert code == 1 and "error[E-OP-001]" in err, err
  name = {"exit0": "SystemExit", "exit3": "SystemExit", "interrupt": "KeyboardInterrupt",
          "generator": "GeneratorExit"}[kind]
  assert f"my-mixer: {name} in my_ops.py:10" in err and "exp.sx:10:" in err, err


def test_an_exit_while_the_step_is_lowered_is_an_error_at_the_sx_call(exp_dir, capsys):
  """The op passes shape inference and exits only when the graph interpreter traces the
  train step: still E-OP-001 at the call, not an exit 0."""
  from sexpgpu.cli.main import main
  (exp_dir / "my_ops.py").write_text(OPS_PY.replace("  n = jnp.arange", (
      "  import inspect, sys\n"
      "  if any(f.filename.endswith('interp.py') for f in inspect.stack()):\n"
      "    sys.exit(0)\n"
      "  n = jnp.arange")))
  code = main(["run", str(exp_dir / "exp.sx"), "--steps", "1"])
  err = capsys.readouterr().err
  assert code == 1 and "error[E-OP-001]" in err and "SystemExit in my_ops.py:11" in err, err
  assert "exp.sx:10:" in err and "Traceback" not in err


@pytest.mark.slow  # a run in a subprocess
def test_a_process_whose_ops_file_exits_0_exits_1_and_says_why(exp_dir, tmp_path):
  (exp_dir / "my_ops.py").write_text("import sys\nsys.exit(0)\n")
  out = subprocess.run(sexpgpu_cmd("run", str(exp_dir / "exp.sx")), capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
  assert out.returncode == 1 and "error[E-OP-001]" in out.stderr, out.stderr
  assert "my_ops.py:2" in out.stderr


def test_a_real_signal_while_loading_still_stops(exp_dir, capsys):
  (exp_dir / "my_ops.py").write_text(
      "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n")
  code, err = _check(capsys, exp_dir)
  assert code == 130 and "stopped: SIGINT" in err and "E-OP-001" not in err, err


def test_outside_the_cli_a_keyboard_interrupt_is_left_to_the_caller(exp_dir):
  """Under Python's own SIGINT handler (a notebook) a user's KeyboardInterrupt cannot be
  told from a Ctrl-C, so it passes through as one (docs/guide.md, "Python in an experiment")."""
  import signal
  (exp_dir / "my_ops.py").write_text("raise KeyboardInterrupt\n")
  old = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      compile_file(str(exp_dir / "exp.sx"))
  finally:
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("name", ["", " ", "my op", "1x", ":kw", "nil", "let", "a(b", 42])
def test_an_op_name_that_is_no_symbol_is_refused_where_it_is_declared(name):
  import sexpgpu
  from sexpgpu.userops import OpDeclarationError
  with pytest.raises(OpDeclarationError):
    sexpgpu.op(name)


def test_an_empty_op_name_is_an_error_at_its_line(exp_dir, capsys):
  (exp_dir / "my_ops.py").write_text(OPS_PY.replace('@sexpgpu.op("my-gate"', '@sexpgpu.op(""'))
  code, err = _check(capsys, exp_dir)
  assert code == 1 and "error[E-OP-001]" in err and "the op's name is ''" in err, err
  assert "= at: my_ops.py:13" in err and "exp.sx:3:1" in err

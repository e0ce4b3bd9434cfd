"""The `--json` summary is never lost without a word: standard output full, closed, or a pipe
whose reader leaves early gives a non-zero exit and an error on standard error."""

import io
import os
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, sexpgpu_cmd
from sexpgpu.cli import main as cli

TINY = os.path.join(ROOT, "configs", "tiny-lm.sx")
LINE = '{"kind":"summary","steps":2}\n'


def _on_pipe(monkeypatch, reader):
  """_write_summary with standard output a pipe whose read end `reader(fd)` owns."""
  r, w = os.pipe()
  out = os.fdopen(w, "w")
  monkeypatch.setattr(sys, "stdout", out)
  t = threading.Thread(target=reader, args=(r,))
  t.start()
  try:
    return cli._write_summary(LINE)
  finally:
    t.join(timeout=30)
    out.close()


def _read_exactly(n):
  def reader(fd):
    got = b""
    while len(got) < n:
      got += os.read(fd, n - len(got))
    os.close(fd)
  return reader


def test_a_reader_that_takes_the_whole_line_loses_nothing(monkeypatch):
  assert _on_pipe(monkeypatch, _read_exactly(len(LINE))) is None


def test_a_reader_that_leaves_after_one_byte_lost_the_rest(monkeypatch):
  lost = _on_pipe(monkeypatch, _read_exactly(1))
  assert lost == f"its reader closed the pipe with {len(LINE) - 1} of its {len(LINE)} bytes unread"


def test_a_pipe_closed_before_the_line_refuses_it(monkeypatch):
  r, w = os.pipe()
  os.close(r)  # `| true`: the reader has gone before the run ends
  with os.fdopen(w, "w") as out:
    monkeypatch.setattr(sys, "stdout", out)
    assert cli._write_summary(LINE) == "standard output refused it (Broken pipe)"


def test_a_full_device_refuses_it(monkeypatch):
  with open("/dev/full", "w") as full:
    monkeypatch.setattr(sys, "stdout", full)
    assert cli._write_summary(LINE) == "standard output refused it (No space left on device)"


def test_standard_output_closed_at_start(monkeypatch):
  monkeypatch.setattr(sys, "stdout", None)  # what Python sets when fd 1 is closed at start
  assert cli._write_summary(LINE) == "standard output is closed"


def test_a_file_and_a_capture_keep_it(monkeypatch, tmp_path):
  with open(tmp_path / "out.json", "w") as f:
    monkeypatch.setattr(sys, "stdout", f)
    assert cli._write_summary(LINE) is None
  assert (tmp_path / "out.json").read_text() == LINE
  monkeypatch.setattr(sys, "stdout", io.StringIO())  # no descriptor: a test's capture
  assert cli._write_summary(LINE) is None and sys.stdout.getvalue() == LINE


def _run(*shell, **popen):
  return subprocess.Popen([*shell, *sexpgpu_cmd("run", TINY, "--variant", "smoke", "--steps",
                                                "1", "--json")],
                          cwd=ROOT, stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("where", ["full", "closed", "one byte read"])
def test_the_command_exits_1_and_says_the_summary_was_lost(where):
  if where == "full":
    with open("/dev/full", "w") as full:
      p = _run(stdout=full)
    err = p.communicate(timeout=600)[1]
  elif where == "closed":
    # the shell closes the descriptor, not a preexec_fn: that forks this process, JAX's
    # threads and all, and runs Python in the child
    p = _run("sh", "-c", 'exec "$@" 1>&-', "sh", stdout=subprocess.DEVNULL)
    err = p.communicate(timeout=600)[1]
  else:  # `| head -c 1`
    p = _run(stdout=subprocess.PIPE)
    assert os.read(p.stdout.fileno(), 1) == b"{"
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=600)
  assert p.returncode == 1, err
  assert "error[E-METRICS-001]: the --json summary was lost: " in err
  assert "Traceback" not in err
  lines = err.splitlines()
  assert not any(line.startswith("done: ") for line in lines)  # --json: the summary instead
  assert any(line.startswith("timing total ") for line in lines)  # the run itself finished

"""The transient compile line: on a terminal's standard error while XLA compiles, and
nothing new when standard error is a pipe (run/progress.py's CompileLine)."""

import os
import pty
import re
import select
import subprocess

import pytest

from conftest import ROOT, sexpgpu_cmd

# what a redraw and an erase write (progress.CompileLine)
ERASE = "\r\x1b[K"


def _run(tmp_path, terminal: bool) -> str:
  """tiny-lm for 2 steps on the XLA cache in tmp_path; its standard error as text."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
             SEXPGPU_CACHE_DIR=str(tmp_path / "sx"), COLUMNS="200")
  cmd = sexpgpu_cmd("run", "configs/tiny-lm.sx", "--steps", "2")
  if not terminal:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stderr
  main, sub = pty.openpty()
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sub, env=env, cwd=ROOT)
  os.close(sub)
  got = b""
  try:
    while True:
      ready, _, _ = select.select([main], [], [], 300)
      if not ready:
        break
      try:
        chunk = os.read(main, 65536)
      except OSError:  # the child closed its side
        break
      if not chunk:
        break
      got += chunk
  finally:
    os.close(main)
    assert proc.wait(timeout=60) == 0, got.decode(errors="replace")
  return got.decode().replace("\r\n", "\n")  # the terminal's own line ends


@pytest.fixture(scope="module")
def both(tmp_path_factory):
  # the terminal's run first, on an empty cache (so that it compiles); the pipe's reads it
  tmp = tmp_path_factory.mktemp("compile-line")
  return _run(tmp, True), _run(tmp, False)


def _without_transient(text: str) -> str:
  # every drawn line is followed by an erase (its redraw, its end, or a line's write)
  return re.sub(r"\r\x1b\[K[^\r\n]*(?=\r\x1b\[K)", "", text).replace(ERASE, "")


def _shape(text: str) -> list[str]:
  return [re.sub(r"\d+(\.\d+)?", "#", line) for line in text.splitlines()]


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_a_terminal_sees_what_is_compiling_and_how_many_are_built(both):
  tty, _ = both
  drawn = re.findall(r"\r\x1b\[K(compiling [^\r\n]*)", tty)
  # compiles in threads are named together (the initial state builds beside the steps)
  assert any(re.match(r"compiling (.+, )?the train step(, .+)?: ", d) for d in drawn), drawn
  assert all(re.fullmatch(r"compiling .+: \d+ executables? built, \d+\.\ds", d) for d in drawn)
  counts = [int(re.search(r": (\d+) exec", d).group(1)) for d in drawn]
  assert counts == sorted(counts) and counts[-1] >= 1
  # erased before each line the run writes, which then starts at its first column
  assert all(not line.startswith("compiling") for line in _without_transient(tty).splitlines())


@pytest.mark.slow  # compiles or trains for seconds: the full suite runs it, the quick tier does not
def test_off_a_terminal_the_lines_are_as_before(both):
  tty, pipe = both
  assert "\r" not in pipe and "\x1b" not in pipe and "compiling" not in pipe
  assert _shape(_without_transient(tty)) == _shape(pipe)


def test_compiles_in_threads_are_named_together_until_each_ends():
  import io
  import time

  from sexpgpu.run.progress import BACKEND_COMPILE, CompileLine
  line = CompileLine(io.StringIO())  # not started: no thread draws it
  CompileLine._active = line
  try:
    for name, started in (("jit(initial_state)", True), ("jit(_full_step)", True)):
      CompileLine._on(BACKEND_COMPILE, {"fun_name": name}, started)
    now = time.monotonic()
    assert line.text(now).startswith("compiling the train step, the initial state: "
                                     "0 executables built, ")
    CompileLine._on(BACKEND_COMPILE, {"fun_name": "jit(initial_state)"}, False)
    assert line.text(now).startswith("compiling the train step: 1 executable built, ")
    CompileLine._on(BACKEND_COMPILE, {"fun_name": "jit(_full_step)"}, False)
    assert line.current is None and line.built == 2
  finally:
    CompileLine._active = None

"""The one reader of whole files: hostile files end in the caller's code, within the bound."""

import os
import threading

import pytest

from sexpgpu import bounded
from sexpgpu.errors import SxError

ARGS = dict(what="prompt file", code="E-SAMPLE-001", fix="name a small UTF-8 text file",
            where="--prompt-file")


def _refused(call, *args, **kw) -> str:
  with pytest.raises(SxError) as e:
    call(*args, **{**ARGS, **kw})
  assert e.value.code == "E-SAMPLE-001" and e.value.where == "--prompt-file"
  return e.value.message


def test_a_small_file_is_read_whole(tmp_path):
  p = tmp_path / "p.txt"
  p.write_text("héllo\n")
  assert bounded.read_text(str(p), limit=7, **ARGS) == "héllo\n"
  assert bounded.read_bytes(str(p), limit=7, **ARGS) == "héllo\n".encode()


def test_a_file_past_the_limit_is_refused_after_limit_plus_one_bytes(tmp_path):
  p = tmp_path / "p.txt"
  p.write_bytes(b"x" * 9)
  assert "larger than 8 bytes" in _refused(bounded.read_bytes, str(p), limit=8)


def test_dev_zero_a_fifo_and_a_folder_are_refused_without_reading(tmp_path):
  assert "character device" in _refused(bounded.read_bytes, "/dev/zero", limit=1 << 30)
  fifo = str(tmp_path / "pipe")
  os.mkfifo(fifo)
  done = []
  t = threading.Thread(target=lambda: done.append(_refused(bounded.read_text, fifo, limit=10)))
  t.start()
  t.join(10)
  assert done and "FIFO" in done[0]  # no writer ever comes: the open does not wait for one
  assert "folder" in _refused(bounded.read_text, str(tmp_path), limit=10)
  assert "not found" in _refused(bounded.read_text, str(tmp_path / "nope"), limit=10)


def test_binary_is_not_text(tmp_path):
  p = tmp_path / "b.bin"
  p.write_bytes(b"ab\xff\x00")
  assert "not UTF-8 text (byte 2 is 0xff)" in _refused(bounded.read_text, str(p), limit=10)


@pytest.mark.parametrize("text, problem", [
    ("[1, 2]", "holds an array, where an object was expected"),
    ('"s"', "holds a string"),
    ("", "is not JSON"),
    ("{,}", "is not JSON (line 1, column 2)"),
    ("[" * 100_000 + "]" * 100_000, "nests deeper than"),
    ('{"a": ' * 70 + "1" + "}" * 70, "nests deeper than 64 levels"),
])
def test_json_of_the_wrong_type_or_depth(tmp_path, text, problem):
  p = tmp_path / "c.json"
  p.write_text(text)
  assert problem in _refused(bounded.read_json, str(p), limit=1 << 20)


def test_json_within_bounds(tmp_path):
  p = tmp_path / "c.json"
  p.write_text('{"a": [1, {"b": null}]}')
  assert bounded.read_json(str(p), limit=100, **ARGS) == {"a": [1, {"b": None}]}
  assert bounded.json_depth({"a": [1, {"b": None}]}) == 3


def test_lines_are_bounded_each_and_together(tmp_path):
  p = tmp_path / "t.jsonl"
  p.write_text("one\r\ntwo\nthree")
  assert list(bounded.read_lines(str(p), limit=100, line_limit=10, **ARGS)) == [
      (1, "one"), (2, "two"), (3, "three")]
  p.write_text("ok\n" + "x" * 50 + "\n")
  lines = bounded.read_lines(str(p), limit=1000, line_limit=10, **ARGS)
  assert next(lines) == (1, "ok")
  with pytest.raises(SxError, match="line 2 is longer than 10 bytes"):
    next(lines)
  assert "larger than 20 bytes" in _refused(
      lambda path, **kw: list(bounded.read_lines(path, line_limit=60, **kw)), str(p), limit=20)


def test_a_name_with_a_nul_and_a_file_that_fails_mid_read(tmp_path):
  assert "NUL" in _refused(bounded.read_text, "a\0b", limit=10)
  if os.path.exists("/proc/self/mem"):  # a regular file whose reads fail (EIO)
    message = _refused(lambda path, **kw: list(bounded.read_lines(path, **kw)),
                       "/proc/self/mem", limit=100, line_limit=10)
    assert "cannot be read" in message


def test_an_error_quotes_a_line_of_a_file_it_did_not_read_within_bounds(tmp_path, monkeypatch):
  """A task file's error quotes its line; a line past the bound is told without its quote,
  and /dev/zero or a FIFO named in a location is never read."""
  from sexpgpu import errors
  from sexpgpu.errors import Loc
  p = tmp_path / "tasks.jsonl"
  p.write_text('{"text": "a"}\n{"bad": 1}\n')
  shown = str(SxError("E-EVAL-001", "bad record", location=Loc(str(p), 2, 2)))
  assert '2 | {"bad": 1}' in shown
  monkeypatch.setattr(errors, "QUOTE_LINE_BYTES", 4)
  assert "|" not in str(SxError("E-EVAL-001", "bad", location=Loc(str(p), 2, 2)))
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  for path in ("/dev/zero", str(fifo)):
    assert str(SxError("E-EVAL-001", "x", location=Loc(path, 1, 1))).count("\n") == 2

"""Every `.sx` fixture under tests/sx compiles to the outcome its `.expect` names.

`.expect` format: first line `ok` or `error CODE LINE:COL` (`-` for no location;
`lib/x.sx:LINE:COL` when the error lies in a helper file, relative to tests/sx);
further lines `contains: TEXT` for substrings of the rendered error. A fixture
whose first line is `;; args: ...` is compiled with those selection arguments
(`--variant V`, `--set k=v`). Files without `.expect` (tests/sx/lib) are helpers.
"""

import glob
import os
import shlex

import pytest

from sexpgpu.errors import SxError
from sexpgpu.run.compile import compile_file

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sx")
FIXTURES = sorted(p for p in glob.glob(os.path.join(HERE, "*.sx"))
                  if os.path.exists(p[:-3] + ".expect"))


def parse_args(path):
  with open(path, encoding="utf-8") as f:
    first = f.readline().strip()
  variant, sets = None, []
  if not first.startswith(";; args:"):
    return variant, sets
  words = shlex.split(first[len(";; args:"):])
  i = 0
  while i < len(words):
    if words[i] == "--variant":
      variant = words[i + 1]
    elif words[i] == "--set":
      k, v = words[i + 1].split("=", 1)
      sets.append((k, v))
    else:
      raise ValueError(f"{path}: unknown fixture arg {words[i]}")
    i += 2
  return variant, sets


def parse_expect(path):
  with open(path, encoding="utf-8") as f:
    lines = [l.rstrip("\n") for l in f if l.strip()]
  head = lines[0].split()
  contains = [l[len("contains: "):] for l in lines[1:] if l.startswith("contains: ")]
  if head[0] == "ok":
    return None, None, contains
  assert head[0] == "error" and len(head) == 3, f"bad .expect header: {lines[0]}"
  return head[1], head[2], contains


def test_every_code_has_a_fixture():
  codes = {parse_expect(p[:-3] + ".expect")[0] for p in FIXTURES}
  wanted = {"E-READ-001", "E-READ-002", "E-READ-003", "E-NAME-001", "E-NAME-002",
            "E-FORM-001", "E-FORM-002", "E-REQ-001", "E-REQ-002", "E-KNOB-001",
            "E-KNOB-002", "E-KNOB-003", "E-VARIANT-001", "E-TYPE-001", "E-SHAPE-001",
            "E-RUN-001", "E-RUN-002", "E-CURR-001"}
  assert wanted <= codes, sorted(wanted - codes)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.basename(p)[:-3])
def test_fixture(path):
  code, where, contains = parse_expect(path[:-3] + ".expect")
  variant, sets = parse_args(path)
  if code is None:
    compile_file(path, variant=variant, sets=sets)
    return
  with pytest.raises(SxError) as info:
    compile_file(path, variant=variant, sets=sets)
  err = info.value
  text = err.render()
  assert err.code == code, text
  if where == "-":
    assert err.location is None, text
  else:
    assert err.location is not None, text
    file, _, linecol = where.rpartition(":")
    file, _, line = file.rpartition(":") if file.count(":") else ("", "", file)
    linecol = f"{line}:{linecol}"
    assert f"{err.location.line}:{err.location.col}" == linecol, text
    # The location names this fixture, or the helper file the .expect names.
    want = os.path.join(HERE, file) if file else path
    assert os.path.abspath(err.location.file) == os.path.abspath(want), text
    assert f"{err.location.line} | " in text, text  # the source line is quoted
  for c in contains:
    assert c in text, f"{c!r} not in:\n{text}"

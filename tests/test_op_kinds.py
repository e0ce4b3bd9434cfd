"""Ops complete by construction: an op's kind gives it every table's rule, and no walker
names an op.

A new pointwise op, declared once (in the table, or in Python with `@sexpgpu.op`), has
its shape, front end, lowering, FLOPs, backward cost, saved inputs, decode and split rules
with no other edit; a kind some table has no rule for is refused at the declaration.
"""

import ast
import os

import numpy as np
import pytest

import sexpgpu
from sexpgpu.errors import SxError
from sexpgpu.front import declared
from sexpgpu.front.build import Builder
from sexpgpu.front.experiment import global_env
from sexpgpu.ir.graph import Node
from sexpgpu.ir.opdef import KINDS, OPS, TABLES, LowerCtx, register
from sexpgpu.ir.shapes import infer
from sexpgpu.lower import flops, layouts
from sexpgpu.lower.rules import lowering
from sexpgpu.models import decode_rules
from sexpgpu.reader.read import read_text
from sexpgpu.tools.optable import gaps
from sexpgpu.userops import OpDeclarationError

NAME = "self-product"  # x * x: one flop an element, as XLA counts it too
ROOT = os.path.join(os.path.dirname(__file__), "..", "sexpgpu")


def _square(x):
  return x * x


def _forget(name):
  OPS.pop(name, None)
  for t in TABLES:
    t.forget(name)
  infer.cache_clear()


@pytest.fixture(params=["table", "python"])
def new_op(request):
  """The op declared once: in the IR's table, or as a user op; nothing else is edited."""
  if request.param == "table":
    register(NAME, ("x",), "x times itself", kind="pointwise")(lambda ctx, x: _square(x))
  else:
    sexpgpu.op(NAME, doc="x times itself", kind="pointwise")(_square)
  yield request.param
  _forget(NAME)


def _node(op, inputs, shape, attrs=()):
  return Node(op, tuple(inputs), tuple(sorted(attrs)), "f32", tuple(shape), None, "")


def test_a_new_pointwise_op_has_every_rule_from_one_declaration(new_op):
  # shape and front end: the call reads from its declaration
  assert infer(NAME, (), (("T", "f32", (2, 3, 8)),)) == ("f32", (2, 3, 8))
  env = global_env({NAME: declared.builtins_for([NAME])[NAME]})
  b = Builder(env)
  form = read_text(f"(fn [batch] ({NAME} (get batch :x)))", "kinds.sx")[0]
  g, _ = b.build("out", b.eval(form, env), {"x": ("f32", (2, 3, 8))})
  (node,) = [n for n in g.nodes() if n.op == NAME]
  assert node.shape == (2, 3, 8)
  # lowering: the reference rule on every platform
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  assert np.array_equal(np.asarray(lowering(NAME, "cpu")(LowerCtx(), x)), x * x)
  # FLOPs: one an element (the kind's count; XLA's cost analysis of a user op's function)
  assert flops.node_flops(node) == 2 * 3 * 8
  # the backward: about the forward's once, and it reads its input
  assert flops.BACKWARD[NAME](48, [True]) == 48 and flops.BACKWARD[NAME](48, [False]) == 0
  assert flops.saved_inputs(node) == node.inputs
  # decode: positions pass through it (its time axis is its input's)
  p = decode_rules.Plan(g, 3, {node.inputs[0].uid: 1}, set(), set(), [])
  assert decode_rules.DECODE[NAME](p, node, list(node.inputs), [(node.inputs[0], 1)]) == 1
  # split: a column split passes it, so Megatron's pair is found through it
  assert layouts.SPLIT[NAME](node, (2,)) == 2
  assert [line for line in gaps() if NAME in line] == (
      [] if new_op == "python" else [f"`{NAME}`: no front end (sexpgpu/front/prims.py) and no "
                                     "MADE_BY note"])  # the table's front ends are read at import


def test_a_pair_is_found_through_a_pointwise_op_written_in_python(new_op):
  """lower/layouts.py's pair finder passes a pointwise user op (once skipped at run time)."""
  w1 = _node("param", (), (4, 16), (("path", "up"),))
  w2 = _node("param", (), (16, 4), (("path", "down"),))
  h = _node("input", (), (2, 3, 4), (("field", "x"),))
  up = _node("matmul", (h, w1), (2, 3, 16))
  mid = _node(NAME, (up,), (2, 3, 16))
  down = _node("matmul", (mid, w2), (2, 3, 4))
  out = layouts.Pairs()
  layouts._walk_body([w1, w2, h, up, mid, down], out, {}, {})
  assert out.split == {"down": (0, "rows"), "up": (1, "columns")}


def test_a_kind_a_table_has_no_rule_for_is_refused_at_the_declaration():
  """E-OP-003: a product written in Python has no decode rule to take."""
  with pytest.raises(SxError) as e:
    sexpgpu.op("my-product", kind="product")(lambda a, b: a @ b)
  assert e.value.code == "E-OP-003" and "my-product" not in OPS
  assert "decode table (sexpgpu/models/decode_rules.py)" in e.value.message
  assert "test_op_kinds.py:" in e.value.where
  with pytest.raises(OpDeclarationError, match="no kind 'pointwse'"):
    sexpgpu.op("my-gate", kind="pointwse")(_square)


def test_a_refused_kind_in_a_required_file_is_placed_at_the_require(tmp_path):
  from sexpgpu.errors import Loc
  from sexpgpu.front import pyops
  path = tmp_path / "my_ops.py"
  text = ("import sexpgpu\n\n\n@sexpgpu.op('my-conv', kind='window')\ndef ok(x):\n  return x\n\n\n"
          "@sexpgpu.op('my-scan', kind='function')\ndef scan(x):\n  return x\n")
  path.write_text(text)
  loc = Loc(file="exp.sx", line=3, col=1, end_line=3, end_col=20)
  try:
    with pytest.raises(SxError) as e:
      pyops.load("my_ops.py", str(path), text, loc)
  finally:
    _forget("my-conv")
  assert e.value.code == "E-OP-003" and e.value.location == loc
  assert ("declared at", "my_ops.py:9") in e.value.notes and "my-scan" not in OPS


def test_every_kind_a_user_may_declare_has_every_rule():
  fits = [k for k in KINDS if all(t.default(k) is not None for t in TABLES
                                  if t.complete and t is not flops.FLOPS)]
  assert "pointwise" in fits and "opaque" in fits and "product" not in fits


def test_an_opaque_op_written_in_python_is_named_by_decoding():
  sexpgpu.op("my-mixer", doc="mixes positions")(_square)
  try:
    n = _node("my-mixer", (_node("input", (), (2, 3)),), (2, 3))
    with pytest.raises(decode_rules.NoRule, match="test_op_kinds.py.*not declared"):
      decode_rules.DECODE["my-mixer"](None, n, list(n.inputs), [(n.inputs[0], 1)])
    assert layouts.SPLIT["my-mixer"](n, (1,)) is None
  finally:
    _forget("my-mixer")


# --- no walker names an op ------------------------------------------------------------------
# The modules that interpret every op: their walkers find an op's rule in its tables, never
# by its name. Every module that makes an OpTable is one of them.
INTERPRETERS = {"lower/flops.py", "lower/layouts.py", "models/decode_rules.py",
                "run/planning/layout_plan.py", "front/prims.py", "ir/verify.py", "ir/shapes.py",
                "lower/registry.py", "userops.py", "tools/optable.py"}


def _modules():
  found = set(INTERPRETERS)
  for folder, _, files in os.walk(ROOT):
    for f in files:
      path = os.path.join(folder, f)
      if f.endswith(".py") and "OpTable(" in open(path, encoding="utf-8").read():
        found.add(os.path.relpath(path, ROOT))
  return sorted(found)


def _names_an_op(test) -> list[str]:
  """The op names `test` compares an op (`x.op`, `op`) with."""
  out = []
  for n in ast.walk(test):
    if isinstance(n, ast.Compare):
      sides = [n.left] + n.comparators
      if any(isinstance(s, ast.Attribute) and s.attr == "op" or isinstance(s, ast.Name)
             and s.id == "op" for s in sides):
        out += [c.value for s in sides for c in ast.walk(s)
                if isinstance(c, ast.Constant) and c.value in OPS]
  return out


def walkers_naming_ops(source: str) -> list[tuple[int, list[str]]]:
  """(line, op names) of each test inside a loop over nodes (an if, elif, conditional
  expression or comprehension's condition) that dispatches on an op's name."""
  found = []
  for loop in ast.walk(ast.parse(source)):
    if not isinstance(loop, (ast.For, ast.comprehension)):
      continue
    for n in ast.walk(loop) if isinstance(loop, ast.For) else [loop]:
      tests = [n.test] if isinstance(n, (ast.If, ast.IfExp, ast.While)) else (
          n.ifs if isinstance(n, ast.comprehension) else [])
      found += [(t.lineno, names) for t in tests if (names := _names_an_op(t))]
  return sorted(set((line, tuple(names)) for line, names in found))


def test_the_check_finds_a_walker_that_names_an_op():
  bad = ("def count(nodes):\n  total = 0\n  for node in nodes:\n"
         "    if node.op == 'param':\n      continue\n"
         "    elif node.op in ('sdpa', 'einsum'):\n      total += 2\n  return total\n")
  assert walkers_naming_ops(bad) == [(6, ("sdpa", "einsum"))]
  assert walkers_naming_ops("x = [n for n in ns if n.op == 'matmul']\n") == [(1, ("matmul",))]


def test_no_walker_of_an_interpretation_names_an_op():
  found = {}
  for rel in _modules():
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
      hits = walkers_naming_ops(f.read())
    if hits:
      found[rel] = hits
  assert found == {}

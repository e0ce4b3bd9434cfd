"""Every op of the IR has an entry in every interpretation's table, or a reason it has none."""

import pytest

from sexpgpu.front import prims
from sexpgpu.ir.ops import OPS
from sexpgpu.lower import flops
from sexpgpu.models import decode_rules as decode
from sexpgpu.tools import langdoc
from sexpgpu.tools.optable import gaps


def test_every_op_has_every_rule():
  assert gaps() == []


@pytest.mark.parametrize("table,op", [(flops.FLOPS, "cumsum"), (decode.DECODE, "conv"),
                                      (prims.BUILTINS, "top-k"), (flops.FLOPS, "matmul"),
                                      (decode.DECODE, "sdpa"), (flops.FLOPS, "scan"),
                                      (decode.DECODE, "associative-scan"),
                                      (prims.BUILTINS, "scan")])
def test_a_missing_rule_is_a_gap(monkeypatch, table, op):
  monkeypatch.delitem(table, op)
  found = gaps()
  assert len(found) == 1 and found[0].startswith(f"`{op}`"), found


def test_every_op_has_a_split_rule_or_a_reason():
  """lower/layouts.py's SPLIT (how a tensor split passes each op), not yet in gaps()."""
  from sexpgpu.lower.layouts import SPLIT
  assert sorted(set(OPS) - set(SPLIT)) == [] and sorted(set(SPLIT) - set(OPS)) == []
  assert all(callable(r) or r.strip() for r in SPLIT.values())


def test_a_rule_for_no_op_is_a_gap(monkeypatch):
  monkeypatch.setitem(flops.FLOPS, "no-such-op", "none")
  assert gaps() == ["`no-such-op` in flops (sexpgpu/lower/flops.py) is not an op"]


def test_the_reference_reads_each_ops_line_from_its_declaration():
  text = langdoc.generate()
  for name, op in OPS.items():
    if name in prims.BUILTINS:
      assert f"| `{name}` | `{op.usage()}` | {op.doc.replace('|', chr(92) + '|')} |" in text, name


def test_an_unknown_keyword_lists_the_declared_ones():
  from sexpgpu.errors import SxError
  from test_ops import graph_of
  with pytest.raises(SxError) as e:
    graph_of("(conv img ker :strides 2)", ("img", "ker"))
  assert e.value.code == "E-FORM-002"
  assert ":stride :padding :dilation :groups" in e.value.render()

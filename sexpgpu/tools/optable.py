"""Whether every op of the IR has an entry in every interpretation's table.

Each interpretation keeps its own table keyed by op name (`ir.opdef.OpTable`),
a default rule for each kind of op and the ops that are its exceptions: FLOPs,
the backward's cost and saved inputs (`lower.flops`), the decode rule
(`models.decode_rules.DECODE`), the split rule (`lower.layouts.SPLIT`); besides
them the front end (`front.prims.BUILTINS`, or a note of the form that writes the
op) and the reference page (`tools.langdoc`). An entry may be a rule or a reason
there is none; a missing one is a gap.
"""

from __future__ import annotations


def gaps() -> list[str]:
  """One line per (op, table) with no entry, and per entry naming no op; [] when complete."""
  from sexpgpu.front.declared import MADE_BY
  from sexpgpu.front.prims import BUILTINS
  from sexpgpu.ir.opdef import TABLES
  from sexpgpu.ir.ops import OPS
  from sexpgpu.lower import flops, layouts  # noqa: F401  (they make their tables)
  from sexpgpu.models import decode_rules  # noqa: F401
  tables = {f"{t.what} ({t.where})": t for t in TABLES if t.complete}
  out = []
  for name, op in sorted(OPS.items()):
    if name not in BUILTINS and name not in MADE_BY and op.source is None:
      out.append(f"`{name}`: no front end (sexpgpu/front/prims.py) and no MADE_BY note")
    if not op.doc.strip():
      out.append(f"`{name}`: no doc line in its declaration")
    for what, table in tables.items():
      rule = table.get(name)
      if rule is None or (isinstance(rule, str) and not rule.strip()):
        out.append(f"`{name}`: no entry in {what}")
  for what, table in tables.items():
    out += [f"`{n}` in {what} is not an op" for n in sorted(set(table) - set(OPS))]
  return out

"""`sexpgpu check`: compile without training and say what was built."""

from __future__ import annotations

from sexpgpu.ir.printer import print_graph
from sexpgpu.lang.select import format_value
from sexpgpu.run.compile import compile_file


def check(path: str, variant=None, sets=(), diagnostics=None, what: str | None = None) -> str:
  """The text `sexpgpu check` prints: a summary, or knobs / params / ir."""
  c = compile_file(path, variant, sets, None, diagnostics)
  if what == "knobs":
    return knobs_text(c)
  if what == "params":
    return params_text(c)
  if what == "ir":
    return c.ir_text() + "\n"
  lines = [f"check: {c.program.path} slug {c.slug} fingerprint {c.fingerprint}", "", "knobs:"]
  lines += ["  " + line for line in knobs_text(c).splitlines()]
  lines += ["", "parameters:"] + ["  " + line for line in params_text(c).splitlines()]
  lines += ["", "loaders:"]
  for name, ld in c.loaders.items():
    d = ld.describe()
    fields = " ".join(f":{k} {v}" for k, v in d["fields"].items())
    size = "endless" if d.get("records") is None else f"{d['records']} records"
    extra = (f" entropy rate {d['entropy_rate']:.5f} nats/token (the floor of the loss)"
             if "entropy_rate" in d else "")
    lines.append(f"  {name}: {d['kind']} {fields} {size}{extra}")
  lines += ["", "passes:"] + [
      f"  {n}: :data {p.data} :every {p.every if p.every is not None else '-'} "
      f":batches {p.batches} metrics {' '.join(f'{n}/{m}' for m, _ in p.metrics)}"
      for n, p in c.exp.passes.items()] or ["  -"]
  if len(c.stages) > 1:
    lines += ["", "curriculum:"] + [f"  {s.index} {s.name}: :data {s.data}" for s in c.stages]
  return "\n".join(lines) + "\n"


def knobs_text(c) -> str:
  rows = [(k, format_value(v.value), v.source) for k, v in sorted(c.selection.knobs.items())]
  w = max(len(r[0]) for r in rows)
  v = max(len(r[1]) for r in rows)
  return "\n".join(f"{k:<{w}}  {val:<{v}}  {src}" for k, val, src in rows) + "\n"


def params_text(c) -> str:
  rows = [(p.path, f"{p.dtype}[{','.join(map(str, p.full_shape))}]", str(p.init), p.count)
          for p in c.params.values()]
  total = sum(r[3] for r in rows)
  w0 = max([len(r[0]) for r in rows] + [5])
  w1 = max([len(r[1]) for r in rows] + [5])
  w2 = max([len(r[2]) for r in rows] + [4])
  out = [f"{'path':<{w0}}  {'shape':<{w1}}  {'init':<{w2}}  {'count':>12}"]
  out += [f"{a:<{w0}}  {b:<{w1}}  {c_:<{w2}}  {n:>12,}" for a, b, c_, n in rows]
  out.append(f"{'total':<{w0}}  {'':<{w1}}  {'':<{w2}}  {total:>12,}")
  return "\n".join(out) + "\n"

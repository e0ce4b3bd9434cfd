"""The lowering report: what the device did with the training graph, as lines and an annotation."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

LABEL = 26  # the report's column: `  memory                    2.7 GiB of 78.8 GiB free`
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?(\w+)\[")
_DOT = re.compile(r"\bdot\(([^)]*)\)")
_GEMM = re.compile(r"\bcustom-call\(([^)]*)\).*custom_call_target=\"__cublas\$(?:lt\$)?"
                   r"(?:gemm|matmul)")
_FUSION = re.compile(r"=\s.*?\bfusion\(")
_TYPED = re.compile(r"^(\w+)\[")


def hlo_counts(hlo: str) -> dict[str, Any]:
  """Dot ops (XLA dots and cuBLAS gemm calls) and fusions in optimized HLO text.

  Returns:
    {"dots": n, "inputs": sorted operand dtypes, "accumulate": sorted result
    dtypes (a dot's result dtype is its accumulation type: XLA dots on the
    GPU accumulate in f32 and round only when the result is narrower),
    "fusions": n}
  """
  types: dict[str, str] = {}
  found: list[tuple[list[str], str]] = []
  fusions = 0
  for line in hlo.splitlines():
    d = _DEF.match(line)
    if d:
      types[d.group(1)] = d.group(2)
    if _FUSION.search(line):
      fusions += 1
    m = _DOT.search(line) or _GEMM.search(line)
    if m and d and "=" in line[:line.find(m.group(0))]:
      found.append(([o.strip() for o in m.group(1).split(",") if o.strip()], d.group(2)))
  inputs, outs = set(), set()
  for operands, out in found:
    outs.add(out)
    for o in operands[:2]:
      t = _TYPED.match(o)
      name = o.split()[-1].lstrip("%")
      dt = t.group(1) if t else types.get(name)
      if dt:
        inputs.add(dt)
  return {"dots": len(found), "inputs": sorted(inputs), "accumulate": sorted(outs),
          "fusions": fusions}


def device_title(device) -> str:
  """`cuda compute_90 NVIDIA H200` or `cpu cpu`: the report's first words."""
  platform = getattr(device, "platform", "cpu")
  kind = getattr(device, "device_kind", platform)
  if platform in ("gpu", "cuda"):
    cc = str(getattr(device, "compute_capability", "") or "").replace(".", "")
    return f"cuda compute_{cc} {kind}" if cc else f"cuda {kind}"
  return f"{platform} {kind}"


def _line(label: str, value: str) -> str:
  return f"  {label:<{LABEL}}{value}"


def _regions(regions: Mapping[str, str] | Sequence[tuple[str, str]] | None
             ) -> list[tuple[str, str]]:
  if not regions:
    return []
  return list(regions.items()) if isinstance(regions, Mapping) else list(regions)


def _products(c: dict) -> str:
  ins = "/".join(c["inputs"]) or "no"
  acc = "/".join(c["accumulate"]) or "no"
  return f"{c['dots']} dot ops, {ins} inputs, {acc} accumulate"


def lowering_report(device, patterns_on: bool, regions, compiled_train, memory_plan,
                    stacking_text: str | None) -> list[str]:
  """The lowering report's lines, as `sexpgpu check --target cuda` prints them.

  Args:
    device: the jax Device the run executes on.
    patterns_on: SEXPGPU_PATTERNS (True for on).
    regions: (name, text) pairs or a dict, one line each, in order, such as
      ("attention", "4 regions → cudnn fused attention (bf16, causal)").
    compiled_train: the compiled train step (jax.stages.Compiled) or its
      optimized HLO text; products and fusions are counted in it.
    memory_plan: the memory.Plan, or None to leave the line out.
    stacking_text: the stacking line's value (choose_stacking's text), or None.

  Returns:
    The lines, first `lowering: <device>, patterns on|off`.
  """
  counts = hlo_counts(_hlo(compiled_train))
  lines = [f"lowering: {device_title(device)}, patterns {'on' if patterns_on else 'off'}"]
  lines += [_line(name, text) for name, text in _regions(regions)]
  lines.append(_line("products", _products(counts)))
  lines.append(_line("fusions", f"{counts['fusions']} XLA fusions in the train step"))
  if memory_plan is not None:
    lines.append(_line("memory", memory_plan.text()))
  if stacking_text:
    lines.append(_line("stacking", stacking_text))
  return lines


def lowering_annotation(device, patterns_on: bool, regions, compiled_train, memory_plan,
                        stacking_text: str | None) -> dict:
  """The lowering report as one metrics annotation (the same facts as the lines)."""
  counts = hlo_counts(_hlo(compiled_train))
  out = {"kind": "lowering", "device": device_title(device), "patterns": bool(patterns_on),
         "regions": {name: text for name, text in _regions(regions)},
         "products": {"dots": counts["dots"], "inputs": counts["inputs"],
                      "accumulate": counts["accumulate"]},
         "fusions": counts["fusions"], "stacking": stacking_text,
         "lines": lowering_report(device, patterns_on, regions, compiled_train, memory_plan,
                                  stacking_text)}
  if memory_plan is not None:
    out["memory"] = memory_plan.annotation()
  return out


def _hlo(compiled) -> str:
  return compiled if isinstance(compiled, str) else compiled.as_text()

"""`sexpgpu check FILE --target cuda`: the run's steps lowered for CUDA on any machine, reported.

The train step and every pass step are built as `run` builds them (the ranks
`SEXPGPU_DEVICES` names, with host devices standing in for GPUs, the run's
sharding and precision) and lowered for CUDA with the GPU's lowering rules.
What serves each attention, each Pallas kernel and its backend, and the custom
calls are read from the lowered StableHLO; nothing is compiled, so the memory
plan is not known here. `--gpu NAME` adds a roofline estimate.
"""

from __future__ import annotations

import os
import re
import traceback

from sexpgpu import env
from sexpgpu.errors import SxError

TARGETS = ("cuda",)
# name → (the device_kind the peak table knows, memory bandwidth in bytes/s)
GPUS = {
    "A100": ("NVIDIA A100-SXM4-80GB", 2.04e12),
    "H100": ("NVIDIA H100 80GB HBM3", 3.35e12),
    "H200": ("NVIDIA H200", 4.8e12),
    "L4": ("NVIDIA L4", 0.30e12),
    "L40S": ("NVIDIA L40S", 0.864e12),
    "B200": ("NVIDIA B200", 8.0e12),
}
# name → compute capability (NVIDIA's CUDA GPUs table): FP8 matmuls need 8.9 or newer
CAPABILITY = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "L4": (8, 9), "L40S": (8, 9),
              "B200": (10, 0)}
KERNEL_TEXT = {"cudnn": "cudnn", "pallas-flash": "pallas-flash", "pallas-segments":
               "pallas-segments", "xla": "xla"}
_PALLAS_NAME = re.compile(r"sexpgpu_[a-z_]+|mha_[a-z_]+")
LABEL = 14


def check_target(target: str, gpu: str | None) -> None:
  """Raises E-FORM-001 for a --target or --gpu that is not known."""
  if target not in TARGETS:
    raise SxError("E-FORM-001", f"--target {target} is not a target sexpgpu lowers for",
                  where="--target", fix="--target cuda")
  if gpu is not None and gpu.upper() not in GPUS:
    raise SxError("E-FORM-001", f"--gpu {gpu} is not in the roofline table",
                  where="--gpu", fix="--gpu " + "|".join(GPUS))


def check_paper(target: str | None, devices: int | None, nodes: int | None) -> None:
  """Raises E-FORM-001 for --devices or --nodes without --target cuda, below 1, or nodes that
  do not divide the devices."""
  if devices is None and nodes is None:
    return
  if target is None:
    raise SxError("E-FORM-001", "--devices and --nodes plan a run on paper for a target",
                  where="--devices", fix="add --target cuda --gpu H100")
  if devices is None:
    raise SxError("E-FORM-001", "--nodes needs --devices", where="--nodes",
                  fix="--devices 64 --nodes 8")
  if devices < 1 or (nodes is not None and (nodes < 1 or devices % nodes)):
    raise SxError("E-FORM-001", f"--devices {devices} --nodes {nodes} is not a machine",
                  where="--devices", fix="at least one device, and nodes that divide the "
                  "devices: --devices 64 --nodes 8")


def check_fp8(c, gpu: str | None) -> None:
  """Raises E-PREC-001 when the run multiplies in FP8 and `--gpu` names a card of compute
  capability below 8.9."""
  from sexpgpu.lower import fp8
  if str(c.exp.run["precision"]) != "fp8" or gpu is None:
    return
  name = gpu.upper()
  if name in CAPABILITY and not fp8.capability_ok(CAPABILITY[name]):
    fp8.refuse(name, CAPABILITY[name], f"--gpu {gpu}")


def fp8_line(c, notes: list) -> str | None:
  """The report's `fp8` line: how many products run in float8 and of which parameters."""
  if str(c.exp.run["precision"]) != "fp8":
    return None
  from sexpgpu.lower import fp8
  paths = fp8.selected_paths(c.stages[0].graph, fp8.patterns(c.exp.run))
  n = sum(1 for x in notes if x.get("kind") == "fp8")
  shown = ", ".join(paths[:4]) + (f", … ({len(paths)} parameters)" if len(paths) > 4 else "")
  return _line("fp8", f"{n} products traced in float8 (e4m3 forward, e5m2 gradients, per-tensor "
               f"current scaling; no scale state): {shown or 'no hidden matrix'}")


def paper_text(c, gpu: str | None, devices: int, nodes: int) -> str:
  """The plan of a run on `devices` GPUs (`--gpu`, H100 unless named) over `nodes` nodes."""
  from sexpgpu.run.planning import layout_plan
  check_fp8(c, gpu)
  gpu = (gpu or "H100").upper()
  if gpu not in ("A100", "H100", "H200", "B200"):
    raise SxError("E-FORM-001", f"--gpu {gpu} has no link figures in the plan's table",
                  where="--gpu", fix="--gpu A100|H100|H200|B200 with --devices")
  return layout_plan.paper_text(c, layout_plan.paper(c, gpu, devices, nodes), gpu)


def _line(label: str, value: str) -> str:
  return f"  {label:<{LABEL}}{value}"


def _lower_error(c, what: str, e: Exception) -> SxError:
  """E-DEV-001 naming the region whose lowering failed (its `.sx` place) and the first line."""
  files = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(e.__traceback__)]
  attention = any(f.endswith(("lower/attention.py", "kernels/flash_attention.py"))
                  for f in files)
  regions = [r for r in c.regions if r.kind == "attention"] if attention else []
  first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
  region = "attention" if regions else what
  return SxError("E-DEV-001", f"the {what} cannot be lowered for cuda: {region}: "
                 f"{type(e).__name__}: {first}",
                 location=regions[0].loc if regions and regions[0].loc else None,
                 where=None if regions and regions[0].loc else f"{what} (--target cuda)",
                 fix="--set precision=bf16 or f32 picks another attention; SEXPGPU_DEBUG=1 "
                     "shows the lowering's traceback for a report")


def _attention_line(c, notes: list) -> str | None:
  att = [n for n in notes if n.get("kind") == "attention"]
  regions = [r for r in c.regions if r.kind == "attention"]
  if not att and not regions:
    return None
  n = sum(r.times for r in regions) or len(att)
  where = f" at {regions[0].loc}" if regions and regions[0].loc else ""
  kinds = sorted({KERNEL_TEXT.get(a.get("kernel") or a["impl"], a["impl"]) for a in att})
  whys = sorted({a["why"] for a in att if a.get("why")})
  masks = sorted({"segments" if a.get("mask") else ("causal" if a["causal"] else "full")
                  for a in att})
  text = f"{n} region{'s' if n != 1 else ''}{where} → {' + '.join(kinds) or 'xla'}"
  text += f" ({', '.join(masks)})" if masks else ""
  if whys:
    text += ": " + "; ".join(whys)
  return text


def _step_lines(c, text: str, notes: list) -> list[str]:
  from sexpgpu.lower.cuda_target import custom_calls, sharding_rules
  lines = []
  att = _attention_line(c, notes)
  if att:
    lines.append(_line("attention", att))
  calls = custom_calls(text)
  kernels = sorted(set(_PALLAS_NAME.findall(text))) if "__gpu$xla.gpu.triton" in calls else []
  mosaic = sum(n for t, n in calls.items() if "mosaic" in t.lower())
  partitioned = sorted({f"{n['kernel']} on {n['backend']}" for n in notes
                        if n.get("impl") == "pallas" and n.get("backend")})
  if kernels or mosaic:
    lines.append(_line("pallas", ", ".join(kernels) + (" on triton" if kernels else "")
                       + (f"; {mosaic} Mosaic GPU calls" if mosaic else "")))
  elif partitioned:  # inside custom partitioning: the kernels lower when XLA partitions
    lines.append(_line("pallas", ", ".join(partitioned) + ", each call with its sharding "
                       "rule (its kernels lower when XLA partitions the step)"))
  lines.append(_line("custom calls", ", ".join(f"{t} {n}" for t, n in sorted(calls.items()))
                     or "none"))
  rules = sharding_rules(text)
  if rules:
    lines.append(_line("sharding", f"{rules} custom calls carry a sharding rule"))
  return lines


def _roofline(c, training, gpu: str, flops: int, state) -> list[str]:
  import jax
  from sexpgpu.lower.flops import forward_bytes, gpu_peak
  kind, bandwidth = GPUS[gpu.upper()]
  peak = gpu_peak(kind, training.precision)
  ranks = training.ranks
  share = training.share(state)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(share))
  # each rank: its share of the products at the peak; its state read and written once, and
  # its microbatches' activations written forward and read back, at the memory bandwidth
  act = forward_bytes(c.stages[0].graph) * training.k // ranks
  compute = flops / ranks / peak
  memory = (2 * state_bytes + 2 * act) / bandwidth
  step = max(compute, memory)
  bound = "compute" if compute >= memory else "memory"
  # an FP8 run's MFU counts against the bf16 peak, as torchtitan and MaxText count theirs
  rate = "bf16" if training.precision == "fp8" else training.precision
  return [_line("estimate", f"{gpu.upper()} ({peak / 1e12:.0f} TFLOP/s {rate}, "
                f"{bandwidth / 1e12:.2f} TB/s): step ≥ {step * 1e3:.2f} ms, MFU ≤ "
                f"{100 * compute / step:.0f}% ({bound}-bound roofline; an estimate, not a "
                "measurement)")]


def cuda_text(c, gpu: str | None = None, what: str | None = None) -> str:
  """The lowering report a CUDA run would print (or, `what="hlo"`, its StableHLO).

  Raises:
    SxError: E-DP-003 when the microbatches do not divide over the ranks; E-DEV-001 when a
      step cannot be lowered for CUDA, naming the region; E-PREC-001 for an FP8 run on a
      `--gpu` below compute capability 8.9.
  """
  from sexpgpu.lower.cuda_target import cudnn_source
  from sexpgpu.lower.flops import train_flops
  from sexpgpu.run.backend import microbatches_divide, open_devices, parse_device_list
  from sexpgpu.run.training import build
  run = c.exp.run
  check_fp8(c, gpu)
  k = int(run["microbatches"])
  place = open_devices("cpu", parse_device_list(env.get("SEXPGPU_DEVICES")))
  microbatches_divide(k, place.ranks)
  layout = None
  if str(run.get("sharding", "")) == "auto":  # chosen on paper for these ranks as GPUs
    from sexpgpu.reader.forms import Symbol
    from sexpgpu.run.planning import layout_plan
    layout = layout_plan.paper(c, (gpu or "H100").upper() if (gpu or "H100").upper() in
                               ("A100", "H100", "H200", "B200") else "H100", place.ranks, 1)
    run["sharding"] = Symbol(layout.chosen.text)
  training = build(c, place)
  state = training.abstract_state()
  batches = training.abstract_batches(c.stages[0].data, (k,))
  step = training.step(0, k // place.ranks)
  try:
    lowered, notes = step.lowered_for_cuda(state, batches)
  except SxError:
    raise
  except Exception as e:  # the lowering's own error, shown as the region's
    raise _lower_error(c, "train step", e) from None
  text = lowered.as_text()
  if what == "hlo":
    return text + "\n"
  ranks = f"{place.ranks} ranks" if place.ranks > 1 else "1 rank"
  lines = [f"target: cuda, {ranks} ({training.sharding}), {training.precision}; "
           f"{cudnn_source()}",
           f"train step (K={k}, lowered, not compiled):"]
  if layout is not None:
    lines[1:1] = layout.lines()
  lines += _step_lines(c, text, notes)
  fp8_text = fp8_line(c, notes)
  if fp8_text:
    lines.append(fp8_text)
  flops = train_flops(c.stages[0].graph, k)
  lines.append(_line("flops", f"{flops:.3g} a step (the graph's count: forward and backward)"))
  lines.append(_line("memory", "not known without the GPU compiler (run it on the GPU: "
                     "sexpgpu check --print plan --device cuda)"))
  if gpu is not None:  # the estimate is the train step's, so it stands under it
    lines += _roofline(c, training, gpu, flops, state)
  params = training.place_abstract(state)["params"]
  for name, ps in training.pass_steps.items():
    p = c.exp.passes[name]
    batch = place.abstract(training.abstract_batches(p.data))
    ps.notes.clear()
    try:
      ptext = ps.lowered_for_cuda(params, batch).as_text()
    except SxError:
      raise
    except Exception as e:
      raise _lower_error(c, f"pass {name}", e) from None
    lines.append(f"pass {name}:")
    lines += _step_lines(c, ptext, ps.notes)
  return "\n".join(lines) + "\n"

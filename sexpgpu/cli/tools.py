"""`sexpgpu sweep | bundle | watch | plot`: flags and output; the work is in sexpgpu.tools."""

from __future__ import annotations

import sys

from absl import flags

from sexpgpu import env
from sexpgpu.cli.main import parse_flags, selection_flags, parse_sets, python_trust
from sexpgpu.errors import SxError


def _sweep_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  selection_flags(fv)
  flags.DEFINE_integer("steps", None, "replaces defrun :steps", flag_values=fv)
  flags.DEFINE_integer("eval_every", None, "replaces every pass's :every", flag_values=fv)
  flags.DEFINE_string("device", None, "cpu or cuda (SEXPGPU_DEVICE)", flag_values=fv)
  flags.DEFINE_string("metrics", None, "metrics targets; {slug} is replaced, a jsonl folder "
                      "gets <slug>.jsonl (default jsonl:<status-dir>/<slug>.jsonl)",
                      flag_values=fv)
  flags.DEFINE_string("checkpoint_dir", None, "checkpoint location; each point under its slug",
                      flag_values=fv)
  flags.DEFINE_string("status_dir", "sweep", "folder of the points' status files and logs",
                      flag_values=fv)
  flags.DEFINE_string("status", None, "as --status-dir: the folder of the points' status "
                      "files, each <slug>.status.json (run's --status, one per point)",
                      flag_values=fv)
  flags.DEFINE_integer("parallel", 1, "points run at once", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("table", None, "also write the table as CSV here", flag_values=fv)
  flags.DEFINE_string("emit", None, "skypilot: write one task file per point into the folder "
                      "given after it (or skypilot:DIR) and run nothing", flag_values=fv)
  flags.DEFINE_string("accelerators", "H100:1", "SkyPilot resources.accelerators of --emit",
                      flag_values=fv)
  return fv


def cmd_sweep(argv: list[str]) -> int:
  """`sexpgpu sweep FILE --set k=a,b ...`: runs (or emits) every point; prints the table."""
  from sexpgpu.tools import sweep
  fv = _sweep_flags()
  rest = parse_flags(fv, argv, "sweep")
  emit_dir = None
  if fv.emit is not None:
    kind, _, emit_dir = fv.emit.partition(":")
    if kind != "skypilot":
      raise SxError("E-FORM-001", f"--emit {fv.emit}: the one kind is skypilot",
                    where="--emit", fix="sexpgpu sweep FILE --set lr=1e-3,3e-3 --emit skypilot DIR")
    if not emit_dir:
      if len(rest) != 2:
        raise SxError("E-FORM-001", "--emit skypilot needs a folder after it", where="--emit",
                      fix="sexpgpu sweep FILE --set lr=1e-3,3e-3 --emit skypilot tasks/")
      emit_dir = rest.pop()
  if len(rest) != 1:
    raise SxError("E-FORM-001", f"sexpgpu sweep takes one experiment file, given {len(rest)}",
                  where="the command line", fix="sexpgpu sweep my-run.sx --set lr=1e-3,3e-3")
  from sexpgpu.tools.bundle import refuse_bundle
  refuse_bundle(rest[0], "sweep", f"sweep the experiment {rest[0]} was made from, or run the "
                f"bundle's own selection with sexpgpu run {rest[0]}")
  opts = sweep.SweepOptions(
      file=rest[0], grid=sweep.parse_grid(fv.set), variant=fv.variant, steps=fv.steps,
      eval_every=fv.eval_every, diagnostics=fv.diagnostics, device=fv.device,
      metrics=fv.metrics, checkpoint_dir=fv.checkpoint_dir,
      status_dir=fv.status if fv.status is not None else fv.status_dir,
      parallel=fv.parallel, table=fv.table,
      trust_python=env.trust_python() if fv.trust_python is None else fv.trust_python)
  if emit_dir is not None:
    for path in sweep.emit_skypilot(opts, emit_dir, fv.accelerators):
      sys.stdout.write(path + "\n")
    return 0
  # the points are `sexpgpu run` processes: --trust-python reaches them as its variable
  with env.exported("SEXPGPU_TRUST_PYTHON",
                    None if fv.trust_python is None else str(int(fv.trust_python))):
    rows, code = sweep.run_sweep(opts)
  sys.stdout.write(sweep.format_table(opts, rows))
  sys.stdout.flush()
  if opts.table:
    sweep.write_csv(opts, rows, opts.table)
  return code


def cmd_bundle(argv: list[str]) -> int:
  """`sexpgpu bundle FILE [--variant V] [--set k=v] [--with-data] -o run.sxb`."""
  from sexpgpu.tools.bundle import make_bundle
  fv = flags.FlagValues()
  selection_flags(fv)
  flags.DEFINE_bool("with_data", False, "also bundle the loaders' local files", flag_values=fv)
  flags.DEFINE_string("output", None, "the archive to write (run.sxb)", short_name="o",
                      flag_values=fv)
  rest = parse_flags(fv, argv, "bundle")
  if len(rest) != 1 or not fv.output:
    raise SxError("E-FORM-001", "sexpgpu bundle takes one experiment file and -o ARCHIVE",
                  where="the command line", fix="sexpgpu bundle my-run.sx -o my-run.sxb")
  with python_trust(fv.trust_python, True, "sexpgpu bundle"):  # it compiles the selection
    m = make_bundle(rest[0], fv.output, fv.variant, parse_sets(fv.set), fv.with_data)
  for note in m["notes"]:
    sys.stderr.write(f"bundle: {note}\n")
  n_data = sum(1 for f in m["files"].values() if f["kind"] == "data")
  sys.stderr.write(f"bundle: {fv.output}: {len(m['files']) - n_data} source files, {n_data} data "
                   f"files, slug {m['slug']}, fingerprint {m['fingerprint'][:12]}\n")
  return 0


def cmd_watch(argv: list[str]) -> int:
  """`sexpgpu watch STATUS_FILE [--interval S]`: exit 0 done, 1 failed, 2 stopped."""
  from sexpgpu.tools.watch import watch
  fv = flags.FlagValues()
  flags.DEFINE_float("interval", 0.5, "seconds between reads of the status file", flag_values=fv)
  flags.DEFINE_float("timeout", None, "give up after this many seconds (exit 3)", flag_values=fv)
  flags.DEFINE_float("wait", 30.0, "seconds to wait for the status file to appear",
                     flag_values=fv)
  rest = parse_flags(fv, argv, "watch")
  if len(rest) != 1:
    raise SxError("E-FORM-001", "sexpgpu watch takes one status file", where="the command line",
                  fix="sexpgpu watch run.status.json")
  return watch(rest[0], fv.interval, timeout=fv.timeout, appear=fv.wait)


def cmd_plot(argv: list[str]) -> int:
  """`sexpgpu plot METRICS.jsonl... [--metric a,b] -o curves.png`."""
  import matplotlib
  matplotlib.use("Agg")
  from sexpgpu.tools.plot import DEFAULT_METRICS, plot
  fv = flags.FlagValues()
  flags.DEFINE_list("metric", list(DEFAULT_METRICS), "metrics to draw, one panel each",
                    flag_values=fv)
  flags.DEFINE_string("output", "curves.png", "the PNG to write", short_name="o", flag_values=fv)
  rest = parse_flags(fv, argv, "plot")
  if not rest:
    raise SxError("E-FORM-001", "sexpgpu plot takes one or more jsonl metrics files",
                  where="the command line", fix="sexpgpu plot run.jsonl -o curves.png")
  if not fv.output:
    raise SxError("E-FORM-001", "sexpgpu plot -o is empty", where="-o",
                  fix="give -o the PNG to write: -o curves.png")
  skipped: dict[str, list[int]] = {}
  try:
    plot(rest, fv.metric, fv.output, skipped=skipped)
  finally:  # said before an error too: a file of nothing else has no values
    for path, lines in skipped.items():  # a torn last line of a live run among them
      shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
      sys.stderr.write(f"plot: {path}: {len(lines)} line{'s' if len(lines) > 1 else ''} "
                       f"skipped that {'are' if len(lines) > 1 else 'is'} no JSON object "
                       f"(line {shown})\n")
  sys.stderr.write(f"plot: {fv.output}\n")
  return 0


def cmd_coord_check(argv: list[str]) -> int:
  """`sexpgpu coord-check FILE --widths 64,128,256,512 -o coord.png`: μP's coordinate check.

  The coordinate check: each layer's mean |activation| over the first `--steps` against the
  width (`--knob`), standard and μP (`--parametrization`); `--json` prints the numbers."""
  from sexpgpu.tools import coordcheck
  fv = flags.FlagValues()
  selection_flags(fv)
  flags.DEFINE_string("widths", "64,128,256,512", "the width knob's values", flag_values=fv)
  flags.DEFINE_integer("steps", 5, "the first steps, on one fixed batch", flag_values=fv)
  flags.DEFINE_string("knob", None, "the knob that sets the width (default: width, d-model, "
                      "...)", flag_values=fv)
  flags.DEFINE_string("parametrization", "both", "both, standard or mup", flag_values=fv)
  flags.DEFINE_integer("base_width", None, "μP's :base-width (default: the file's, else the "
                       "smallest width)", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("output", "coord.png", "the PNG to write", short_name="o", flag_values=fv)
  flags.DEFINE_bool("json", False, "print the numbers as one JSON object", flag_values=fv)
  rest = parse_flags(fv, argv, "coord-check")
  if len(rest) != 1 or not fv.output:
    raise SxError("E-FORM-001", "sexpgpu coord-check takes one experiment file and -o PNG",
                  where="the command line",
                  fix="sexpgpu coord-check my-run.sx --widths 64,128,256,512 -o coord.png")
  opts = coordcheck.Options(rest[0], coordcheck.parse_widths(fv.widths), fv.steps, fv.knob,
                            fv.parametrization, fv.base_width, fv.variant, parse_sets(fv.set),
                            fv.output)
  with python_trust(fv.trust_python, False, "sexpgpu coord-check"):  # it compiles as run does
    result = coordcheck.coord_check(opts)
  coordcheck.plot(result, fv.output)
  sys.stdout.write(coordcheck.to_json(result) + "\n" if fv.json else coordcheck.table(result))
  sys.stderr.write(f"coord-check: {fv.output}\n")
  return 0


COMMANDS = {"sweep": cmd_sweep, "bundle": cmd_bundle, "watch": cmd_watch, "plot": cmd_plot,
            "coord-check": cmd_coord_check}

"""`sexpgpu COMMAND ...`: absl flags per command, errors as the catalogue prints them."""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # noqa: E402

from sexpgpu.errors import SxError  # noqa: E402

USAGE = """usage: sexpgpu COMMAND [FLAGS] FILE

commands:
  run FILE      compile and train an experiment in this process
  check FILE    compile without training; print knobs, parameters, loaders or IR
"""


def _selection_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("variant", None, "the variant to select", flag_values=fv)
  flags.DEFINE_multi_string("set", [], "knob=value overrides", flag_values=fv)
  flags.DEFINE_string("diagnostics", None, "diagnostics to run: a,b or all", flag_values=fv)


def _run_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  _selection_flags(fv)
  flags.DEFINE_integer("steps", None, "replaces defrun :steps", flag_values=fv)
  flags.DEFINE_integer("eval_every", None, "replaces every pass's :every; 0: only at the end",
                       flag_values=fv)
  flags.DEFINE_string("device", None, "cpu or cuda (SEXPGPU_DEVICE)", flag_values=fv)
  flags.DEFINE_string("metrics", None, "metrics targets (SEXPGPU_METRICS)", flag_values=fv)
  flags.DEFINE_string("status", None, "status file (SEXPGPU_STATUS)", flag_values=fv)
  flags.DEFINE_string("checkpoint_dir", None, "checkpoint location (SEXPGPU_CHECKPOINT_DIR)",
                      flag_values=fv)
  flags.DEFINE_string("resume", None, "DIR, s3://..., or latest (SEXPGPU_RESUME)", flag_values=fv)
  flags.DEFINE_bool("json", False, "the summary as one JSON line on standard output",
                    flag_values=fv)
  return fv


def _check_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  _selection_flags(fv)
  flags.DEFINE_enum("print", None, ["knobs", "params", "ir", "jaxpr", "hlo", "plan"],
                    "what to print", flag_values=fv)
  flags.DEFINE_string("device", None, "cpu or cuda, for --print hlo|plan (SEXPGPU_DEVICE)",
                      flag_values=fv)
  flags.DEFINE_integer("steps", None, "replaces defrun :steps", flag_values=fv)
  flags.DEFINE_integer("eval_every", None, "replaces every pass's :every", flag_values=fv)
  return fv


def _parse(fv: flags.FlagValues, argv: list[str], command: str) -> list[str]:
  # absl spells multi-word flags with underscores; accept the seed's dashes too.
  norm = []
  for a in argv:
    if a.startswith("--") and "-" in a[2:].split("=")[0]:
      name, eq, val = a[2:].partition("=")
      a = "--" + name.replace("-", "_") + eq + val
    norm.append(a)
  try:
    return fv([f"sexpgpu {command}"] + norm)[1:]
  except flags.Error as e:
    raise SxError("E-FORM-001", f"sexpgpu {command}: {e}", where="the command line",
                  fix=f"sexpgpu {command} --help lists the flags") from None


def _sets(values: list[str]) -> list[tuple[str, str]]:
  out = []
  for s in values:
    name, eq, val = s.partition("=")
    if not eq or not name:
      raise SxError("E-KNOB-002", f"--set {s} is not knob=value", where=f"--set {s}",
                    fix="write --set lr=0.003")
    out.append((name.strip(), val.strip()))
  return out


def _one_file(rest: list[str], command: str) -> str:
  if len(rest) != 1:
    raise SxError("E-FORM-001", f"sexpgpu {command} takes one experiment file, given "
                  f"{len(rest)}", where="the command line", fix=f"sexpgpu {command} my-run.sx")
  return rest[0]


def cmd_run(argv: list[str]) -> int:
  from sexpgpu.run.env import run_options
  from sexpgpu.run.compile import compile_file
  from sexpgpu.run.loop import run_compiled
  fv = _run_flags()
  rest = _parse(fv, argv, "run")
  given = _one_file(rest, "run")
  path, variant, sets = given, fv.variant, _sets(fv.set)
  if given.endswith(".sxb"):
    from sexpgpu.tools.bundle import open_bundle
    path, bundled_variant, bundled_sets = open_bundle(given)
    if variant is not None and variant != bundled_variant:
      raise SxError("E-VARIANT-001", f"the bundle was made with --variant {bundled_variant}; "
                    f"--variant {variant} cannot replace it", where="--variant",
                    fix="drop --variant; a bundle runs its own selection")
    variant, sets = bundled_variant, bundled_sets + sets  # a --set given here wins
  opts = run_options(given, fv)
  overrides = {"steps": fv.steps, "eval-every": fv.eval_every}
  compiled = compile_file(path, variant, sets, overrides, fv.diagnostics)
  summary = run_compiled(compiled, opts)
  if fv.json:
    import json
    sys.stdout.write(json.dumps(summary.as_dict()) + "\n")
    sys.stdout.flush()
  return summary.exit_code


def cmd_check(argv: list[str]) -> int:
  from sexpgpu.run.check import check
  fv = _check_flags()
  rest = _parse(fv, argv, "check")
  path = _one_file(rest, "check")
  device = fv.device or os.environ.get("SEXPGPU_DEVICE") or "cpu"
  overrides = {"steps": fv.steps, "eval-every": fv.eval_every}
  sys.stdout.write(check(path, fv.variant, _sets(fv.set), fv.diagnostics, fv.print, device,
                         overrides))
  return 0


COMMANDS = {"run": cmd_run, "check": cmd_check}


def _commands() -> dict:
  """The built-in commands plus those of the tool modules (sweep, bundle, watch, plot, doctor)."""
  import importlib
  out = dict(COMMANDS)
  for mod in ("sexpgpu.cli.tools", "sexpgpu.cli.doctor", "sexpgpu.cli.text"):
    try:
      m = importlib.import_module(mod)
    except ModuleNotFoundError as e:
      if e.name != mod:
        raise
      continue
    out.update(m.COMMANDS)
  return out


def main(argv: list[str] | None = None) -> int:
  """Entry point of the `sexpgpu` console script."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    sys.stdout.write(USAGE)
    return 0 if argv else 1
  command = argv[0]
  commands = _commands()
  if command not in commands:
    sys.stderr.write(SxError("E-FORM-001", f"unknown command `{command}`", where="the command line",
                             fix="commands: " + ", ".join(commands)).render() + "\n")
    return 1
  if os.environ.get("SEXPGPU_DEBUG") != "1":
    # Standard error carries our lines alone: a library's object that fails while being
    # collected (an S3 connection closed under it, say) is not the user's concern.
    sys.unraisablehook = lambda unraisable: None
  try:
    code = commands[command](argv[1:])
  except SxError as e:
    sys.stderr.write(e.render() + "\n")
    if os.environ.get("SEXPGPU_DEBUG") == "1":
      traceback.print_exc()
    return 1
  except KeyboardInterrupt:
    return 130
  return code


if __name__ == "__main__":
  sys.exit(main())

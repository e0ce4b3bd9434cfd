"""`sexpgpu COMMAND ...`: absl flags per command, errors as the catalogue prints them."""

from __future__ import annotations

# The stop signals are caught before anything slow is imported: a signal during start-up
# stops the run cleanly (status `stopped`, exit 128 + n), never by the default handler.
import os
import sys

from sexpgpu.run import signals as _signals

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "sexpgpu":
  _signals.install()  # the console script; an importer (a test) keeps its own handlers

import math  # noqa: E402
import re  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # noqa: E402

from sexpgpu import env  # noqa: E402
from sexpgpu.cli import help as cli_help  # noqa: E402
from sexpgpu.errors import SxError, traceback_text  # noqa: E402
from sexpgpu.lang.blame import guarded  # noqa: E402
from sexpgpu.run import output  # noqa: E402


def selection_flags(fv: flags.FlagValues) -> None:
  """Defines the selection flags every compiling command shares (--variant, --set, ...)."""
  flags.DEFINE_string("variant", None, "the variant to select", flag_values=fv)
  flags.DEFINE_multi_string("set", [], "knob=value overrides", flag_values=fv)
  flags.DEFINE_string("diagnostics", None, "diagnostics to run: a,b or all", flag_values=fv)
  flags.DEFINE_bool("trust_python", None, "run the .py files the experiment requires "
                    "wherever they lie, and in check, bundle and a bundle's run "
                    "(SEXPGPU_TRUST_PYTHON)", flag_values=fv)


def python_trust(trust_flag: bool | None, strict: bool, who: str):
  """The Python an experiment may run under this command (docs/guide.md, "Python in
  an experiment"): all with --trust-python or SEXPGPU_TRUST_PYTHON=1 (the flag wins); else none
  when `strict` (check, bundle, a bundle's run), else the files in its own folder."""
  from sexpgpu.front import pyops
  trusted = env.trust_python() if trust_flag is None else trust_flag
  return pyops.trusting(pyops.ALL if trusted else pyops.NONE if strict else pyops.OWN, who)


def _run_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  selection_flags(fv)
  flags.DEFINE_integer("steps", None, "replaces defrun :steps", flag_values=fv)
  flags.DEFINE_integer("eval_every", None, "replaces every pass's :every; 0: only at the end",
                       flag_values=fv)
  flags.DEFINE_string("device", None, "cpu or cuda (SEXPGPU_DEVICE)", flag_values=fv)
  flags.DEFINE_string("metrics", None, "metrics targets (SEXPGPU_METRICS)", flag_values=fv)
  flags.DEFINE_string("status", None, "status file (SEXPGPU_STATUS)", flag_values=fv)
  flags.DEFINE_string("checkpoint_dir", None, "checkpoint location (SEXPGPU_CHECKPOINT_DIR)",
                      flag_values=fv)
  flags.DEFINE_string("resume", None, "DIR, s3://..., or latest (SEXPGPU_RESUME)", flag_values=fv)
  flags.DEFINE_string("init_from", None, "a warm start: a checkpoint, a .safetensors file or "
                      "hf:DIR (SEXPGPU_INIT_FROM); the knob :init-from", flag_values=fv)
  flags.DEFINE_bool("json", False, "the summary as one JSON line on standard output",
                    flag_values=fv)
  flags.DEFINE_string("profile", None, "steps A..B to trace with jax.profiler (SEXPGPU_PROFILE)",
                      flag_values=fv)
  flags.DEFINE_string("profile_dir", None, "where the trace goes, default profile/<slug>/ "
                      "beside the metrics file (SEXPGPU_PROFILE_DIR)", flag_values=fv)
  return fv


def _check_flags() -> flags.FlagValues:
  fv = flags.FlagValues()
  selection_flags(fv)
  flags.DEFINE_enum("print", None, ["knobs", "params", "ir", "jaxpr", "hlo", "plan", "decode",
                                    "requires", "batch"], "what to print", flag_values=fv)
  flags.DEFINE_string("loader", None, "for --print batch: the loader (default the run's "
                      ":data)", flag_values=fv)
  flags.DEFINE_string("fn", None, "for --print decode: the function of the tokens that "
                      "returns logits (default: the only one)", flag_values=fv)
  flags.DEFINE_string("device", None, "cpu or cuda, for --print hlo|plan (SEXPGPU_DEVICE)",
                      flag_values=fv)
  flags.DEFINE_integer("steps", None, "replaces defrun :steps", flag_values=fv)
  flags.DEFINE_integer("eval_every", None, "replaces every pass's :every", flag_values=fv)
  flags.DEFINE_string("target", None, "cuda: lower the run's steps for that platform here and "
                      "report what a run there would use", flag_values=fv)
  flags.DEFINE_string("gpu", None, "with --target cuda: a roofline estimate for A100, H100, "
                      "H200, L4, L40S or B200", flag_values=fv)
  flags.DEFINE_integer("devices", None, "with --target cuda: plan a run on this many GPUs "
                       "on paper (the layout, memory, collectives, MFU)", flag_values=fv)
  flags.DEFINE_integer("nodes", None, "with --devices: the nodes they span (default 1)",
                       flag_values=fv)
  return fv


def parse_flags(fv: flags.FlagValues, argv: list[str], command: str) -> list[str]:
  """Parses a command's flags; `-h`/`--help` prints the command's help instead.

  Raises:
    cli_help.Help: the help was asked for (the CLI prints it and exits 0).
    SxError: E-FORM-001 for a flag that does not parse.
  """
  # absl spells multi-word flags with underscores; accept the documented dashes too.
  norm = []
  for a in argv:
    if a == "--":
      break
    if a.startswith("--") and "-" in a[2:].split("=")[0]:
      name, eq, val = a[2:].partition("=")
      a = "--" + name.replace("-", "_") + eq + val
    norm.append(a)
  _check_values(fv, norm, command)
  norm += argv[len(norm):]
  try:
    return fv([f"sexpgpu {command}"] + norm)[1:]
  except flags.Error as e:
    raise SxError("E-FORM-001", f"sexpgpu {command}: {e}", where="the command line",
                  fix=f"sexpgpu {command} --help lists the flags") from None


HELP_FLAGS = ("-h", "--help", "-help", "--helpfull")
ABSL_ONLY = ("flagfile", "undefok")
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_DECIMAL_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _looks_like_flag(text: str) -> bool:
  return text.startswith("-") and len(text) > 1 and not _DECIMAL_FLOAT.fullmatch(text)


def _check_values(fv: flags.FlagValues, argv: list[str], command: str) -> None:
  """Walks the flags as absl will read them, before it does.

  A help flag counts only where a flag stands (`--steps -h` is not a request for help); a
  flag's value that is itself a flag is refused naming the flag; integers are decimal
  (absl would read `0x10` as 16 and `1_0` as 10) and fit in 64 bits; numbers are finite.

  Raises:
    cli_help.Help: `-h`/`--help` where a flag stands.
    SxError: E-FORM-001 naming the flag and the value.
  """
  i = 0
  while i < len(argv):
    token = argv[i]
    i += 1
    if token in HELP_FLAGS:
      raise cli_help.Help(cli_help.command_help(command, fv, _commands().get(command)))
    if not _looks_like_flag(token):
      continue
    name, eq, value = token.lstrip("-").partition("=")
    if name in ABSL_ONLY:  # absl's own: it would read any file's lines as flags and arguments
      raise SxError("E-FORM-001", f"sexpgpu {command} has no flag --{name}",
                    where="--" + name, fix=f"sexpgpu {command} --help lists the flags")
    if name not in fv or fv[name].boolean:
      continue  # absl reports an unknown flag; a boolean takes no separate value
    shown = "--" + name.replace("_", "-")
    if not eq:
      if i >= len(argv):
        continue  # absl says the value is missing
      value = argv[i]
      i += 1
      if value in HELP_FLAGS or _looks_like_flag(value):
        raise SxError("E-FORM-001", f"sexpgpu {command}: {shown} needs a value; found the "
                      f"flag `{value}`", where=shown,
                      fix=f"give {shown} its value, or write {shown}={value} if that is the "
                      "value")
    parser = fv[name].parser
    what, example, within = None, "100", ""
    if isinstance(parser, flags.IntegerParser):
      lo, hi = (-2**63 if parser.lower_bound is None else parser.lower_bound,
                2**63 - 1 if parser.upper_bound is None else parser.upper_bound)
      if not _DECIMAL.fullmatch(value) or not lo <= int(value[:25]) <= hi:
        lo, hi = _KNOB_RANGES.get(name, (lo, hi)) if parser.lower_bound is None else (lo, hi)
        what = f"a decimal integer (digits 0-9) from {lo} to {hi}"
        example, within = _int_example(value, fv[name].default, lo, hi), f" (from {lo} to {hi})"
    elif isinstance(parser, flags.FloatParser):
      if not _DECIMAL_FLOAT.fullmatch(value) or not math.isfinite(float(value)):
        what = "a finite decimal number"
    if what is not None:
      shown_value = value if len(value) <= 40 else value[:40] + f"... ({len(value)} characters)"
      raise SxError("E-FORM-001", f"sexpgpu {command}: {shown} is `{shown_value}`; it must be "
                    + what, where=shown, fix=f"write {shown} {example}{within}")


# The integer flags that replace a knob or plan devices, and the range the run takes (a
# 64-bit value outside it is refused by the knob's check, E-KNOB-003, or the plan's).
_KNOB_RANGES = {"steps": (0, 2**31 - 1), "eval_every": (0, 2**31 - 1),
                "devices": (1, 2**31 - 1), "nodes": (1, 2**31 - 1)}


def _int_example(value: str, default, lo: int, hi: int) -> str:
  """A value an integer flag takes, never the refused one: what `0x10`, `0o20` or `1_0` would
  have been read as, else the flag's default, else 100, whichever lies in lo..hi first."""
  try:
    read = int(value[:25], 0) if len(value) <= 25 else None
  except ValueError:
    read = None
  for cand in (read, default, 100, lo):
    if isinstance(cand, int) and lo <= cand <= hi:
      return str(cand)
  return str(lo)


def parse_sets(values: list[str]) -> list[tuple[str, str]]:
  """`--set k=v` values as (knob, text) pairs, in the order given."""
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
  """compile and train an experiment in this process"""
  fv = _run_flags()
  rest = parse_flags(fv, argv, "run")
  given = _one_file(rest, "run")
  _STARTUP["status"] = fv.status if fv.status is not None else env.get("SEXPGPU_STATUS")
  from sexpgpu.run.flags import init_from_sets, run_options
  from sexpgpu.run.compile import compile_file
  from sexpgpu.run.loop import run_compiled
  path, variant, sets = given, fv.variant, init_from_sets(fv.init_from, parse_sets(fv.set))
  if given.endswith(".sxb"):  # a --set given here wins over the bundle's
    from sexpgpu.tools.bundle import bundle_selection
    path, variant, sets = bundle_selection(given, variant, sets)
  opts = run_options(given, fv)
  _STARTUP["status"] = opts.status
  overrides = {"steps": fv.steps, "eval-every": fv.eval_every}
  from sexpgpu.tools.bundle import bundle_hints
  with bundle_hints(given), python_trust(fv.trust_python, given.endswith(".sxb"),
                                      f"sexpgpu run {given}"):
    compiled = guarded(path, variant, sets, overrides, fv.diagnostics,
                       lambda: compile_file(path, variant, sets, overrides, fv.diagnostics))
  _signals.FLAG.check()  # a signal that a library swallowed while start-up ran
  summary = run_compiled(compiled, opts)
  _signals.FLAG.raising = False  # the run has ended: a late signal does not undo it
  if fv.json:
    import json
    from sexpgpu.paths import scrubbed
    lost = _write_summary(json.dumps(scrubbed(summary.as_dict()), separators=(",", ":")) + "\n")
    if lost is not None:  # the run's result must not vanish with an exit status of 0
      output.write(sys.stderr, SxError(
          "E-METRICS-001", f"the --json summary was lost: {lost}", where="standard output",
          fix="send standard output to a file or to a reader that reads all of it; the "
          "summary is also the last event of the --metrics target").render() + "\n")
      return summary.exit_code or 1
  return summary.exit_code


# How long the summary waits at most for a pipe's reader to take it (a reader that has not
# read it by then may still: only one that leaves with bytes of it unread lost it).
READER_SECONDS = 5.0


def _write_summary(text: str) -> str | None:
  """Writes the --json summary to standard output; returns how it was lost, or None.

  Lost: standard output is closed, refuses the bytes (a full device, a pipe with no reader),
  or is a pipe whose reader leaves with part of the line unread (`| head -c 1`).
  """
  stream = sys.stdout
  if stream is None:  # closed when the process started
    return "standard output is closed"
  try:
    fd = stream.fileno()
  except (AttributeError, ValueError, OSError):  # not a file (a test's capture)
    return None if output.write(stream, text) else "standard output cannot be written"
  data = text.encode("utf-8")
  try:
    stream.flush()
    while data:  # straight to the descriptor: nothing stays buffered for the exit to fail on
      data = data[os.write(fd, data):]
  except OSError as e:
    return f"standard output refused it ({e.strerror or e})"
  return _unread_by_reader(fd, len(text.encode("utf-8")))


def _unread_by_reader(fd: int, size: int) -> str | None:
  """For a pipe: waits until its reader has taken every byte written, and says how many
  it left unread when it closed its end first (None: all read, or still reading)."""
  import fcntl
  import select
  import stat
  import struct
  import termios
  import time
  try:
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
      return None
  except OSError:
    return None

  def unread() -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]

  poll = select.poll()
  poll.register(fd, 0)  # POLLERR (no reader left) is reported whatever is asked
  deadline = time.monotonic() + READER_SECONDS
  try:
    while unread() > 0 and time.monotonic() < deadline:
      if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(10)):
        left = unread()
        return (f"its reader closed the pipe with {left} of its {size} bytes unread"
                if left > 0 else None)
  except OSError:
    return None
  return None


def cmd_check(argv: list[str]) -> int:
  """compile without training; print knobs, parameters, loaders, IR or the plan"""
  fv = _check_flags()
  rest = parse_flags(fv, argv, "check")
  path = _one_file(rest, "check")
  from sexpgpu.run.check import CheckOptions, check
  from sexpgpu.run.flags import check_variables
  device = env.parse_device(fv.device, "--device") if fv.device else env.parse_device(
      env.get("SEXPGPU_DEVICE"))
  check_variables(device, ("SEXPGPU_DEVICE",) if fv.device else ())  # the parsers run uses
  overrides = {"steps": fv.steps, "eval-every": fv.eval_every}
  variant, sets, given = fv.variant, parse_sets(fv.set), path
  from sexpgpu.tools.bundle import bundle_hints, bundle_selection
  if given.endswith(".sxb"):  # checked as `run` would run it: its experiment and selection
    path, variant, sets = bundle_selection(given, variant, sets)
  with bundle_hints(given), python_trust(fv.trust_python, True, "sexpgpu check"):
    text = guarded(path, variant, sets, overrides, fv.diagnostics,
                   lambda: check(path, variant, sets, fv.print, CheckOptions(
                       diagnostics=fv.diagnostics, overrides=overrides, device=device,
                       fn=fv.fn, loader=fv.loader, target=fv.target, gpu=fv.gpu,
                       devices=fv.devices, nodes=fv.nodes)))
  first, nl, after = text.partition("\n")
  if given != path and first.startswith("check: ") and " slug " in first:
    text = f"check: {given} slug {first.rsplit(' slug ', 1)[1]}{nl}{after}"  # as given, not
  output.write(sys.stdout, text)  # the bundle's extracted copy in the cache
  return 0


COMMANDS = {"run": cmd_run, "check": cmd_check}


def _commands() -> dict:
  """The built-in commands plus those of the tool modules (sweep, bundle, watch, plot, doctor)."""
  import importlib
  out = dict(COMMANDS)
  for mod in ("sexpgpu.cli.tools", "sexpgpu.cli.doctor", "sexpgpu.cli.text",
              "sexpgpu.cli.models"):
    try:
      m = importlib.import_module(mod)
    except ModuleNotFoundError as e:
      if e.name != mod:
        raise
      continue
    out.update(m.COMMANDS)
  return out


# What start-up knows so far, for a signal that stops it: the command, the status file to mark.
_STARTUP: dict = {"status": None, "command": None}


def main(argv: list[str] | None = None) -> int:
  """Entry point of the `sexpgpu` console script.

  Args:
    argv: the arguments after the program name (default: sys.argv[1:]); given, the
      process is not ended from here (tests call main in-process).

  Returns:
    The exit status: 0, 1 for an error, 128 + n after a stop signal.
  """
  console = argv is None
  argv = list(sys.argv[1:] if argv is None else argv)
  mine = _signals.FLAG.install(raising=False)  # in-process callers: installed here, restored below
  _STARTUP["status"] = _status_path(argv)
  _STARTUP["command"] = argv[0] if argv else None
  stopped = False
  if console:  # a stop during a long compile ends the process from the watchdog's thread
    _signals.watch(lambda signum: os._exit(_stopped(_signals.Stopped(signum))))
  try:
    _signals.arm()
    code = _main(argv)
  except _signals.Stopped as e:
    code, stopped = _stopped(e), True
  finally:
    _signals.FLAG.raising = False
    if mine and not console:
      _signals.FLAG.restore()
  if console and stopped:
    # Leave without running the exit handlers of libraries the signal may have
    # interrupted while they loaded; our own output is flushed first.
    output.write(sys.stdout, "")
    output.write(sys.stderr, "")
    os._exit(code)
  return code


def _main(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help", "-help", "help"):
    if len(argv) >= 2 and argv[0] == "help":
      return _main([argv[1], "--help"])
    output.write(sys.stdout if argv else sys.stderr, cli_help.program_help(_commands()))
    return 0 if argv else 1
  command = argv[0]
  commands = _commands()
  if command not in commands:
    sys.stderr.write(SxError("E-FORM-001", f"unknown command `{command}`", where="the command line",
                             fix="commands: " + ", ".join(commands)).render() + "\n")
    return 1
  if not env.debug():
    # Standard error carries our lines alone: a library's object that fails while being
    # collected (an S3 connection closed under it, say) is not the user's concern.
    sys.unraisablehook = lambda unraisable: None
  try:
    return commands[command](argv[1:])
  except cli_help.Help as h:
    output.write(sys.stdout, h.text)
    return 0
  except SxError as e:
    output.write(sys.stderr, e.render() + "\n")
    if env.debug():  # scrubbed: a cause's message may quote a URI with its credentials
      output.write(sys.stderr, traceback_text(e))
    return 1
  except KeyboardInterrupt:
    return 130


def _status_path(argv: list[str]) -> str | None:
  """The status file a run was given (--status or SEXPGPU_STATUS), read before any parsing."""
  if argv[:1] != ["run"]:
    return None
  for i, a in enumerate(argv):
    if a.startswith("--status="):
      return a.split("=", 1)[1]
    if a == "--status" and i + 1 < len(argv):
      return argv[i + 1]
  return env.get("SEXPGPU_STATUS")


def _stopped(e: _signals.Stopped) -> int:
  """A stop signal during start-up: a line says so, and the status file (when there is
  one) says `stopped`, by which signal."""
  import json
  name = _signals.SIGNALS.get(e.signum, str(e.signum))
  if _STARTUP.get("command") == "run":
    output.write(sys.stderr, _signals.startup_line(name) + "\n")
  else:
    output.write(sys.stderr, f"stopped: {name}\n")
  path = _STARTUP.get("status")
  if path:
    from sexpgpu.run.progress import stopped_at_start
    previous = None
    try:
      with open(path, encoding="utf-8") as f:
        previous = json.load(f)
    except (OSError, ValueError):
      pass
    try:
      from sexpgpu.paths import write_atomic
      write_atomic(path, json.dumps(stopped_at_start(previous, name)))
    except OSError:
      pass
  return e.exit_code


if __name__ == "__main__":
  sys.exit(main())

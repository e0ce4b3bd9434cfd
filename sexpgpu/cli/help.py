"""`--help` text, generated from each command's absl flags: flag, variable, one-line meaning."""

from __future__ import annotations

import re
from typing import Callable

from absl import flags

# Each flag that is an alias of an environment variable.
FLAG_VARIABLES = {
    "device": "SEXPGPU_DEVICE", "metrics": "SEXPGPU_METRICS", "status": "SEXPGPU_STATUS",
    "checkpoint_dir": "SEXPGPU_CHECKPOINT_DIR", "resume": "SEXPGPU_RESUME",
    "trust_python": "SEXPGPU_TRUST_PYTHON",
}
# The variables without a flag, listed under `run --help`.
OTHER_VARIABLES = [
    ("SEXPGPU_RUN_SLUG", "replaces the file's stem in the run slug"),
    ("SEXPGPU_DEVICES", "data-parallel CUDA ordinals, such as 0,1"),
    ("SEXPGPU_NODES", "the node count of a multi-node run"),
    ("SEXPGPU_NODE_RANK", "this node's index, 0 to nodes - 1"),
    ("SEXPGPU_RENDEZVOUS", "host:port of node 0"),
    ("SEXPGPU_NODE_GRADIENTS", "bf16 (default) or f32 gradients between nodes"),
    ("SEXPGPU_MEMORY", "plan against this much device memory (40GiB)"),
    ("SEXPGPU_STACKING", "auto (default) or a fixed stacking degree"),
    ("SEXPGPU_PATTERNS", "on (default) or off: the IR rewrites"),
    ("SEXPGPU_CACHE_DIR", "default ~/.cache/sexpgpu: choices, XLA cache (unless "
     "JAX_COMPILATION_CACHE_DIR), fetched data"),
    ("SEXPGPU_DETERMINISTIC", "1: bitwise-reproducible GPU runs (slower)"),
    ("SEXPGPU_CPU_COLLECTIVES", "gloo: a multi-node rehearsal on the cpu"),
    ("SEXPGPU_RENDEZVOUS_TIMEOUT", "seconds a node waits at the rendezvous (default 300)"),
    ("SEXPGPU_REMOTE_TIMEOUT", "seconds a failing remote write or fetch is retried (default 300)"),
    ("SEXPGPU_DEBUG", "1: add Python tracebacks to errors"),
]
# One line per command, and what it takes; a command not named here (one a tool module
# registers) is described by its function's docstring.
SUMMARIES = {
    "run": ("FILE.sx|FILE.sxb", "compile and train an experiment in this process"),
    "check": ("FILE.sx", "compile without training; print knobs, parameters, loaders, IR or plan"),
    "sweep": ("FILE.sx --set k=a,b ...", "run every point of a grid of knob values; print a table"),
    "bundle": ("FILE.sx -o RUN.sxb", "write one archive that runs the selection anywhere"),
    "watch": ("STATUS_FILE", "a live progress bar from a run's status file"),
    "plot": ("METRICS.jsonl ...", "curves from runs' jsonl metrics, as a PNG"),
    "doctor": ("", "check this machine's floor for a device, one line per check"),
    "tokenize": ("SOURCE... -o CACHE", "text files into a resumable token cache"),
    "export": ("FILE.sx --resume DIR -o OUT", "a checkpoint's parameters as safetensors or an "
               "HF model folder"),
    "import": ("HF_DIR -o CKPT_DIR FILE.sx", "a step-0 checkpoint of FILE.sx from an HF model"),
    "sample": ("FILE.sx --resume DIR --prompt TEXT", "generate tokens from a checkpoint"),
    "eval": ("FILE.sx --resume DIR [--tasks T.jsonl,...]", "a checkpoint's downstream scores "
             "(its defevals, or task files)"),
}


class Help(Exception):
  """`--help` was asked for; `text` is what to print on standard output (exit 0)."""

  def __init__(self, text: str):
    super().__init__("help")
    self.text = text


def summary(name: str, fn: Callable | None) -> tuple[str, str]:
  """(what the command takes, its one-line meaning)."""
  if name in SUMMARIES:
    return SUMMARIES[name]
  doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
  first = doc[0] if doc else ""
  m = re.match(rf"`sexpgpu {re.escape(name)}\s*([^`]*)`[:.]?\s*(.*)", first)
  if not m:
    return "", first
  # A docstring that is only a usage line: the usage is the meaning too.
  return m.group(1), m.group(2).rstrip(".") or f"sexpgpu {name} {m.group(1)}".strip()


def program_help(commands: dict[str, Callable]) -> str:
  """`sexpgpu --help`: every command with its one-line meaning."""
  width = max(len(n) for n in commands) + 2
  lines = ["usage: sexpgpu COMMAND [FLAGS] [FILE]", "", "commands:"]
  lines += [f"  {n:<{width}}{summary(n, fn)[1]}" for n, fn in commands.items()]
  lines += ["", "sexpgpu COMMAND --help lists a command's flags and their variables.",
            "Flags win over variables; errors print a code, the place and a fix."]
  return "\n".join(lines) + "\n"


def flag_rows(fv: flags.FlagValues) -> list[tuple[str, str, str]]:
  """(flag as typed, variable or "", one-line meaning) for each flag of `fv`, in order."""
  rows = []
  for name in fv:  # absl iterates in the definition order
    fl = fv[name]
    if name != fl.name:  # a short name (-o) points at the same flag
      continue
    spelled = "--" + name.replace("_", "-")
    if fl.short_name:
      spelled = f"-{fl.short_name}, {spelled}"
    if not isinstance(fl, flags.BooleanFlag):
      spelled += " " + _metavar(fl)
    meaning = (fl.help or "").replace(f"({FLAG_VARIABLES.get(name, '-')})", "").strip()
    if fl.default not in (None, [], False, ""):
      meaning += f" (default {fl.default_as_str.strip(chr(39))})"
    rows.append((spelled, FLAG_VARIABLES.get(name, ""), " ".join(meaning.split())))
  return rows


def _metavar(fl) -> str:
  if isinstance(fl, flags.EnumFlag) or getattr(fl.parser, "enum_values", None):
    return "|".join(fl.parser.enum_values)
  kind = type(fl.parser).__name__
  return {"IntegerParser": "N", "FloatParser": "X"}.get(kind, "VALUE")


def command_help(name: str, fv: flags.FlagValues, fn: Callable | None = None) -> str:
  """`sexpgpu NAME --help`: usage, meaning, each flag with its variable and meaning."""
  takes, meaning = summary(name, fn)
  lines = [f"usage: sexpgpu {name} {takes} [FLAGS]".replace("  ", " "), f"  {meaning}", ""]
  rows = flag_rows(fv) + [("-h, --help", "", "this text")]
  w1 = max(len(r[0]) for r in rows) + 2
  w2 = max([len(r[1]) for r in rows] + [len("variable")]) + 2
  lines.append(f"  {'flag':<{w1}}{'variable':<{w2}}meaning")
  lines += [f"  {f:<{w1}}{v or '-':<{w2}}{m}" for f, v, m in rows]
  if name == "run":
    w = max(len(v) for v, _ in OTHER_VARIABLES) + 2
    lines += ["", "variables without a flag:"]
    lines += [f"  {v:<{w}}{m}" for v, m in OTHER_VARIABLES]
  if any(r[1] for r in rows):
    lines += ["", "Flags win over their variables."]
  return "\n".join(lines) + "\n"

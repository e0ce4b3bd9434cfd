"""Every SEXPGPU_* variable, read and parsed here: the one reader of the environment.

Each variable is read with `get` (unset and blank are the same) and parsed by one
function here; integers are decimal and bounded (`count`), seconds are positive and
finite (`seconds`). A value that does not parse is an `SxError` naming the variable:
E-DP-001 for SEXPGPU_DEVICES, E-DP-005 for the node variables, E-DEV-001 for a device that is neither cpu nor cuda, E-METRICS-001 for a metrics
target, E-ENV-001 for the others. `run`, `check` and `doctor` say the same for one value.

Nothing here imports JAX: `jax.distributed.initialize` and the host-device count are set
from these values before anything starts a backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import Any, Callable, Iterator, Mapping

from sexpgpu.errors import SxError, did_you_mean
from sexpgpu.paths import check_cache_value, scrub
from sexpgpu.reader.read import parse_int, shown

DEFAULT_RENDEZVOUS_TIMEOUT = 300.0
DEFAULT_REMOTE_TIMEOUT = 300.0
# The largest count or ordinal a variable may give: what an int32 holds.
COUNT_LIMIT = 2**31

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
_FORCED = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
  """The text of variable `name` in `environ` (os.environ when None); None when unset or blank."""
  value = (os.environ if environ is None else environ).get(name)
  return None if value is None or value.strip() == "" else value


def count(text: str | None, limit: int = COUNT_LIMIT) -> int | None:
  """A non-negative integer written in plain ASCII digits, below `limit`, or None."""
  if text is None or not (text.isascii() and text.isdigit()):
    return None
  return parse_int(text, limit)


def debug(environ: Mapping[str, str] | None = None) -> bool:
  """SEXPGPU_DEBUG=1: errors carry their Python traceback.

  Read while an error is being reported, so it never raises; a value other than 0 or 1 is
  refused by `check_variables` before anything runs.
  """
  return (get("SEXPGPU_DEBUG", environ) or "").strip() == "1"


def trust_python(environ: Mapping[str, str] | None = None) -> bool:
  """SEXPGPU_TRUST_PYTHON=1: run the `.py` files an experiment requires wherever they lie
  (as --trust-python does; the flag, given, wins).

  Raises:
    SxError: E-ENV-001 for a value other than 0 or 1.
  """
  return parse_switch("SEXPGPU_TRUST_PYTHON", get("SEXPGPU_TRUST_PYTHON", environ))


@contextlib.contextmanager
def exported(name: str, value: str | None) -> Iterator[None]:
  """Sets variable `name` to `value` for the processes started in the block (a sweep's
  points take its --trust-python as SEXPGPU_TRUST_PYTHON); None leaves it as it is. What
  was there before is put back."""
  old = os.environ.get(name)
  if value is not None:
    os.environ[name] = value
  try:
    yield
  finally:
    if old is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = old


def _val(env: Mapping[str, str], name: str) -> str | None:
  v = get(name, env)
  return None if v is None else v.strip()


def _dp001(message: str) -> SxError:
  return SxError("E-DP-001", message, where="SEXPGPU_DEVICES")  # the catalogue's fix


def _dp005(message: str, where: str) -> SxError:
  return SxError("E-DP-005", message, where=where)  # the catalogue's fix


@dataclasses.dataclass(frozen=True)
class NodeConfig:
  """One node's view of a multi-node run.

  Attributes:
    nodes: the node count (at least 2).
    rank: this process's node, 0 to nodes - 1.
    host: node 0's host, where the coordinator listens.
    port: the coordinator's port.
    gradients: "bf16" (default) or "f32", the dtype of the sum between nodes.
    collectives: "nccl" on cuda, "gloo" for the cpu rehearsal.
  """

  nodes: int
  rank: int
  host: str
  port: int
  gradients: str = "bf16"
  collectives: str = "nccl"

  @property
  def rendezvous(self) -> str:
    """`host:port`, as jax.distributed's coordinator_address."""
    return f"{self.host}:{self.port}"


def parse_device_list(value: str | None) -> list[int] | None:
  """SEXPGPU_DEVICES as ordinals in rank order, or None when unset or blank.

  Raises:
    SxError: E-DP-001 when the value does not parse or repeats an ordinal.
  """
  if value is None or value.strip() == "":
    return None
  out: list[int] = []
  for part in value.split(","):
    p = part.strip()
    n = count(p)
    if n is None:
      raise _dp001(f"SEXPGPU_DEVICES={shown(value)} does not parse: `{shown(p)}` is not a "
                   f"device ordinal (a decimal from 0 to {COUNT_LIMIT - 1})")
    if n in out:
      raise _dp001(f"SEXPGPU_DEVICES={shown(value)} repeats ordinal {n}")
    out.append(n)
  return out


def check_visible(ordinals: list[int], visible: int, kind: str = "cuda") -> list[int]:
  """The ordinals, when each is below `visible` (how many `kind` devices there are).

  Raises:
    SxError: E-DP-001 naming the first ordinal that is not visible.
  """
  for n in ordinals:
    if n >= visible:
      err = _dp001(f"SEXPGPU_DEVICES names ordinal {n}, which is not visible ({visible} "
                   f"{kind} device{'s' if visible != 1 else ''} visible: 0..{visible - 1})")
      if kind == "cpu":
        err.with_note("cpu", "a run makes one XLA host device per ordinal, up to the CPU count "
                      "(or XLA_FLAGS' --xla_force_host_platform_device_count)")
      raise err
  return ordinals


def cpu_visible(env: Mapping[str, str] | None = None) -> int:
  """The XLA host devices a CPU run may make: XLA_FLAGS' forced count, else the CPU count."""
  env = os.environ if env is None else env
  forced = _FORCED.search(env.get("XLA_FLAGS", ""))
  n = count(forced.group(1)) if forced else None
  return n if n is not None else (os.cpu_count() or 1)


def parse_devices(value: str | None, visible: int, kind: str = "cuda") -> list[int]:
  """The data-parallel ordinals of SEXPGPU_DEVICES, in rank order.

  Args:
    value: the variable's text; None or blank uses every visible device.
    visible: how many devices are visible (after CUDA_VISIBLE_DEVICES).
    kind: "cuda" or "cpu", for the message.

  Returns:
    The ordinals, each once, each below `visible`.

  Raises:
    SxError: E-DP-001 when no device is visible, or the value does not parse,
      repeats an ordinal, or names one that is not visible.
  """
  if visible < 1:
    raise _dp001("no GPU is visible" + (f" for SEXPGPU_DEVICES={value}" if value else "")
                 ).with_note("visible", "0 devices (check CUDA_VISIBLE_DEVICES and the driver)")
  ordinals = parse_device_list(value)
  return list(range(visible)) if ordinals is None else check_visible(ordinals, visible, kind)


def parse_nodes(env: Mapping[str, str], device: str) -> NodeConfig | None:
  """This node's NodeConfig from the node variables, or None for a one-node run.

  Args:
    env: the environment (os.environ or a dict).
    device: the run's device, "cpu" or "cuda".

  Returns:
    None when SEXPGPU_NODES is unset or 1 (SEXPGPU_NODE_RANK, if set, must be 0
    then); else the parsed NodeConfig.

  Raises:
    SxError: E-DP-005 when SEXPGPU_NODES is not a count, SEXPGPU_NODE_RANK is not
      in 0..nodes-1, SEXPGPU_RENDEZVOUS is not host:port, SEXPGPU_NODE_GRADIENTS
      is not f32 or bf16, or the device is not cuda (cpu is allowed with
      SEXPGPU_CPU_COLLECTIVES=gloo).
  """
  grads = _val(env, "SEXPGPU_NODE_GRADIENTS") or "bf16"
  if grads not in ("bf16", "f32"):
    raise _dp005(f"SEXPGPU_NODE_GRADIENTS={grads} is not f32 or bf16", "SEXPGPU_NODE_GRADIENTS")
  raw = _val(env, "SEXPGPU_NODES")
  if raw is not None and (count(raw) or 0) < 1:
    raise _dp005(f"SEXPGPU_NODES={shown(raw)} is not a count of nodes (1 to "
                 f"{COUNT_LIMIT - 1})", "SEXPGPU_NODES")
  nodes = 1 if raw is None else count(raw)
  rank_s = _val(env, "SEXPGPU_NODE_RANK")
  rank = count(rank_s)
  if (rank_s is None and nodes > 1) or (rank_s is not None and (rank is None or rank >= nodes)):
    raise _dp005(f"SEXPGPU_NODE_RANK={shown(rank_s or '(unset)')} is not in 0..{nodes - 1} "
                 f"(SEXPGPU_NODES={raw or '(unset)'})", "SEXPGPU_NODE_RANK")
  if nodes == 1:
    return None
  rdv = _val(env, "SEXPGPU_RENDEZVOUS")
  m = _HOSTPORT.match(rdv or "")
  if m is None or not 0 < (count(m.group(2)) or 0) < 65536:
    raise _dp005(f"SEXPGPU_RENDEZVOUS={shown(rdv or '(unset)')} is not host:port",
                 "SEXPGPU_RENDEZVOUS")
  collectives = "nccl"
  if device != "cuda":
    cc = _val(env, "SEXPGPU_CPU_COLLECTIVES")
    if device != "cpu" or cc != "gloo":
      raise _dp005(f"a run over {nodes} nodes needs the cuda device; this one is {device}",
                   "SEXPGPU_DEVICE").with_note(
                       "rehearsal", "on cpu, SEXPGPU_CPU_COLLECTIVES=gloo rehearses it over "
                       "loopback")
    collectives = "gloo"
  return NodeConfig(nodes, rank, m.group(1).strip("[]"), int(m.group(2)), grads, collectives)


def parse_memory(value: str) -> int:
  """Bytes of SEXPGPU_MEMORY: `40GiB`, `64MiB`, `1.5GB`, `512KiB` or plain bytes.

  Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024),
  case-insensitive.

  Raises:
    SxError: E-ENV-001 when the value does not parse or is not positive.
  """
  m = _MEMORY.match(value or "")
  unit = m.group(2).lower() if m else None
  size = float(m.group(1)) * _UNITS[unit] if m and unit in _UNITS else 0.0
  if not 1 <= size < 2**63:  # a literal past float's range reads as inf, refused here
    raise SxError("E-ENV-001", f"SEXPGPU_MEMORY={shown(value or '')} is not an amount of memory "
                  "(1 byte to 8 EiB)",
                  where="SEXPGPU_MEMORY", fix="SEXPGPU_MEMORY=40GiB (B, KiB, MiB, GiB, TiB, "
                  "or KB, MB, GB, TB)")
  return int(size)


def seconds(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
  """The positive, finite number of seconds variable `name` gives; `default` when unset.

  Raises:
    SxError: E-ENV-001 naming the variable when it is not a positive number of seconds.
  """
  raw = _val(os.environ if environ is None else environ, name)
  if raw is None:
    return default
  try:
    secs = float(raw)
  except ValueError:
    secs = -1.0
  if not (math.isfinite(secs) and secs > 0):
    raise SxError("E-ENV-001", f"{name}={shown(raw)} is not a positive number of seconds",
                  where=name, fix=f"{name}={default:g}")
  return secs


def rendezvous_timeout(env: Mapping[str, str] | None = None) -> float:
  """Seconds a node waits at the rendezvous: SEXPGPU_RENDEZVOUS_TIMEOUT, default 300."""
  return seconds("SEXPGPU_RENDEZVOUS_TIMEOUT", DEFAULT_RENDEZVOUS_TIMEOUT, env)


def remote_timeout(env: Mapping[str, str] | None = None) -> float:
  """Seconds a remote operation of a run (a checkpoint upload, its marker, a loader's
  fetch) is retried after its first failure: SEXPGPU_REMOTE_TIMEOUT, default 300."""
  return seconds("SEXPGPU_REMOTE_TIMEOUT", DEFAULT_REMOTE_TIMEOUT, env)


def parse_stacking(value: str | None) -> int | None:
  """SEXPGPU_STACKING: `auto` or unset (None) or a fixed degree.

  Raises:
    SxError: E-ENV-001 when it is neither `auto` nor a positive integer.
  """
  if value is None or value.strip() in ("", "auto"):
    return None
  degree = count(value.strip())
  if degree is None or degree < 1:
    raise SxError("E-ENV-001", f"SEXPGPU_STACKING={shown(value)} is not `auto` or a positive "
                  f"integer below {COUNT_LIMIT}", where="SEXPGPU_STACKING",
                  fix="SEXPGPU_STACKING=auto or SEXPGPU_STACKING=2")
  return degree


def parse_switch(name: str, value: str | None) -> bool:
  """A 0/1 variable (SEXPGPU_DETERMINISTIC, SEXPGPU_DEBUG): True for 1; unset or 0 is False.

  Raises:
    SxError: E-ENV-001 for anything else (`yes`, `true`, ...), so no value is silently ignored.
  """
  v = "" if value is None else value.strip()
  if v not in ("", "0", "1"):
    raise SxError("E-ENV-001", f"{name}={value} is not 0 or 1", where=name, fix=f"{name}=1")
  return v == "1"


def parse_choice(name: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
  """A variable with a few allowed words (SEXPGPU_PATTERNS, SEXPGPU_CPU_COLLECTIVES).

  Raises:
    SxError: E-ENV-001 for a word not allowed.
  """
  if value is None or value == "":
    return None
  if value not in allowed:
    raise SxError("E-ENV-001", f"{name}={value} is not " + " or ".join(allowed), where=name,
                  fix=f"{name}={allowed[-1]}")
  return value


def parse_device(value: str | None, where: str = "SEXPGPU_DEVICE") -> str:
  """The device of SEXPGPU_DEVICE or --device (`where`): cpu (the default) or cuda.

  Raises:
    SxError: E-DEV-001 (a device that is neither cpu nor cuda) naming `where`.
  """
  device = value or "cpu"
  if device not in ("cpu", "cuda"):
    raise SxError("E-DEV-001", f"device `{shown(device)}` is not cpu or cuda", where=where,
                  fix="cpu or cuda")
  return device


METRICS_SCHEMES = ("jsonl", "tensorboard", "mlflow", "wandb")
# The schemes whose location is a local path (a URI there would make a folder `s3:`).
LOCAL_SCHEMES = ("jsonl", "tensorboard")
METRICS_FORMS = ("jsonl:PATH, tensorboard:DIR, mlflow:URI or wandb:PROJECT[/RUN], several "
                 "joined by commas")


def parse_metrics(spec: str | None, where: str = "SEXPGPU_METRICS") -> list[tuple[str, str, str]]:
  """The targets of SEXPGPU_METRICS or --metrics (`where`): (piece, scheme, location) each.

  Raises:
    SxError: E-METRICS-001 for an empty piece, a missing or unknown scheme, an empty
      location, a remote location for a local scheme, or the same target twice.
  """
  if spec is None or not spec.strip():
    return []
  triples = [_metrics_piece(piece, spec, where) for piece in (p.strip() for p in spec.split(","))]
  seen = set()
  for piece, _, _ in triples:
    if piece in seen:
      raise _metrics_error(f"metrics target `{scrub(piece)}` given twice", where,
                           "name each target once")
    seen.add(piece)
  return triples


def _metrics_piece(piece: str, spec: str, where: str) -> tuple[str, str, str]:
  if not piece:
    raise _metrics_error(f"empty metrics target in `{scrub(spec)}`", where,
                         f"write {METRICS_FORMS}, with no empty entry between commas")
  scheme, colon, location = piece.partition(":")
  if not colon:
    raise _metrics_error(f"metrics target `{scrub(piece)}` has no scheme", where,
                         f"write {METRICS_FORMS}, e.g. jsonl:{piece}")
  if scheme not in METRICS_SCHEMES:
    hint = did_you_mean(scheme, METRICS_SCHEMES)
    raise _metrics_error(f"unknown metrics scheme `{scrub(scheme)}` in `{scrub(piece)}`", where,
                         (hint + " " if hint else "") + f"targets are {METRICS_FORMS}")
  if not location.strip():
    raise _metrics_error(f"metrics target `{scrub(piece)}` has no location", where,
                         f"write {METRICS_FORMS}")
  if scheme in LOCAL_SCHEMES and "://" in location:
    raise _metrics_error(f"metrics target `{scrub(piece)}`: {scheme} writes a local "
                         f"{'file' if scheme == 'jsonl' else 'folder'}, and "
                         f"{scrub(location)} is a remote location", where,
                         f"write {scheme}:PATH on a local disk (and copy it to the store when "
                         "the run ends), or log to mlflow:URI")
  return piece, scheme, location


def _metrics_error(message: str, where: str, fix: str) -> SxError:
  return SxError("E-METRICS-001", message, where=where, fix=fix)


def parse_step_range(value: str | None, where: str = "SEXPGPU_PROFILE") -> tuple[int, int] | None:
  """`A..B` (or `A`): the steps, 1-based and inclusive, that --profile records.

  Raises:
    SxError: E-ENV-001 naming `where` (the flag or the variable) when it does not parse.
  """
  if value is None or value == "":
    return None
  a, dots, b = value.strip().partition("..")
  lo = parse_int(a.strip(), COUNT_LIMIT)
  hi = parse_int(b.strip(), COUNT_LIMIT) if dots else lo
  if lo is None or hi is None:
    lo = hi = -1
  if lo < 1 or hi < lo:
    raise SxError("E-ENV-001", f"{where} {shown(value)!r} is not a step range A..B with "
                  f"1 ≤ A ≤ B ≤ {COUNT_LIMIT - 1}",
                  where=where, fix=f"{where}{'=' if where.startswith('SEXPGPU_') else ' '}"
                  "5..10 records steps 5 to 10")
  return lo, hi


# Each variable that parses on its own: name → parser of its text (None when unset). JAX's
# JAX_COMPILATION_CACHE_DIR is among them: a run honours it (the XLA cache's folder).
# SEXPGPU_DEVICES and the node variables need the device; `check_variables` adds them.
VARIABLES: dict[str, Callable[[str | None], Any]] = {
    "SEXPGPU_DEVICE": parse_device,
    "SEXPGPU_STACKING": parse_stacking,
    "SEXPGPU_DETERMINISTIC": lambda v: parse_switch("SEXPGPU_DETERMINISTIC", v),
    "SEXPGPU_DEBUG": lambda v: parse_switch("SEXPGPU_DEBUG", v),
    "SEXPGPU_TRUST_PYTHON": lambda v: parse_switch("SEXPGPU_TRUST_PYTHON", v),
    "SEXPGPU_PATTERNS": lambda v: parse_choice("SEXPGPU_PATTERNS", v, ("on", "off")),
    "SEXPGPU_CPU_COLLECTIVES": lambda v: parse_choice("SEXPGPU_CPU_COLLECTIVES", v, ("gloo",)),
    "SEXPGPU_MEMORY": lambda v: None if not v else parse_memory(v),
    "SEXPGPU_RENDEZVOUS_TIMEOUT": lambda v: rendezvous_timeout(
        {} if v is None else {"SEXPGPU_RENDEZVOUS_TIMEOUT": v}),
    "SEXPGPU_REMOTE_TIMEOUT": lambda v: remote_timeout(
        {} if v is None else {"SEXPGPU_REMOTE_TIMEOUT": v}),
    "SEXPGPU_METRICS": parse_metrics,
    "SEXPGPU_PROFILE": parse_step_range,
    "SEXPGPU_CACHE_DIR": check_cache_value,
    "JAX_COMPILATION_CACHE_DIR": lambda v: check_cache_value(v, "JAX_COMPILATION_CACHE_DIR"),
    "SEXPGPU_DECODE": lambda v: parse_choice("SEXPGPU_DECODE", v, ("recompute",)),
}


def variable_errors(env: Mapping[str, str] | None = None,
                    device: str | None = None) -> list[tuple[str, SxError]]:
  """(variable, its error) for each variable of `env` (`VARIABLES`) that does not parse.

  With `device`, SEXPGPU_DEVICES's syntax and the node variables are checked too.
  """
  env = os.environ if env is None else env
  out = []
  for name, parse in VARIABLES.items():
    try:
      parse(env.get(name))
    except SxError as e:
      out.append((name, e))
  if device is not None:
    for name, check in (("SEXPGPU_DEVICES", lambda: parse_device_list(env.get("SEXPGPU_DEVICES"))),
                        ("nodes", lambda: parse_nodes(env, device))):
      try:
        check()
      except SxError as e:
        out.append((name, e))
  return out


def check_variables(env: Mapping[str, str] | None = None, device: str | None = None) -> None:
  """Raises the first variable's error (see `variable_errors`), before anything runs."""
  errors = variable_errors(env, device)
  if errors:
    raise errors[0][1]

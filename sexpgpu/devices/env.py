"""The device variables (SEXPGPU_DEVICES, the node variables, SEXPGPU_MEMORY, ...), parsed.

Every parser here runs before anything starts a JAX backend and never imports
JAX: `jax.distributed.initialize` and the host-device count must be set first.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from sexpgpu.errors import SxError

FIX_DEVICES = "list visible ordinals once each, SEXPGPU_DEVICES=0,1"
FIX_NODES = "set all three on every node, with SEXPGPU_DEVICE=cuda"
FIX_DIVIDES = "pick a device count that divides :microbatches"
NODE_VARS = ("SEXPGPU_NODES", "SEXPGPU_NODE_RANK", "SEXPGPU_RENDEZVOUS", "SEXPGPU_NODE_GRADIENTS")
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


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


def _val(env: Mapping[str, str], name: str) -> str | None:
  v = env.get(name)
  return None if v is None or v.strip() == "" else v.strip()


def _dp001(message: str) -> SxError:
  return SxError("E-DP-001", message, where="SEXPGPU_DEVICES", fix=FIX_DEVICES)


def _dp005(message: str, where: str) -> SxError:
  return SxError("E-DP-005", message, where=where, fix=FIX_NODES)


def parse_devices(value: str | None, visible: int) -> list[int]:
  """The data-parallel ordinals of SEXPGPU_DEVICES, in rank order.

  Args:
    value: the variable's text; None or blank uses every visible device.
    visible: how many devices are visible (after CUDA_VISIBLE_DEVICES).

  Returns:
    The ordinals, each once, each below `visible`.

  Raises:
    SxError: E-DP-001 when no device is visible, or the value does not parse,
      repeats an ordinal, or names one that is not visible.
  """
  if visible < 1:
    raise _dp001("no GPU is visible" + (f" for SEXPGPU_DEVICES={value}" if value else "")
                 ).with_note("visible", "0 devices (check CUDA_VISIBLE_DEVICES and the driver)")
  if value is None or value.strip() == "":
    return list(range(visible))
  out: list[int] = []
  for part in value.split(","):
    p = part.strip()
    if not p.isdigit():
      raise _dp001(f"SEXPGPU_DEVICES={value} does not parse: `{p}` is not a device ordinal")
    n = int(p)
    if n in out:
      raise _dp001(f"SEXPGPU_DEVICES={value} repeats ordinal {n}")
    if n >= visible:
      raise _dp001(f"SEXPGPU_DEVICES={value} names ordinal {n}, which is not visible "
                   f"({visible} visible: 0..{visible - 1})")
    out.append(n)
  return out


def parse_nodes(env: Mapping[str, str], device: str) -> NodeConfig | None:
  """This node's NodeConfig from the node variables, or None for a one-node run.

  Args:
    env: the environment (os.environ or a dict).
    device: the run's device, "cpu" or "cuda".

  Returns:
    None when SEXPGPU_NODES is unset or 1; else the parsed NodeConfig.

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
  if raw is None:
    return None
  if not raw.isdigit() or int(raw) < 1:
    raise _dp005(f"SEXPGPU_NODES={raw} is not a count of nodes", "SEXPGPU_NODES")
  nodes = int(raw)
  if nodes == 1:
    return None
  rank_s = _val(env, "SEXPGPU_NODE_RANK")
  if rank_s is None or not rank_s.isdigit() or int(rank_s) >= nodes:
    raise _dp005(f"SEXPGPU_NODE_RANK={rank_s or '(unset)'} is not in 0..{nodes - 1} "
                 f"(SEXPGPU_NODES={nodes})", "SEXPGPU_NODE_RANK")
  rdv = _val(env, "SEXPGPU_RENDEZVOUS")
  m = _HOSTPORT.match(rdv or "")
  if m is None or not 0 < int(m.group(2)) < 65536:
    raise _dp005(f"SEXPGPU_RENDEZVOUS={rdv or '(unset)'} is not host:port", "SEXPGPU_RENDEZVOUS")
  collectives = "nccl"
  if device != "cuda":
    cc = _val(env, "SEXPGPU_CPU_COLLECTIVES")
    if device != "cpu" or cc != "gloo":
      raise _dp005(f"a run over {nodes} nodes needs the cuda device; this one is {device}",
                   "SEXPGPU_DEVICE").with_note(
                       "rehearsal", "on cpu, SEXPGPU_CPU_COLLECTIVES=gloo rehearses it over "
                       "loopback")
    collectives = "gloo"
  return NodeConfig(nodes, int(rank_s), m.group(1).strip("[]"), int(m.group(2)), grads,
                    collectives)


def check_divides(microbatches: int, ranks: int) -> None:
  """Checks that the global microbatches split evenly over the ranks.

  Raises:
    SxError: E-DP-003 when `ranks` does not divide `microbatches`.
  """
  if ranks < 1 or microbatches % ranks:
    raise SxError("E-DP-003", f"the {microbatches} global microbatches do not divide over "
                  f"{ranks} GPUs", where="defrun :microbatches / SEXPGPU_DEVICES",
                  fix=FIX_DIVIDES)


def parse_memory(value: str) -> int:
  """Bytes of SEXPGPU_MEMORY: `40GiB`, `64MiB`, `1.5GB`, `512KiB` or plain bytes.

  Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024),
  case-insensitive.

  Raises:
    SxError: E-ENV-001 when the value does not parse or is not positive.
  """
  m = _MEMORY.match(value or "")
  unit = m.group(2).lower() if m else None
  if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
    raise SxError("E-ENV-001", f"SEXPGPU_MEMORY={value} is not an amount of memory",
                  where="SEXPGPU_MEMORY", fix="SEXPGPU_MEMORY=40GiB (B, KiB, MiB, GiB, TiB, "
                  "or KB, MB, GB, TB)")
  return int(float(m.group(1)) * _UNITS[unit])


def rendezvous_timeout(env: Mapping[str, str] | None = None) -> float:
  """Seconds a node waits at the rendezvous: SEXPGPU_RENDEZVOUS_TIMEOUT, default 300.

  Raises:
    SxError: E-ENV-001 when the variable is not a positive number of seconds.
  """
  env = os.environ if env is None else env
  raw = _val(env, "SEXPGPU_RENDEZVOUS_TIMEOUT")
  if raw is None:
    return DEFAULT_RENDEZVOUS_TIMEOUT
  try:
    secs = float(raw)
  except ValueError:
    secs = -1.0
  if not secs > 0 or secs != secs or secs == float("inf"):
    raise SxError("E-ENV-001", f"SEXPGPU_RENDEZVOUS_TIMEOUT={raw} is not a positive number of "
                  "seconds", where="SEXPGPU_RENDEZVOUS_TIMEOUT",
                  fix="SEXPGPU_RENDEZVOUS_TIMEOUT=300")
  return secs


def visible_gpus(env: Mapping[str, str] | None = None) -> int:
  """GPUs visible without starting a backend: nvidia-smi's count, limited by CUDA_VISIBLE_DEVICES.

  Returns 0 where there is no driver. Used to check SEXPGPU_DEVICES early; the
  device list JAX gives after start is the final word.
  """
  import shutil
  import subprocess
  env = os.environ if env is None else env
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
  cvd = env.get("CUDA_VISIBLE_DEVICES")
  if cvd is not None:
    listed = [p for p in cvd.split(",") if p.strip() and p.strip() != "-1"]
    n = min(n, len(listed)) if cvd.strip() else 0
  return n

"""Several nodes over jax.distributed: a watchdog, the rendezvous check, checkpoint hashes.

JAX's coordination service aborts the process (SIGABRT) when a peer never
arrives, with no Python exception to catch. So a watchdog thread of ours is
armed before `jax.distributed.initialize` (whose own timeouts are set longer)
and around every later wait; past SEXPGPU_RENDEZVOUS_TIMEOUT it writes the
status (a callback), prints E-DP-007 and leaves with exit 1 via os._exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from sexpgpu.devices.env import NodeConfig
from sexpgpu.errors import SxError

FIX_ARRIVE = "start every node; after a loss, restart every node with --resume latest"
FIX_SAME = "the same files, flags, device count and checkpoint location on every node"
FIX_HASH = ("a backend bug, never the experiment's fault: that checkpoint was not written, so "
            "--resume latest continues from the one before; report it with the step and "
            "SEXPGPU_DEVICES")
# JAX's own deadlines sit this far past ours, so the watchdog always fires first.
MARGIN_S = 60
# What every node publishes at the rendezvous, and how the error names it.
COMPARED = (("nodes", "node count"), ("gpus", "GPU count"), ("fingerprint", "experiment"),
            ("gradients", "gradient dtype"), ("resume", "resume checkpoint"))
_GLOO = re.compile(rb"^\[Gloo\]")
_ORIGINAL_STDERR: int | None = None
_CURRENT: "Rendezvous | None" = None


def _stderr_fd() -> int:
  """A copy of the process's original fd 2, so errors get out while fd 2 is redirected."""
  global _ORIGINAL_STDERR
  if _ORIGINAL_STDERR is None:
    _ORIGINAL_STDERR = os.dup(2)  # before any redirect
  return _ORIGINAL_STDERR


class Watchdog:
  """Exits the process with E-DP-007 when an armed wait outlasts the timeout."""

  def __init__(self, cfg: NodeConfig, timeout_s: float,
               on_timeout: Callable[[SxError], None] | None = None):
    self.cfg = cfg
    self.timeout_s = float(timeout_s)
    self.on_timeout = on_timeout
    self._cv = threading.Condition()
    self._deadline: float | None = None
    self._what = ""
    _stderr_fd()
    self._thread = threading.Thread(target=self._loop, name="sexpgpu-watchdog", daemon=True)
    self._thread.start()

  def arm(self, what: str, timeout_s: float | None = None) -> None:
    """Starts the clock for a wait (`what` is named in the error)."""
    with self._cv:
      self._what = what
      self._deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
      self._cv.notify()

  def disarm(self) -> None:
    """Stops the clock: the wait is over."""
    with self._cv:
      self._deadline = None
      self._cv.notify()

  @contextlib.contextmanager
  def watch(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
    """Arms the watchdog for the duration of the block."""
    self.arm(what, timeout_s)
    try:
      yield
    finally:
      self.disarm()

  def error(self, what: str) -> SxError:
    """The E-DP-007 error for a wait at `what`."""
    c = self.cfg
    return SxError("E-DP-007", f"a node did not arrive at the rendezvous within "
                   f"{self.timeout_s:g} s, or left the run (node {c.rank} of {c.nodes} waited "
                   f"at {what})", where=f"SEXPGPU_RENDEZVOUS={c.rendezvous}", fix=FIX_ARRIVE)

  def _loop(self) -> None:
    with self._cv:
      while True:
        if self._deadline is None:
          self._cv.wait()
          continue
        left = self._deadline - time.monotonic()
        if left > 0:
          self._cv.wait(left)
          continue
        self._fire(self._what)

  def _fire(self, what: str) -> None:
    self.fail(self.error(what))

  def fail(self, err: SxError) -> None:
    """Reports `err` (the status first) and exits 1 at once: a run that lost a node must not
    reach JAX's shutdown barrier, which waits for the lost node and then aborts."""
    try:
      if self.on_timeout is not None:
        self.on_timeout(err)
    finally:
      try:
        os.write(_stderr_fd(), (err.render() + "\n").encode())
      finally:
        os._exit(1)  # before JAX's own deadline aborts the process with SIGABRT


class Rendezvous:
  """The node's link to the others: the jax.distributed client and our watchdog."""

  def __init__(self, cfg: NodeConfig, client, watchdog: Watchdog):
    self.cfg = cfg
    self.client = client
    self.watchdog = watchdog

  @property
  def timeout_ms(self) -> int:
    """JAX's own wait limit, past the watchdog's."""
    return int((self.watchdog.timeout_s + MARGIN_S) * 1000)

  def watch(self, what: str, timeout_s: float | None = None):
    """Context manager: E-DP-007 and exit 1 when the block outlasts the timeout."""
    return self.watchdog.watch(what, timeout_s)

  def lost(self, what: str, cause: str, checkpoint: str | None) -> None:
    """Exits with E-DP-007 after a collective failed because another node left the run."""
    c = self.cfg
    self.watchdog.fail(SxError(
        "E-DP-007", f"another node left the run: node {c.rank} of {c.nodes} saw {what} fail "
        f"({cause}); the last committed checkpoint is {checkpoint or 'none'}",
        where=f"SEXPGPU_RENDEZVOUS={c.rendezvous}", fix=FIX_ARRIVE))

  def barrier(self, name: str) -> None:
    """Waits until every node reaches `name`, under the watchdog."""
    with self.watch(f"barrier {name}"):
      self.client.wait_at_barrier(f"sexpgpu/{name}", self.timeout_ms)

  def exchange(self, topic: str, value: dict, judge: Callable[[dict, dict[int, dict]], dict | None]
               ) -> dict[int, dict]:
    """Every node publishes `value`; node 0 judges them all and every node learns the verdict.

    Args:
      topic: a key prefix unique to this exchange.
      value: this node's JSON-able value.
      judge: on node 0, (node 0's value, {node: value}) → None when they agree,
        else {"code", "message", "where", "fix"} of the error.

    Returns:
      On node 0 every node's value; on the others their own only.

    Raises:
      SxError: the verdict's error, on every node.
    """
    c, kv = self.cfg, self.client
    values = {c.rank: value}
    with self.watch(topic):
      kv.key_value_set(f"sexpgpu/{topic}/{c.rank}", json.dumps(value, sort_keys=True))
      if c.rank == 0:
        for r in range(1, c.nodes):
          values[r] = json.loads(kv.blocking_key_value_get(f"sexpgpu/{topic}/{r}",
                                                           self.timeout_ms))
        bad = judge(value, values)
        verdict = {"ok": bad is None, **(bad or {})}
        kv.key_value_set(f"sexpgpu/{topic}/verdict", json.dumps(verdict))
      else:
        verdict = json.loads(kv.blocking_key_value_get(f"sexpgpu/{topic}/verdict",
                                                       self.timeout_ms))
      # node 0 leaves (and takes the coordinator with it) only once all have read it
      kv.wait_at_barrier(f"sexpgpu/{topic}/read", self.timeout_ms)
    if not verdict["ok"]:
      raise SxError(verdict["code"], verdict["message"], where=verdict.get("where"),
                    fix=verdict.get("fix"))
    return values


def initialize(cfg: NodeConfig, timeout_s: float,
               on_timeout: Callable[[SxError], None] | None = None,
               local_device_ids: list[int] | None = None) -> Rendezvous:
  """Joins the run's nodes through jax.distributed, under our watchdog.

  Call before anything starts a JAX backend (after env.parse_nodes).

  Args:
    cfg: this node's NodeConfig.
    timeout_s: SEXPGPU_RENDEZVOUS_TIMEOUT (env.rendezvous_timeout()).
    on_timeout: called with the E-DP-007 error before the process exits
      (write the status file there).
    local_device_ids: this node's device ordinals (SEXPGPU_DEVICES), or None.

  Returns:
    The Rendezvous; also remembered for compare_at_rendezvous.
  """
  global _CURRENT
  import jax
  from orbax.checkpoint import multihost  # jax exports no public handle on its client
  wd = Watchdog(cfg, timeout_s, on_timeout)
  wd.arm("jax.distributed.initialize")  # before: initialize itself may hang or abort
  if cfg.collectives == "gloo":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service takes SIGTERM's handler from ours and swallows the signal; the
  # nodes agree on a stop through the step's own stop flags instead.
  jax.config.update("jax_enable_preemption_service", False)
  longer = int(timeout_s) + MARGIN_S
  with quiet_collectives():
    jax.distributed.initialize(coordinator_address=cfg.rendezvous, num_processes=cfg.nodes,
                               process_id=cfg.rank, local_device_ids=local_device_ids,
                               initialization_timeout=longer,
                               heartbeat_timeout_seconds=max(100, longer),
                               shutdown_timeout_seconds=max(300, longer))
  wd.disarm()
  _CURRENT = Rendezvous(cfg, multihost.get_jax_distributed_client(), wd)
  return _CURRENT


def current() -> Rendezvous | None:
  """The Rendezvous of this process's initialize(), or None on one node."""
  return _CURRENT


def _judge_info(mine: dict, values: dict[int, dict]) -> dict | None:
  for r in sorted(values):
    if r == 0:
      continue
    other = values[r]
    if other.get("node") != r:
      return {"code": "E-DP-006", "message": f"node index {other.get('node')} twice at the "
              f"rendezvous (node 0 and node {r})", "where": "SEXPGPU_NODE_RANK", "fix": FIX_SAME}
    for key, what in COMPARED:
      if other.get(key) != mine.get(key):
        return {"code": "E-DP-006", "message": f"node {r} differs from node 0 at the rendezvous: "
                f"{what} {_show(other.get(key))} on node {r}, {_show(mine.get(key))} on node 0",
                "where": f"node {r}", "fix": FIX_SAME}
  return None


def _show(v: Any) -> str:
  return "none" if v is None else str(v)


def compare_at_rendezvous(info: Mapping[str, Any], rdv: Rendezvous | None = None) -> None:
  """Checks that every node runs the same experiment the same way.

  Args:
    info: this node's {"nodes", "node", "gpus", "fingerprint", "gradients",
      "resume"} (resume: the checkpoint step folder it resumes, or None).
    rdv: the Rendezvous (default: the one initialize() made).

  Raises:
    SxError: E-DP-006 on every node when a node's node count, index, GPU
      count, fingerprint, gradient dtype or resume checkpoint differs from
      node 0's; the message names the node and both values.
  """
  rdv = rdv or _CURRENT
  if rdv is None:
    raise RuntimeError("compare_at_rendezvous before nodes.initialize")
  rdv.exchange("rendezvous", dict(info), _judge_info)


def params_hash(tree: Any) -> str:
  """A sha256 of a pytree's leaves (paths, dtypes, shapes, bytes), for E-DP-004."""
  import jax
  import numpy as np
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, "addressable_shards") and not getattr(leaf, "is_fully_addressable", True):
      leaf = leaf.addressable_shards[0].data  # a replicated global array: this node's copy
    a = np.asarray(jax.device_get(leaf))
    h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()


def follow_node_0(topic: str, value: Any, rdv: Rendezvous | None = None) -> Any:
  """Node 0's `value` (JSON-able) on every node; `value` itself on one node.

  For decisions each node could make differently (timings, its own choices.json)
  that must be the same everywhere, such as the stacking degree.
  """
  rdv = rdv or _CURRENT
  if rdv is None:
    return value
  c, kv = rdv.cfg, rdv.client
  with rdv.watch(topic):
    if c.rank == 0:
      kv.key_value_set(f"sexpgpu/{topic}/decided", json.dumps(value))
      out = value
    else:
      out = json.loads(kv.blocking_key_value_get(f"sexpgpu/{topic}/decided", rdv.timeout_ms))
    kv.wait_at_barrier(f"sexpgpu/{topic}/read", rdv.timeout_ms)
  return out


def agree_at_checkpoint(step: int, digest: str, rdv: Rendezvous | None = None) -> None:
  """Checks that every node's params_hash agrees before checkpoint `step` is written.

  Raises:
    SxError: E-DP-004 on every node when a node's hash differs from node 0's.
  """
  rdv = rdv or _CURRENT
  if rdv is None:
    return

  def judge(mine: dict, values: dict[int, dict]) -> dict | None:
    for r in sorted(values):
      if values[r]["hash"] != mine["hash"]:
        return {"code": "E-DP-004", "message": f"node {r}'s parameters or optimizer states "
                f"disagree with node 0's at step {step} ({values[r]['hash'][:12]} on node {r}, "
                f"{mine['hash'][:12]} on node 0); the checkpoint was not written",
                "where": f"checkpoint step {step}", "fix": FIX_HASH}
    return None

  rdv.exchange(f"checkpoint-{step}", {"hash": digest}, judge)


@contextlib.contextmanager
def quiet_collectives() -> Iterator[None]:
  """Keeps gloo's `[Gloo] Rank 0 is connected…` C++ lines out of the run's output.

  The notes saw the line on standard error; jax 0.10.2's gloo prints it on
  standard output. So file descriptors 1 and 2 both go to temporary files for
  the block (the first collective's set-up); afterwards every other line goes
  back where it was written.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  saved = []
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    for fd, tmp in ((1, out), (2, err)):
      saved.append((fd, os.dup(fd), tmp))
      os.dup2(tmp.fileno(), fd)
    try:
      yield
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      for fd, real, tmp in saved:
        os.dup2(real, fd)
        os.close(real)
        tmp.seek(0)
        kept = [ln for ln in tmp.read().splitlines(keepends=True) if not _GLOO.match(ln)]
        if kept:
          os.write(fd, b"".join(kept))

"""Several nodes over jax.distributed: a watchdog, the rendezvous check, checkpoint hashes.

JAX's coordination service aborts the process (SIGABRT) when a peer never
arrives, with no Python exception to catch. So a watchdog thread of ours is
armed before `jax.distributed.initialize` (whose own timeouts are set longer)
and around every later wait; past SEXPGPU_RENDEZVOUS_TIMEOUT it writes the
status (a callback), prints E-DP-007 and leaves with exit 1 via os._exit.

JAX's client also aborts the process the instant its connection to the
coordinator (node 0) breaks. A Python callback cannot replace that abort
(jaxlib 0.10.2 cannot hand the callback its absl::Status: std::bad_cast, then
SIGABRT). So every other node reaches node 0 through a relay of ours on a
loopback port: when node 0 goes, the relay keeps JAX's side of the connection
open and reports the loss to the watchdog, which ends the run with E-DP-007.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from sexpgpu.env import NodeConfig
from sexpgpu.errors import SxError

FIX_ARRIVE = "start every node; after a loss, restart every node with --resume latest"
FIX_SAME = "the same files, flags, device count and checkpoint location on every node"
FIX_HASH = ("a backend bug, never the experiment's fault: that checkpoint was not written, so "
            "--resume latest continues from the one before; report it with the step and "
            "SEXPGPU_DEVICES")
# JAX's own deadlines sit this far past ours, so the watchdog always fires first.
MARGIN_S = 60
# How long node 0's loss, seen by the relay while this node waits on no other node, may go
# unreported: the next wait reports it at once, and JAX's client notices no sooner than a
# missed heartbeat (half of heartbeat_timeout, at least 50 s), then aborts.
LEFT_GRACE_S = 10
# What every node publishes at the rendezvous, and how the error names it.
COMPARED = (("nodes", "node count"), ("gpus", "GPU count"), ("fingerprint", "experiment"),
            ("gradients", "gradient dtype"), ("resume", "resume checkpoint"))
# gloo's announcement `[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of
# connected peer ranks is : 3`, written in pieces: two local devices' threads interleave them
# Where jax keeps the client `jax.distributed.initialize` made. jax exports no public
# handle on it, and the rendezvous needs what only it offers: barriers and a key-value
# store with timeouts, before any collective can run. Reached by name here alone (not
# through orbax's `multihost`, which reads the same attribute); tests/test_imports.py's
# test_private_handles_are_where_they_were fails when a jax release moves it.
CLIENT_HOME = "jax._src.distributed"


def distributed_client():
  """The client of this process's `jax.distributed.initialize` (see CLIENT_HOME).

  Raises:
    RuntimeError: naming CLIENT_HOME, when jax keeps it elsewhere or it was not made.
  """
  state = getattr(importlib.import_module(CLIENT_HOME), "global_state", None)
  client = getattr(state, "client", None)
  if client is None:
    raise RuntimeError(f"no jax.distributed client at {CLIENT_HOME}.global_state.client")
  return client


_GLOO_PIECES = re.compile(rb"\[Gloo\] Rank | is connected to | peer ranks\. ?|"
                          rb"Expected number of connected peer ranks is : ")
_DIGITS_ONLY = re.compile(rb"^[\d ]*\n?$")
_ORIGINAL_STDERR: int | None = None
_CURRENT: "Rendezvous | None" = None


def _stderr_fd() -> int:
  """A copy of the process's original fd 2, so errors get out while fd 2 is redirected."""
  global _ORIGINAL_STDERR
  if _ORIGINAL_STDERR is None:
    _ORIGINAL_STDERR = os.dup(2)  # before any redirect
  return _ORIGINAL_STDERR


class Watchdog:
  """Exits the process with E-DP-007 when an armed wait outlasts the timeout, or a node left."""

  def __init__(self, cfg: NodeConfig, timeout_s: float,
               on_timeout: Callable[[SxError], None] | None = None):
    self.cfg = cfg
    self.timeout_s = float(timeout_s)
    self.on_timeout = on_timeout
    # The last committed checkpoint, named in the error (the run sets it; None: not named).
    self.checkpoint: Callable[[], str | None] | None = None
    self._cv = threading.Condition()
    self._deadline: float | None = None
    self._what = ""
    self._left: tuple[str, str] | None = None  # (who, cause): a node seen leaving the run
    self._left_by: float | None = None  # report it by then, waiting or not
    self._finishing = False
    self._failing = threading.Lock()
    _stderr_fd()
    self._thread = threading.Thread(target=self._loop, name="sexpgpu-watchdog", daemon=True)
    self._thread.start()

  def arm(self, what: str, timeout_s: float | None = None) -> None:
    """Starts the clock for a wait (`what` is named in the error); a node already seen
    leaving ends the run here."""
    with self._cv:
      if self._left is not None and not self._finishing:
        self._fail_left(what)
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

  def left(self, who: str, cause: str) -> None:
    """Reports that `who` left the run, seen outside JAX (the relay).

    During a wait on the other nodes the run ends now with E-DP-007; otherwise at the next
    wait, or after LEFT_GRACE_S at the latest. Ignored once the process is finishing.
    """
    with self._cv:
      if self._finishing or self._left is not None:
        return
      self._left = (who, cause)
      if self._deadline is not None:
        self._fail_left(self._what)
      self._left_by = time.monotonic() + LEFT_GRACE_S
      self._cv.notify()

  def finish(self) -> None:
    """The process is ending: a node that leaves now (node 0 first) is no error."""
    with self._cv:
      self._finishing = True
      self._left_by = None
      self._cv.notify()

  def seen_leaving(self) -> str | None:
    """The node the relay saw leave the run, if any."""
    with self._cv:
      return self._left[0] if self._left is not None else None

  def other(self) -> str:
    """The node this one waits on, as errors name it: the other of two, else "a node"."""
    return f"node {1 - self.cfg.rank}" if self.cfg.nodes == 2 else "a node"

  def error(self, what: str) -> SxError:
    """The E-DP-007 error for a wait at `what` that outlasted the timeout."""
    c = self.cfg
    return SxError("E-DP-007", f"{self.other()} did not arrive at the rendezvous within "
                   f"{self.timeout_s:g} s, or left the run (node {c.rank} of {c.nodes} waited "
                   f"at {what}){self._committed()}", where=f"SEXPGPU_RENDEZVOUS={c.rendezvous}",
                   fix=FIX_ARRIVE)

  def left_error(self, who: str, what: str, cause: str, checkpoint: str | None = None
                 ) -> SxError:
    """The E-DP-007 error for `who` leaving the run, seen at `what` failing with `cause`."""
    c = self.cfg
    return SxError("E-DP-007", f"{who} left the run: node {c.rank} of {c.nodes} saw {what} "
                   f"fail ({cause}){self._committed(checkpoint)}",
                   where=f"SEXPGPU_RENDEZVOUS={c.rendezvous}", fix=FIX_ARRIVE)

  def _committed(self, checkpoint: str | None = None) -> str:
    if checkpoint is None and self.checkpoint is None:
      return ""  # outside a run (nodes joined by a script)
    if checkpoint is None:
      checkpoint = self.checkpoint()
    return f"; the last committed checkpoint is {checkpoint or 'none'}"

  def _loop(self) -> None:
    with self._cv:
      while True:
        due = [d for d in (self._deadline, self._left_by) if d is not None]
        if not due:
          self._cv.wait()
          continue
        left = min(due) - time.monotonic()
        if left > 0:
          self._cv.wait(left)
          continue
        if self._deadline is None or self._deadline > time.monotonic():
          self._fail_left("its link to node 0")  # a node left while this one waited on none
        self._fire(self._what)

  def _fail_left(self, what: str) -> None:
    who, cause = self._left
    self.fail(self.left_error(who, what, cause))

  def _fire(self, what: str) -> None:
    self.fail(self.error(what))

  def fail(self, err: SxError) -> None:
    """Reports `err` (the status first) and exits 1 at once: a run that lost a node must not
    reach JAX's shutdown barrier, which waits for the lost node and then aborts.

    Of several threads that fail at once, the first reports; the others wait for its exit.
    """
    self._failing.acquire()  # never released: the process ends below
    try:
      if self.on_timeout is not None:
        self.on_timeout(err)
    finally:
      try:
        os.write(_stderr_fd(), (err.render() + "\n").encode())
      finally:
        os._exit(1)  # before JAX's own deadline aborts the process with SIGABRT


class _Relay:
  """A loopback port between this node's JAX client and the coordinator on node 0.

  JAX's client aborts the process (LOG(FATAL), SIGABRT) the instant its
  connection to the coordinator breaks, racing the E-DP-007 of the collective
  that failed with it. Through the relay it sees no break: the relay keeps this
  side open and calls `on_lost` instead. JAX would notice only at a missed
  heartbeat, long after the watchdog ended the run.
  """

  def __init__(self, host: str, port: int, connect_s: float, on_lost: Callable[[str], None]):
    self.upstream = (host.strip("[]"), port)
    self.connect_s = connect_s
    self.on_lost = on_lost
    self.finishing = False
    self._server = socket.create_server(("127.0.0.1", 0))
    self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
    threading.Thread(target=self._accept, name="sexpgpu-relay", daemon=True).start()

  def _accept(self) -> None:
    while True:
      try:
        down, _ = self._server.accept()
      except OSError:
        return
      threading.Thread(target=self._join, args=(down,), name="sexpgpu-relay", daemon=True).start()

  def _join(self, down: socket.socket) -> None:
    # Node 0 may not listen yet: JAX's client waits on this connection meanwhile.
    deadline = time.monotonic() + self.connect_s
    while True:
      try:
        up = socket.create_connection(self.upstream, timeout=10)
        break
      except OSError:
        if time.monotonic() > deadline:
          down.close()
          return
        time.sleep(0.05)
    up.settimeout(None)
    for sock in (down, up):
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    closed = threading.Event()  # set when JAX's client closed its side
    threading.Thread(target=self._pump, args=(down, up, closed, False), name="sexpgpu-relay",
                     daemon=True).start()
    self._pump(up, down, closed, True)

  def _pump(self, src: socket.socket, dst: socket.socket, closed: threading.Event,
            from_node_0: bool) -> None:
    node_0 = f"node 0 at {self.upstream[0]}:{self.upstream[1]}"
    cause = f"{node_0} closed the connection"
    try:
      while data := src.recv(1 << 16):
        try:
          dst.sendall(data)
        except OSError:
          return  # the other direction sees why
    except OSError as e:
      cause = f"{e.strerror or type(e).__name__} from {node_0}"
    if not from_node_0:
      closed.set()
    elif not closed.is_set() and not self.finishing:
      self.on_lost(cause)
      return  # JAX's side stays open: its client must not see the loss
    with contextlib.suppress(OSError):
      dst.shutdown(socket.SHUT_WR)
    if from_node_0 and closed.is_set():  # both directions are over
      src.close()
      dst.close()


class Rendezvous:
  """The node's link to the others: the jax.distributed client and our watchdog."""

  def __init__(self, cfg: NodeConfig, client, watchdog: Watchdog, relay: _Relay | None = None):
    self.cfg = cfg
    self.client = client
    self.watchdog = watchdog
    self.relay = relay

  @property
  def checkpoint(self) -> Callable[[], str | None] | None:
    """Gives the last committed checkpoint (named in E-DP-007); set by the run."""
    return self.watchdog.checkpoint

  @checkpoint.setter
  def checkpoint(self, last: Callable[[], str | None]) -> None:
    self.watchdog.checkpoint = last

  def finish(self) -> None:
    """The process is ending: other nodes leaving (node 0 first) is no error now."""
    if self.relay is not None:
      self.relay.finishing = True
    self.watchdog.finish()

  @property
  def timeout_ms(self) -> int:
    """JAX's own wait limit, past the watchdog's."""
    return int((self.watchdog.timeout_s + MARGIN_S) * 1000)

  def watch(self, what: str, timeout_s: float | None = None):
    """Context manager: E-DP-007 and exit 1 when the block outlasts the timeout."""
    return self.watchdog.watch(what, timeout_s)

  def lost(self, what: str, cause: str, checkpoint: str | None) -> None:
    """Exits with E-DP-007 after a collective failed because another node left the run."""
    wd = self.watchdog
    seen = wd.seen_leaving()
    who = seen or (wd.other() if self.cfg.nodes == 2 else "another node")
    wd.fail(wd.left_error(who, what, cause, checkpoint or "none"))

  def barrier(self, name: str) -> None:
    """Waits until every node reaches `name`, under the watchdog."""
    with self.watch(f"barrier {name}"):
      self.client.wait_at_barrier(f"sexpgpu/{name}", self.timeout_ms)

  def exchange(self, topic: str, value: dict, judge: Callable[[dict, dict[int, dict]], dict | None],
               extra_s: float = 0.0) -> dict[int, dict]:
    """Every node publishes `value`; node 0 judges them all and every node learns the verdict.

    Args:
      topic: a key prefix unique to this exchange.
      value: this node's JSON-able value.
      judge: on node 0, (node 0's value, {node: value}) → None when they agree,
        else {"code", "message", "where", "fix"} of the error.

      extra_s: seconds the others may take past the rendezvous timeout (work that each
        node does before it publishes, such as uploading its part of a checkpoint).

    Returns:
      On node 0 every node's value; on the others their own only.

    Raises:
      SxError: the verdict's error, on every node.
    """
    c, kv = self.cfg, self.client
    values = {c.rank: value}
    limit_s = self.watchdog.timeout_s + extra_s
    timeout_ms = int((limit_s + MARGIN_S) * 1000)
    with self.watch(topic, limit_s):
      kv.key_value_set(f"sexpgpu/{topic}/{c.rank}", json.dumps(value, sort_keys=True))
      if c.rank == 0:
        for r in range(1, c.nodes):
          values[r] = json.loads(kv.blocking_key_value_get(f"sexpgpu/{topic}/{r}",
                                                           timeout_ms))
        bad = judge(value, values)
        verdict = {"ok": bad is None, **(bad or {})}
        kv.key_value_set(f"sexpgpu/{topic}/verdict", json.dumps(verdict))
      else:
        verdict = json.loads(kv.blocking_key_value_get(f"sexpgpu/{topic}/verdict",
                                                       timeout_ms))
      # node 0 leaves (and takes the coordinator with it) only once all have read it
      kv.wait_at_barrier(f"sexpgpu/{topic}/read", timeout_ms)
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
  wd = Watchdog(cfg, timeout_s, on_timeout)
  wd.arm("jax.distributed.initialize")  # before: initialize itself may hang or abort
  longer = int(timeout_s) + MARGIN_S
  relay, address = None, cfg.rendezvous
  if cfg.rank != 0:  # node 0's own client dies with the coordinator
    relay = _Relay(cfg.host, cfg.port, longer, lambda cause: wd.left("node 0", cause))
    address = relay.address
  if cfg.collectives == "gloo":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service takes SIGTERM's handler from ours and swallows the signal; the
  # nodes agree on a stop through the step's own stop flags instead.
  jax.config.update("jax_enable_preemption_service", False)
  with quiet_collectives():
    jax.distributed.initialize(coordinator_address=address, num_processes=cfg.nodes,
                               process_id=cfg.rank, local_device_ids=local_device_ids,
                               initialization_timeout=longer,
                               heartbeat_timeout_seconds=max(100, longer),
                               shutdown_timeout_seconds=max(300, longer))
  wd.disarm()
  _CURRENT = Rendezvous(cfg, distributed_client(), wd, relay)
  # Exit handlers run last-in first: this one before JAX's, whose shutdown barrier lets
  # node 0 close the coordinator while the others still leave.
  atexit.register(_CURRENT.finish)
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
    # settings outside the fingerprint that the nodes must still share (:sharding, when to
    # save or evaluate: a node saving alone would wait for the others for ever)
    theirs, ours = other.get("knobs") or {}, mine.get("knobs") or {}
    for knob in sorted(set(theirs) | set(ours)):
      if theirs.get(knob) != ours.get(knob):
        return {"code": "E-DP-006", "message": f"node {r} differs from node 0 at the rendezvous: "
                f":{knob} {_show(theirs.get(knob))} on node {r}, {_show(ours.get(knob))} on "
                "node 0", "where": f"node {r}", "fix": FIX_SAME}
  return None


def _show(v: Any) -> str:
  return "none" if v is None else str(v)


def compare_at_rendezvous(info: Mapping[str, Any], rdv: Rendezvous | None = None) -> None:
  """Checks that every node runs the same experiment the same way.

  Args:
    info: this node's {"nodes", "node", "gpus", "fingerprint", "gradients",
      "resume", "knobs"} (resume: the checkpoint step folder it resumes, or None;
      knobs: the knobs outside the fingerprint, by name, as text).
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
        kept = without_gloo(tmp.read())
        if kept:
          os.write(fd, kept)


def without_gloo(text: bytes) -> bytes:
  """`text` without gloo's announcements, also where two threads' pieces interleave:
  the pieces go, then the lines left holding only their numbers."""
  if not _GLOO_PIECES.search(text):
    return text
  lines = _GLOO_PIECES.sub(b"", text).splitlines(keepends=True)
  return b"".join(ln for ln in lines if not _DIGITS_ONLY.match(ln))
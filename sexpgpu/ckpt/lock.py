"""One run per checkpoint location: a lock on `<location>/<slug>` held while the run lives.

Locally the lock is `LOCK` in the run folder, held with `flock` (the kernel lets
it go when the process dies, however it dies) and holding the holder's host, pid
and start time for the message of the run that is refused. On `s3://` and
`gs://` it is a lease object with the same fields and an expiry that a thread
renews: it is created with a conditional write (If-None-Match: *) where the
store honours one, and is read back either way, so of two runs that race for it
exactly one finds its own token. A lock whose holder is gone (its pid dead on
this host, or its lease expired) is taken over with a line that says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Callable

from sexpgpu.ckpt.where import join, reason, scrub, strip_scheme
from sexpgpu.errors import SxError

LOCK = "LOCK"
LEASE_S = 120.0  # a remote lease not renewed for this long is stale
_RENEW_S = LEASE_S / 4
_HELD: dict[str, list] = {}  # lock path → [RunLock, holders in this process]
_HELD_LOCK = threading.Lock()


def _me() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time(),
          "token": uuid.uuid4().hex}


def _alive(pid: int) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (OSError, ValueError, TypeError):
    return True  # alive, as another user (or unknowable: assume alive)
  return True


def _stamp(t) -> str:
  try:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(t)))
  except (TypeError, ValueError, OverflowError):
    return "an unknown time"


def describe(holder: dict) -> str:
  """`pid P on host H, started <time>`: the holder as the messages name it."""
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
          f"{_stamp(holder.get('started_at'))}")


def stale_reason(holder: dict, now: float | None = None) -> str | None:
  """Why a recorded holder no longer holds the lock, or None while it may."""
  now = time.time() if now is None else now
  if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid", -1)):
    return "that process is gone"
  expires = holder.get("expires_at")
  if isinstance(expires, (int, float)) and expires < now:
    return f"its lease expired at {_stamp(expires)}"
  return None


def _held_error(run_dir: str, holder: dict, where: str) -> SxError:
  return SxError("E-CKPT-005", f"the checkpoint location {scrub(run_dir)} is in use by "
                 f"another run: {describe(holder)}", where=where)


class RunLock:
  """The lock of one run folder, held by this process until `release`."""

  def __init__(self, run_dir: str, fs, where: str, say: Callable[[str], None]):
    self.run_dir = run_dir
    self.fs = fs
    self.where = where
    self.say = say
    self.me = _me()
    self._fd: int | None = None
    self._stop = threading.Event()
    self._renewer: threading.Thread | None = None

  # -- local ----------------------------------------------------------------

  def _acquire_local(self) -> None:
    os.makedirs(self.run_dir, exist_ok=True)
    path = os.path.join(self.run_dir, LOCK)
    while True:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read_fd(fd)
        os.close(fd)
        raise _held_error(self.run_dir, holder, self.where) from None
      try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
      except FileNotFoundError:
        same = False
      if not same:  # its holder removed it while we opened it: take the new one
        os.close(fd)
        continue
      break
    before = _read_fd(fd)
    if before.get("pid") is not None:
      why = stale_reason(before) or "it no longer holds it"
      self.say(f"checkpoint: took over the lock of {scrub(self.run_dir)} from "
               f"{describe(before)}: {why}")
    data = json.dumps(self.me).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    self._fd = fd

  def _release_local(self) -> None:
    if self._fd is None:
      return
    with contextlib.suppress(OSError):
      os.unlink(os.path.join(self.run_dir, LOCK))  # while held: no one else has it now
    os.close(self._fd)
    self._fd = None

  # -- remote ---------------------------------------------------------------

  def _key(self) -> str:
    return join(strip_scheme(self.run_dir), LOCK)

  def _read_remote(self) -> dict | None:
    try:
      self.fs.invalidate_cache(self._key())
      return json.loads(self.fs.cat_file(self._key()))
    except FileNotFoundError:
      return None
    except ValueError:
      return {}

  def _lease(self) -> bytes:
    return json.dumps(dict(self.me, expires_at=time.time() + LEASE_S)).encode()

  def _acquire_remote(self) -> None:
    for _ in range(5):
      holder = self._read_remote()
      if holder is not None:
        why = stale_reason(holder) if holder else "its lease does not parse"
        if why is None:
          raise _held_error(self.run_dir, holder, self.where)
        self.fs.rm_file(self._key())
        self.say(f"checkpoint: took over the lock of {scrub(self.run_dir)} from "
                 f"{describe(holder)}: {why}")
      try:  # If-None-Match: * (s3fs's mode "create"); moto and AWS S3 honour it
        self.fs.pipe_file(self._key(), self._lease(), mode="create")
      except FileExistsError:  # another run was first: read it again
        continue
      time.sleep(0.2)  # a store without conditional writes: the last writer wins; read back
      got = self._read_remote()
      if got and got.get("token") == self.me["token"]:
        self._renewer = threading.Thread(target=self._renew, daemon=True,
                                         name="sexpgpu-ckpt-lease")
        self._renewer.start()
        return
      if got:
        raise _held_error(self.run_dir, got, self.where)
    raise SxError("E-CKPT-004", f"cannot take the lock of {scrub(self.run_dir)}: it changed "
                  "hands five times while this run tried", where=self.where)

  def _renew(self) -> None:
    while not self._stop.wait(_RENEW_S):
      with contextlib.suppress(Exception):
        got = self._read_remote()
        if got and got.get("token") == self.me["token"]:
          self.fs.pipe_file(self._key(), self._lease())

  def _release_remote(self) -> None:
    self._stop.set()
    with contextlib.suppress(Exception):
      got = self._read_remote()
      if got and got.get("token") == self.me["token"]:
        self.fs.rm_file(self._key())

  # -- both -----------------------------------------------------------------

  def acquire(self) -> None:
    """Takes the lock, or raises E-CKPT-005 naming the live holder."""
    if self.fs is None:
      self._acquire_local()
      return
    try:
      self._acquire_remote()
    except SxError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise SxError("E-CKPT-004", f"cannot take the lock of {scrub(self.run_dir)}: {reason(e)}",
                    where=self.where, fix="check the location, its credentials and that they may write "
                    "there (the lock is an object beside the step folders)") from e

  def release(self) -> None:
    """Lets the lock go (idempotent)."""
    if self.fs is None:
      self._release_local()
    else:
      self._release_remote()


def _read_fd(fd: int) -> dict:
  try:
    return json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8") or "{}")
  except (ValueError, UnicodeDecodeError, OSError):
    return {}


def acquire(run_dir: str, fs, where: str, say: Callable[[str], None] | None = None) -> str:
  """Takes the lock of a run folder for this process; a second call in it shares the first.

  Args:
    run_dir: `<location>/<slug>`, local or remote.
    fs: the fsspec filesystem of a remote run folder, or None for a local one.
    where: the flag or variable named in errors.
    say: where the takeover line goes (standard error by default).

  Returns:
    The key to pass to `release`.

  Raises:
    SxError: E-CKPT-005 while another live run holds it.
  """
  say = say or (lambda line: print(line, file=sys.stderr, flush=True))
  with _HELD_LOCK:
    if run_dir in _HELD:
      _HELD[run_dir][1] += 1
      return run_dir
    lock = RunLock(run_dir, fs, where, say)
    lock.acquire()
    _HELD[run_dir] = [lock, 1]
  return run_dir


def release(key: str) -> None:
  """Releases one hold of `acquire`; the lock goes when this process holds it no more."""
  with _HELD_LOCK:
    held = _HELD.get(key)
    if held is None:
      return
    held[1] -= 1
    if held[1] > 0:
      return
    del _HELD[key]
  held[0].release()

"""`sexpgpu sweep`: the cartesian product of `--set` values, one `sexpgpu run` child per point.

Layout (the status dir, `--status-dir`, default `./sweep`):

  <status-dir>/<slug>.status.json   each point's status file (the child's `--status`)
  <status-dir>/<slug>.jsonl         each point's metrics, unless `--metrics` names a target
  <status-dir>/<slug>.log           each point's standard error, appended per session

Checkpoints go where `run` puts them: `<checkpoint-dir>/<slug>/`, only when a location is
given (`--checkpoint-dir` or SEXPGPU_CHECKPOINT_DIR). A point whose status says `done` is
skipped; any other point that has a status file (stopped, failed, killed) is run again, with
`--resume latest` when there is a checkpoint location, from the beginning otherwise.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from sexpgpu.env import get as env_get
from sexpgpu.env import parse_device_list
from sexpgpu.errors import SxError
from sexpgpu.run.signals import SIGNALS as STOP_SIGNALS
from sexpgpu.run.signals import handed_over

SIGNALS = tuple(STOP_SIGNALS)  # the run's stop signals, forwarded to the points


@dataclasses.dataclass
class SweepOptions:
  """What `sexpgpu sweep` was asked (flags not yet merged with the environment)."""

  file: str
  grid: list[tuple[str, list[str]]]
  variant: str | None = None
  steps: int | None = None
  eval_every: int | None = None
  diagnostics: str | None = None
  device: str | None = None
  metrics: str | None = None
  checkpoint_dir: str | None = None
  status_dir: str = "sweep"
  parallel: int = 1
  table: str | None = None
  trust_python: bool = False  # --trust-python or SEXPGPU_TRUST_PYTHON=1: an emitted task says so


@dataclasses.dataclass
class Point:
  """One selection of the sweep: its `--set` pairs (grid order), slug and file locations."""

  sets: list[tuple[str, str]]
  slug: str
  status: str
  metrics: str
  log: str

  @property
  def jsonl(self) -> str | None:
    """The path of the point's jsonl metrics target, if it has one."""
    for target in self.metrics.split(","):
      if target.startswith("jsonl:"):
        return target[len("jsonl:"):]
    return None


@dataclasses.dataclass
class Row:
  """One line of the final table."""

  point: Point
  state: str
  steps: int | None = None
  train_loss: float | None = None
  last_pass: dict = dataclasses.field(default_factory=dict)
  seconds: float | None = None
  note: str = ""


def parse_grid(values: list[str]) -> list[tuple[str, list[str]]]:
  """`--set k=a,b,c` flags to [(k, [a, b, c])], in command-line order.

  Raises:
    SxError: E-KNOB-002 for a flag that is not knob=values, E-FORM-001 for a knob given twice.
  """
  grid: list[tuple[str, list[str]]] = []
  for s in values:
    name, eq, val = s.partition("=")
    name = name.strip()
    vals = [v.strip() for v in val.split(",")]
    if not eq or not name or not all(vals):
      raise SxError("E-KNOB-002", f"--set {s} is not knob=value[,value...]", where=f"--set {s}",
                    fix="write --set lr=1e-3,3e-3")
    if any(name == n for n, _ in grid):
      raise SxError("E-FORM-001", f"--set {name} is given twice", where=f"--set {s}",
                    fix=f"list every value once: --set {name}=a,b,c")
    grid.append((name, vals))
  return grid


def plan(opts: SweepOptions) -> list[Point]:
  """Every point of the grid, each selection checked and its slug made as `run` makes it.

  Raises:
    SxError: read errors of the file, E-VARIANT-001, E-KNOB-001..003 for any point.
  """
  from sexpgpu.lang.program import load_program
  from sexpgpu.lang.select import run_slug_stem, select
  program = load_program(opts.file)
  stem = run_slug_stem()
  overrides = {"steps": opts.steps, "eval-every": opts.eval_every}
  names = [n for n, _ in opts.grid]
  points = []
  for combo in itertools.product(*[vals for _, vals in opts.grid]):
    sets = list(zip(names, combo))
    slug = select(program, opts.variant, sets, overrides, stem).slug
    points.append(Point(sets, slug, os.path.join(opts.status_dir, f"{slug}.status.json"),
                        _metrics_for(opts, slug), os.path.join(opts.status_dir, f"{slug}.log")))
  slugs = [p.slug for p in points]
  if len(set(slugs)) != len(slugs):
    raise SxError("E-FORM-001", "two points of the sweep have the same slug",
                  where="--set", fix="list each value once")
  return points


def _metrics_for(opts: SweepOptions, slug: str) -> str:
  """The point's metrics target: `{slug}` substituted; a jsonl directory gets `<slug>.jsonl`."""
  if opts.metrics is None:
    return "jsonl:" + os.path.join(opts.status_dir, f"{slug}.jsonl")
  out = []
  for target in opts.metrics.replace("{slug}", slug).split(","):
    if target.startswith("jsonl:"):
      path = target[len("jsonl:"):]
      if path.endswith(os.sep) or os.path.isdir(path):
        target = "jsonl:" + os.path.join(path, f"{slug}.jsonl")
    out.append(target)
  return ",".join(out)


def checkpoint_location(opts: SweepOptions) -> str | None:
  """`--checkpoint-dir`, else SEXPGPU_CHECKPOINT_DIR (which the children inherit)."""
  return opts.checkpoint_dir or env_get("SEXPGPU_CHECKPOINT_DIR")


def run_argv(opts: SweepOptions, point: Point, resume: bool, program: str = "python") -> list[str]:
  """The `sexpgpu run` command line of one point (program "python": this interpreter)."""
  head = ([sys.executable, "-m", "sexpgpu.cli.main"] if program == "python" else [program])
  argv = head + ["run", opts.file]
  if opts.variant:
    argv += ["--variant", opts.variant]
  for k, v in point.sets:
    argv += ["--set", f"{k}={v}"]
  for flag, value in (("--steps", opts.steps), ("--eval-every", opts.eval_every),
                      ("--diagnostics", opts.diagnostics), ("--device", opts.device),
                      ("--checkpoint-dir", opts.checkpoint_dir)):
    if value is not None:
      argv += [flag, str(value)]
  argv += ["--metrics", point.metrics, "--status", point.status]
  if resume:
    argv += ["--resume", "latest"]
  return argv + ["--json"]


def read_point_status(point: Point) -> dict | None:
  """The point's status object, or None when it has none (or it does not parse)."""
  from sexpgpu.track.status import read_status
  try:
    return read_status(point.status)
  except SxError:
    return None


def session_seconds(jsonl: str | None, slug: str) -> float | None:
  """Wall seconds of every session of `slug` in a jsonl file: config event to summary event."""
  if not jsonl or not os.path.isfile(jsonl):
    return None
  total, began, found = 0.0, None, False
  with open(jsonl, encoding="utf-8") as f:
    for line in f:
      try:
        ev = json.loads(line)
      except ValueError:
        continue
      if ev.get("slug") != slug:
        continue
      if ev.get("kind") == "config":
        began = ev.get("time")
      elif ev.get("kind") == "summary" and began is not None:
        total += float(ev["time"]) - float(began)
        began, found = None, True
  return total if found else None


def row_from_status(point: Point, status: dict, note: str = "") -> Row:
  """A table row from a status object (a done point's, or a child's last)."""
  return Row(point, status.get("state", "?"), status.get("step"), status.get("train_loss"),
             dict(status.get("last_pass") or {}), session_seconds(point.jsonl, point.slug), note)


def device_shares(opts: SweepOptions) -> list[str | None]:
  """One SEXPGPU_DEVICES value per parallel slot: the visible GPUs split; None on the CPU.

  Raises:
    SxError: E-DP-001 when there are fewer GPUs than `--parallel`.
  """
  device = opts.device or env_get("SEXPGPU_DEVICE") or "cpu"
  if device != "cuda" or opts.parallel <= 1:
    return [None] * max(opts.parallel, 1)
  given = parse_device_list(env_get("SEXPGPU_DEVICES"))
  ordinals = ([str(o) for o in given] if given is not None
              else [str(i) for i in range(_gpu_count())])
  if len(ordinals) < opts.parallel:
    raise SxError("E-DP-001", f"--parallel {opts.parallel} needs as many GPUs; "
                  f"{len(ordinals)} visible ({','.join(ordinals) or 'none'})",
                  where="--parallel", fix=f"use --parallel {max(len(ordinals), 1)} or fewer")
  k = len(ordinals) // opts.parallel
  return [",".join(ordinals[i * k:(i + 1) * k]) for i in range(opts.parallel)]


def _gpu_count() -> int:
  # the one reading of nvidia-smi and CUDA_VISIBLE_DEVICES (indices, GPU-/MIG- UUIDs)
  from sexpgpu.devices.doctor import gpu_count
  return gpu_count()


class _Child:
  """A running point: its process, the device share it holds and its captured stdout."""

  def __init__(self, point: Point, proc: subprocess.Popen, share: str | None, resumed: bool):
    self.point, self.proc, self.share, self.resumed = point, proc, share, resumed
    self.t0 = time.perf_counter()
    self.stdout = ""
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    self.stdout = self.proc.stdout.read()

  def row(self) -> Row:
    """The row after the process ended: from its summary line and status file."""
    self._reader.join()
    code = self.proc.returncode
    summary = None
    for line in self.stdout.splitlines():
      if line.startswith("{"):
        try:
          summary = json.loads(line)
        except ValueError:
          pass
    status = read_point_status(self.point) or {}
    if status.get("pid") != self.proc.pid:
      status = {}  # the child died before writing its own status
    if status.get("state") in ("done", "stopped", "failed"):
      row = row_from_status(self.point, status)
    else:
      row = Row(self.point, "stopped" if code < 0 or code >= 128 else "failed",
                seconds=session_seconds(self.point.jsonl, self.point.slug))
    if summary is not None:
      row.steps, row.train_loss = summary.get("steps"), summary.get("train_loss")
      row.last_pass = dict(summary.get("eval") or {})
    if code not in (0, None) and row.state == "done":
      row.state = "failed"
    if row.state == "failed":
      row.note = _first_error(self.point.log) or f"exit {code}"
    return row


def _first_error(log: str) -> str | None:
  """The last `error[...]` line of a point's log."""
  try:
    with open(log, encoding="utf-8", errors="replace") as f:
      lines = [line.strip() for line in f if line.startswith("error[")]
  except OSError:
    return None
  return lines[-1] if lines else None


class _Stop:
  """SIGTERM/SIGINT/SIGHUP to the sweep: remember it, forward it to every running child."""

  def __init__(self, running: dict):
    self.running = running
    self.received: int | None = None
    self._old: dict = {}

  def __enter__(self):
    for s in SIGNALS:
      self._old[s] = signal.signal(s, self._handle)
    handed_over()  # the CLI's start-up stop (and its watchdog) would end the sweep untabled
    return self

  def _handle(self, signum, frame) -> None:
    if self.received is None:
      self.received = signum
    for child in list(self.running.values()):
      if child.proc.poll() is None:
        child.proc.send_signal(signum)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def _log(line: str) -> None:
  sys.stderr.write(f"sweep: {line}\n")
  sys.stderr.flush()


def run_sweep(opts: SweepOptions) -> tuple[list[Row], int]:
  """Runs every point not yet done, `opts.parallel` at a time.

  Returns:
    The rows in grid order, and the exit status: 128 + n when a signal stopped the sweep,
    1 when a point failed, else 0.

  Raises:
    SxError: a selection error of any point (before anything runs), E-DP-001.
  """
  points = plan(opts)
  shares = device_shares(opts)
  os.makedirs(opts.status_dir, exist_ok=True)
  resumable = checkpoint_location(opts) is not None
  rows: dict[str, Row] = {}
  todo: list[tuple[Point, bool]] = []
  for p in points:
    status = read_point_status(p)
    if status is not None and status.get("state") == "done":
      rows[p.slug] = row_from_status(p, status, "skipped: done")
      _log(f"{p.slug} skip (done)")
    else:
      todo.append((p, status is not None and resumable))
  free = list(shares)
  running: dict[int, _Child] = {}
  with _Stop(running) as stop:
    while (todo and stop.received is None) or running:
      while todo and free and stop.received is None:
        point, resume = todo.pop(0)
        share = free.pop(0)
        running[id(point)] = child = _start(opts, point, resume, share)
        if stop.received is not None:  # the signal came while it was starting
          child.proc.send_signal(stop.received)
      time.sleep(0.05)
      for key, child in list(running.items()):
        if child.proc.poll() is not None:
          del running[key]
          free.append(child.share)
          rows[child.point.slug] = row = child.row()
          _log(f"{child.point.slug} {row.state} at step {row.steps} "
               f"({time.perf_counter() - child.t0:.1f}s)")
  for point, _ in todo:
    rows[point.slug] = Row(point, "pending", note="not started: the sweep was stopped")
  ordered = [rows[p.slug] for p in points]
  if stop.received is not None:
    return ordered, 128 + int(stop.received)
  return ordered, 1 if any(r.state != "done" for r in ordered) else 0


def _start(opts: SweepOptions, point: Point, resume: bool, share: str | None) -> _Child:
  argv = run_argv(opts, point, resume)
  env = dict(os.environ)
  if share is not None:
    env["SEXPGPU_DEVICES"] = share
  _log(f"{point.slug} {'resume latest' if resume else 'start'}"
       + (f" on SEXPGPU_DEVICES={share}" if share else ""))
  log = open(point.log, "a", encoding="utf-8")
  try:
    log.write("$ " + " ".join(shlex.quote(a) for a in argv) + "\n")
    log.flush()
    # A session of its own: a terminal's Ctrl-C reaches the sweep, which forwards it once.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                            env=env, text=True, start_new_session=True)
  finally:
    log.close()
  return _Child(point, proc, share, resume)


# --- the table ------------------------------------------------------------------------------

def table_columns(opts: SweepOptions, rows: list[Row]) -> list[str]:
  """Knobs, train/loss, every last pass metric, steps, seconds, state, slug."""
  metrics = sorted({m for r in rows for m in r.last_pass})
  return [n for n, _ in opts.grid] + ["train/loss"] + metrics + ["steps", "seconds", "state",
                                                                  "slug"]


def table_records(opts: SweepOptions, rows: list[Row]) -> list[dict[str, Any]]:
  """The rows as {column: value} (raw values, None where unknown)."""
  out = []
  for r in rows:
    rec: dict[str, Any] = dict(r.point.sets)
    rec["train/loss"] = r.train_loss
    rec.update(r.last_pass)
    rec.update(steps=r.steps, seconds=r.seconds, state=r.state, slug=r.point.slug)
    out.append(rec)
  return out


def _cell(v: Any, col: str) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.1f}" if col == "seconds" else f"{v:.4f}"
  return str(v)


def format_table(opts: SweepOptions, rows: list[Row]) -> str:
  """The table as aligned text, one line per point (and failures' errors after it)."""
  cols = table_columns(opts, rows)
  cells = [cols] + [[_cell(rec.get(c), c) for c in cols] for rec in table_records(opts, rows)]
  widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
  text = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                   for line in cells) + "\n"
  notes = [f"{r.point.slug}: {r.note}" for r in rows if r.state == "failed" and r.note]
  return text + "".join(n + "\n" for n in notes)


def write_csv(opts: SweepOptions, rows: list[Row], path: str) -> None:
  """Writes the table as CSV (empty cells where unknown, full precision)."""
  cols = table_columns(opts, rows)
  buf = io.StringIO()
  w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
  w.writeheader()
  for rec in table_records(opts, rows):
    w.writerow({c: ("" if rec.get(c) is None else rec.get(c)) for c in cols})
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  with open(path, "w", encoding="utf-8", newline="") as f:
    f.write(buf.getvalue())


# --- SkyPilot ---------------------------------------------------------------------------------

def emit_skypilot(opts: SweepOptions, out_dir: str, accelerators: str = "H100:1") -> list[str]:
  """Writes one SkyPilot task file per point and runs nothing.

  The task's workdir is the current directory (SkyPilot syncs it), the experiment is named
  relative to it, setup installs sexpgpu (`pip install -e ".[cuda]"` when the workdir is a
  sexpgpu checkout, else the released package of this version), and run is the point's
  `sexpgpu run` line with SEXPGPU_DEVICE=cuda and `--resume latest` when there is a
  checkpoint location (so a preempted job picks up where it stopped).

  Returns:
    The paths written.
  """
  from importlib.metadata import version
  points = plan(opts)
  cwd = os.getcwd()
  rel = os.path.relpath(os.path.abspath(opts.file), cwd)
  file = rel if not rel.startswith("..") else os.path.abspath(opts.file)
  setup = ('pip install -e ".[cuda]"' if _is_checkout(cwd)
           else f'pip install "sexpgpu[cuda]=={version("sexpgpu")}"')
  local = dataclasses.replace(opts, file=file, device=None)
  resume = checkpoint_location(opts) is not None
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for p in points:
    run_line = run_argv(local, p, resume, program="sexpgpu")
    if opts.trust_python:  # the task's machine has no variable of this shell's
      run_line.insert(-1, "--trust-python")
    argv = ["SEXPGPU_DEVICE=cuda"] + [shlex.quote(a) for a in run_line]
    name = "".join(c if c.isalnum() else "-" for c in p.slug.lower()).strip("-")
    text = "\n".join([
        f"# sexpgpu sweep point {p.slug}",
        f"name: {json.dumps(name[:63])}",
        f"workdir: {json.dumps(cwd)}",
        "resources:",
        f"  accelerators: {json.dumps(accelerators)}",
        "envs:",
        "  SEXPGPU_DEVICE: cuda",
        "setup: |",
        f"  {setup}",
        "run: |",
        "  " + " ".join(argv),
        ""])
    path = os.path.join(out_dir, f"{p.slug}.yaml")
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    written.append(path)
  return written


def _is_checkout(d: str) -> bool:
  try:
    with open(os.path.join(d, "pyproject.toml"), encoding="utf-8") as f:
      return 'name = "sexpgpu"' in f.read()
  except OSError:
    return False

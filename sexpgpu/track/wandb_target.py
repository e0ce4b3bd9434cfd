"""The `wandb:PROJECT[/RUN]` target: one Weights & Biases run per slug, continued on resume."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import sys
from typing import Any, Iterator

from sexpgpu.paths import scrub, scrubbed
from sexpgpu.track.events import images, picture, scalars, texts
from sexpgpu.track.targets import TargetError, quiet_warnings

INSTALL_FIX = "pip install 'sexpgpu[wandb]'"
_SPEC_FIX = ("write wandb:PROJECT or wandb:PROJECT/RUN: a project name without any of "
             "\\ # ? % : and at most 128 characters; the entity comes from WANDB_ENTITY")
_SERVER_FIX = ("check that the W&B server (WANDB_BASE_URL) answers, or set WANDB_MODE=offline "
               "and upload the run later with `wandb sync`")
_KEY_FIX = ("run `wandb login` or set WANDB_API_KEY, or unset WANDB_MODE to log offline "
            "(`wandb sync` uploads the run later)")
# What W&B accepts in a project name (besides `/`, which the spec splits on), and in a run id
# this target makes: [A-Za-z0-9_-], 64 characters at most.
_PROJECT_BAD = "\\#?%:"
_PROJECT_LIMIT = 128
_ID_LIMIT = 64
_ID_BAD = re.compile(r"[^A-Za-z0-9_-]")
_ID_HASH = 8  # hex digits of the name's hash appended when the name itself cannot be the id
# The envelope and the fields a table or the run already shows.
_SUMMARY_SKIP = ("kind", "time", "slug")
_CONFIG_META = ("file", "fingerprint", "device", "ranks", "nodes", "versions", "resume")
SAMPLE_COLUMNS = ["step", "name", "prompt", "text"]
NOTE_COLUMNS = ["step", "name", "text"]
FAILED = 1  # the exit code of a session that ended without a summary (an error)


class WandbTarget:
  """Logs a session to the W&B run whose id is the slug's (or RUN's), in project PROJECT.

  Every event's scalars (step, pass, eval, diagnostic, stage, checkpoint) go to the run's
  history at the event's step, a defgenerate's grids as images there. Samples are rows (step, name, prompt, text) of the
  incremental table `samples`; annotations and the stage and checkpoint lines are rows
  (step, name, text) of the incremental table `annotations`. The config event's knobs are
  the run's config (each knob by name, with `sexpgpu.sources` saying where each value came
  from, and the file, fingerprint, device and versions beside it); the summary event goes to
  the run's summary under `sexpgpu` and sets the exit code `finish` reports: 0, 128 + n after
  stop signal n, 1 when the session ended without a summary.

  The run is resumed (`resume="allow"`) under the same id, so `--resume` continues it. With
  no W&B credentials (WANDB_API_KEY, a `wandb login`, an identity token) the run is written
  offline, for `wandb sync`; files go where W&B puts them: `$WANDB_DIR/wandb/`, else
  `./wandb/`. W&B's own terminal output is off.

  Attributes:
    spec: the target as given.
    location: PROJECT or PROJECT/RUN.
    run_id: the W&B run id.
    name: the W&B run's display name.
    project: the W&B project.
  """

  def __init__(self, spec: str, location: str, slug: str):
    """Starts (or resumes) the W&B run.

    Args:
      spec: the target as given, `wandb:PROJECT[/RUN]`.
      location: PROJECT or PROJECT/RUN.
      slug: the run's slug: the W&B run's name, and its id as `run_id` maps it.

    Raises:
      TargetError: a location that is not PROJECT[/RUN], wandb not installed, WANDB_MODE=online
        without credentials, or a W&B run that cannot start.
    """
    self.spec = spec
    self.location = location
    self.project, run = parse_location(location)
    self.name = run or slug
    self.run_id = run_id(self.name)
    self._exit_code = FAILED
    self._tables: dict[str, Any] = {}
    wandb = _import_wandb()
    with quiet_warnings(), _wandb_errors(self.project), _scrubbed_argv():
      self._run = wandb.init(
          project=self.project, name=self.name, id=self.run_id, resume="allow",
          mode=_mode(wandb), dir=os.environ.get("WANDB_DIR") or None, reinit="create_new",
          settings=wandb.Settings(console="off", silent=True))
      # A resumed online run already holds history up to here; a new or offline run is at 0.
      self._step = int(self._run.step or 0)
    self._wandb = wandb

  def write(self, event: dict) -> None:
    """Logs the event: its scalars at its step, its text as table rows, config, summary."""
    kind = event["kind"]
    with quiet_warnings(), _wandb_errors(self.project):
      if kind == "config":
        self._run.config.update(scrubbed(config_of(event)), allow_val_change=True)
        return
      if kind == "summary":
        self._run.summary["sexpgpu"] = scrubbed(
            {k: v for k, v in event.items() if k not in _SUMMARY_SKIP})
        self._exit_code = exit_code(event.get("stopped_by"))
        return
      step, fresh = self._place(event)
      row: dict[str, Any] = {}
      # A step the W&B run already holds (an online resume from an earlier checkpoint) keeps
      # its values; a checkpoint's numbers describe the save and go at the present step.
      if fresh or kind == "checkpoint":
        row.update(scalars(event))
      for tag, path in images(event):  # a defgenerate's grid
        row[tag] = self._wandb.Image(picture(path))
      if kind == "sample":
        row["samples"] = self._add("samples", SAMPLE_COLUMNS,
                                   [event.get("step"), event.get("name"),
                                    str(event.get("prompt", "")), str(event.get("text", ""))])
      else:
        for tag, text in texts(event):
          row["annotations"] = self._add("annotations", NOTE_COLUMNS,
                                         [event.get("step", step), tag, scrub(text)])
      if row:
        self._run.log(row, step=step)

  def close(self) -> None:
    """Finishes the run with its exit code; what is offline stays in its folder."""
    with quiet_warnings(), _wandb_errors(self.project):
      self._run.finish(exit_code=self._exit_code)

  def _place(self, event: dict) -> tuple[int, bool]:
    """The history step an event is logged at, and whether its own step is new there.

    W&B's history only moves forward: an event without a step, or with one already passed
    (a checkpoint written by a background thread), goes at the latest step.
    """
    step = event.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= self._step:
      self._step = step
      return step, True
    return self._step, not isinstance(step, int)

  def _add(self, key: str, columns: list[str], row: list) -> Any:
    """The incremental table `key` with `row` added: each log sends only the new rows."""
    table = self._tables.get(key)
    if table is None:
      table = self._tables[key] = self._wandb.Table(columns=columns, log_mode="INCREMENTAL",
                                                    allow_mixed_types=True)
    table.add_data(*row)
    return table


def parse_location(location: str) -> tuple[str, str | None]:
  """PROJECT and RUN (None when absent) of `wandb:PROJECT[/RUN]`.

  Args:
    location: what follows `wandb:`.

  Returns:
    (project, run), each stripped of surrounding blanks.

  Raises:
    TargetError: for an empty project or run, a `/` too many, or a project name W&B rejects.
  """
  parts = location.split("/")
  if len(parts) > 2:
    raise TargetError(f"`{location}` has {len(parts) - 1} `/`; a W&B target is PROJECT or "
                      "PROJECT/RUN (the entity comes from WANDB_ENTITY)", _SPEC_FIX)
  project = parts[0].strip()
  run = parts[1].strip() if len(parts) == 2 else None
  if not project:
    raise TargetError(f"`{location}` names no W&B project", _SPEC_FIX)
  if run is not None and not run:
    raise TargetError(f"`{location}` names no run after the `/`", _SPEC_FIX)
  bad = sorted({ch for ch in project if ch in _PROJECT_BAD})
  if bad:
    raise TargetError(f"W&B project `{project}` contains {' '.join(bad)}, which W&B does not "
                      "allow in a project name", _SPEC_FIX)
  if len(project) > _PROJECT_LIMIT:
    raise TargetError(f"W&B project `{project[:40]}…` is {len(project)} characters, over "
                      f"W&B's {_PROJECT_LIMIT}", _SPEC_FIX)
  return project, run


def run_id(name: str) -> str:
  """The W&B run id of a slug or RUN, the same for the same name in every session.

  Args:
    name: the slug, or RUN of `wandb:PROJECT/RUN`.

  Returns:
    The name itself when it is [A-Za-z0-9_-] and at most 64 characters; else the name with
    `_` for every other character, cut, then `-` and 8 hex digits of the name's SHA-256, so
    two names never share an id through the mapping.
  """
  if not _ID_BAD.search(name) and 0 < len(name) <= _ID_LIMIT:
    return name
  digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:_ID_HASH]
  return f"{_ID_BAD.sub('_', name)[:_ID_LIMIT - _ID_HASH - 1]}-{digest}"


def config_of(event: dict) -> dict:
  """The W&B config of a config event.

  Args:
    event: the config event (knobs `{name: {value, source}}`, file, fingerprint, ...).

  Returns:
    Each knob's value by its name (what W&B filters and groups runs by), and under `sexpgpu`
    where each came from (`sources`) with the file, fingerprint, device, ranks, nodes,
    versions and resume.
  """
  knobs = event.get("knobs") or {}
  values = {name: (k.get("value") if isinstance(k, dict) else k) for name, k in knobs.items()}
  sources = {name: k.get("source") for name, k in knobs.items() if isinstance(k, dict)}
  meta = {key: event[key] for key in _CONFIG_META if key in event}
  return {**values, "sexpgpu": {**meta, "sources": sources}}


def exit_code(stopped_by: str | None) -> int:
  """The exit code the W&B run finishes with.

  Args:
    stopped_by: the summary's `stopped_by`: a signal name, or None.

  Returns:
    0 without a stop; 128 + n after stop signal n, as the CLI exits; 1 for a name that is no
    signal.
  """
  if not stopped_by:
    return 0
  try:
    return 128 + signal.Signals[stopped_by].value
  except KeyError:
    return FAILED


def _import_wandb():
  """The wandb module, imported on first use, its terminal output off unless asked."""
  # W&B prints its banner, login and sync lines unless silent; a user's own WANDB_SILENT wins.
  os.environ.setdefault("WANDB_SILENT", "true")
  try:
    with quiet_warnings():
      import wandb
  except ImportError as e:
    raise TargetError("the wandb target needs wandb, which is not installed", INSTALL_FIX) from e
  # wandb's own logger writes each run's logs/debug.log and never the terminal: left as is.
  return wandb


def _mode(wandb) -> str:
  """The W&B mode: WANDB_MODE's offline or disabled; else online with credentials
  (WANDB_API_KEY, a `wandb login`, an identity token), offline without.

  Passed to every `wandb.init`: W&B reads WANDB_MODE once per process, a run here reads it now.

  Raises:
    TargetError: WANDB_MODE=online (or shared) without credentials: W&B would ask for a key
      on the terminal or fail.
  """
  asked = os.environ.get("WANDB_MODE", "").strip().lower()
  if asked in ("offline", "dryrun", "disabled"):
    return "disabled" if asked == "disabled" else "offline"
  if wandb.run is not None:  # this process has a run; login() would only warn
    found = not wandb.run.offline
  else:
    found = wandb.login(prompt=False, verify=False)  # no prompt, no network call
  if found:
    return asked or "online"
  if asked:
    raise TargetError(f"WANDB_MODE={asked}, and W&B has no API key", _KEY_FIX)
  return "offline"


@contextlib.contextmanager
def _scrubbed_argv() -> Iterator[None]:
  """W&B keeps the command line (sys.argv) in its run's metadata, read while the run starts:
  it reads it scrubbed (`--set init-from=s3://K:S@b/x` as `s3://***@b/x`)."""
  kept = sys.argv
  sys.argv = [scrub(a) for a in kept]
  try:
    yield
  finally:
    sys.argv = kept


@contextlib.contextmanager
def _wandb_errors(project: str) -> Iterator[None]:
  """Turns W&B's exceptions into a TargetError naming the project, its key masked."""
  try:
    yield
  except TargetError:
    raise
  except Exception as e:  # wandb raises many types (CommError, UsageError, ...); all one here
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    key = os.environ.get("WANDB_API_KEY")
    if key:
      first = first.replace(key, "***")
    raise TargetError(f"W&B run in project {project} failed: {first}", _SERVER_FIX) from e

"""The `mlflow:URI` target: one experiment per slug, one run per session."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import Any, Iterator

from sexpgpu.track.events import images, picture, scalars, texts
from sexpgpu.track.targets import TargetError, ensure_dir, quiet_warnings

INSTALL_FIX = "pip install sexpgpu[mlflow]"
_URI_FIX = ("give a tracking URI MLflow can use: mlflow:sqlite:///PATH.db, "
            "mlflow:file:DIR or mlflow:http://HOST:PORT")
# MLflow caps tag values; annotations longer than this are cut.
_TAG_LIMIT = 5000
_PARAM_LIMIT = 500
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /]")
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class MlflowTarget:
  """Logs a session as one MLflow run in the experiment named by the slug.

  Params are the config event's knobs; step, pass, diagnostic, stage and
  checkpoint scalars are metrics at their step; a defgenerate's grids are images at their
  step; text (annotations, stage
  and checkpoint lines) goes to tags. The run ends at close: FINISHED, KILLED
  when the summary names `stopped_by`, FAILED when no summary came.
  """

  def __init__(self, spec: str, uri: str, slug: str):
    self.spec = spec
    self.location = uri
    self._step = 0
    self._status = "FAILED"
    client_class = _import_client()
    with quiet_warnings(), _store_errors(uri):
      self._client = client_class(tracking_uri=_prepare(uri))
      experiment = _experiment(self._client, slug, _artifacts(uri))
      run = self._client.create_run(experiment, run_name=slug,
                                    tags={"sexpgpu.slug": slug})
    self.run_id = run.info.run_id

  def write(self, event: dict) -> None:
    """Logs the event's params, metrics and tags to the run."""
    if isinstance(event.get("step"), int):
      self._step = event["step"]
    with quiet_warnings(), _store_errors(self.location):
      if event["kind"] == "config":
        self._log_config(event)
      elif event["kind"] == "summary":
        self._status = "KILLED" if event.get("stopped_by") else "FINISHED"
      else:
        self._log_texts(event)
      self._log_scalars(event)
      for tag, path in images(event):  # a defgenerate's grid, an image at its step
        self._client.log_image(self.run_id, picture(path), key=_key(tag), step=self._step)

  def close(self) -> None:
    """Ends the run with its status."""
    with quiet_warnings(), _store_errors(self.location):
      self._client.set_terminated(self.run_id, self._status)

  def _log_scalars(self, event: dict) -> None:
    from mlflow.entities import Metric
    stamp = int(event["time"] * 1000)
    metrics = [Metric(_key(tag), value, stamp, self._step)
               for tag, value in scalars(event)]
    if metrics:
      self._client.log_batch(self.run_id, metrics=metrics)

  def _log_texts(self, event: dict) -> None:
    from mlflow.entities import RunTag
    tags = [RunTag(_key(tag), text[:_TAG_LIMIT]) for tag, text in texts(event)]
    if tags:
      self._client.log_batch(self.run_id, tags=tags)

  def _log_config(self, event: dict) -> None:
    from mlflow.entities import Param, RunTag
    params = [Param(_key(name), str(_knob_value(knob))[:_PARAM_LIMIT])
              for name, knob in (event.get("knobs") or {}).items()]
    tags = [RunTag(f"sexpgpu.{key}", str(event[key])[:_TAG_LIMIT])
            for key in ("file", "fingerprint", "device", "ranks", "nodes",
                        "resume") if event.get(key) is not None]
    self._client.log_batch(self.run_id, params=params, tags=tags)


def _knob_value(knob: Any) -> Any:
  """A knob's value, from `{value, source}` or as given."""
  return knob.get("value") if isinstance(knob, dict) else knob


def _key(name: str) -> str:
  """A name MLflow accepts as a metric, param or tag key."""
  return _BAD_KEY_CHARS.sub("_", str(name))


def _import_client():
  """MlflowClient, imported on first use with MLflow's own output off."""
  # No usage reporting from inside a training run, unless the user asks.
  os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
  # MLflow's own HTTP retries (7, doubling from 2 s) would hold a dead server's run for
  # minutes: a few quick ones, each request bounded, unless the user set their own.
  for name, value in HTTP_DEFAULTS.items():
    os.environ.setdefault(name, value)
  try:
    with quiet_warnings():
      from mlflow.tracking import MlflowClient
  except ImportError as e:
    raise TargetError("the mlflow target needs MLflow, which is not installed",
                      INSTALL_FIX) from e
  for name in ("mlflow", "alembic", "sqlalchemy"):
    logging.getLogger(name).setLevel(logging.CRITICAL + 1)
  return MlflowClient


def _prepare(uri: str) -> str:
  """The tracking URI, with what a local store needs made ready.

  A `file:` URI or bare directory is MLflow's file store, which MLflow 3 only
  opens when allowed; naming one as the target is that permission. A
  `sqlite:///` database gets its parent directory.
  """
  if "://" not in uri or uri.startswith("file:"):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
  if uri.startswith("sqlite:///"):
    parent = os.path.dirname(uri[len("sqlite:///"):])
    if parent:
      ensure_dir(parent)
  return uri


def _artifacts(uri: str) -> str | None:
  """Where a new experiment of a `sqlite:///PATH.db` store keeps its artifacts (a
  defgenerate's images): `mlartifacts` beside the database, not MLflow's default `./mlruns`
  in whatever folder the run started from; None for other stores (theirs decide)."""
  if not uri.startswith("sqlite:///"):
    return None
  db = os.path.abspath(uri[len("sqlite:///"):])
  return "file://" + os.path.join(os.path.dirname(db), "mlartifacts")


def _experiment(client, slug: str, artifacts: str | None = None) -> str:
  """The id of the experiment named `slug`, created when missing (its artifacts at
  `artifacts`, else where the store puts them)."""
  found = client.get_experiment_by_name(slug)
  if found is not None:
    return found.experiment_id
  try:
    return client.create_experiment(slug, artifact_location=artifacts)
  except Exception:
    # Another session of the same slug may have created it meanwhile.
    found = client.get_experiment_by_name(slug)
    if found is None:
      raise
    return found.experiment_id


@contextlib.contextmanager
def _store_errors(uri: str) -> Iterator[None]:
  """Turns MLflow's and the store's exceptions into a TargetError."""
  try:
    yield
  except TargetError:
    raise
  except ImportError as e:
    raise TargetError(f"MLflow cannot use {uri}: {e}", INSTALL_FIX) from e
  except Exception as e:  # MLflow raises many types; all mean the same here.
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise TargetError(f"MLflow store {uri} failed: {first}", _URI_FIX) from e

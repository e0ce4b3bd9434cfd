"""The `tensorboard:DIR` target: event files under `DIR/<slug>/`."""

from __future__ import annotations

import logging
import os
import warnings

from sexpgpu.track.events import images, picture, scalars, texts
from sexpgpu.track.targets import TargetError, ensure_dir, os_reason

# Seconds between tensorboardX's background flushes; close flushes the rest.
_FLUSH_SECS = 5


class TensorBoardTarget:
  """Writes scalars, text and images through tensorboardX, one log dir per slug.

  Events without a step (config, annotations) are placed at the last step
  seen, 0 before the first.
  """

  def __init__(self, spec: str, directory: str, slug: str):
    self.spec = spec
    self.location = directory
    self.logdir = os.path.join(directory, slug)
    self._step = 0
    try:
      ensure_dir(self.logdir)
    except OSError as e:
      raise TargetError(f"cannot create TensorBoard directory {self.logdir}: "
                        f"{os_reason(e)}",
                        "give a directory you can write") from e
    self._writer = _open_writer(self.logdir)

  def write(self, event: dict) -> None:
    """Adds the event's scalars, text and images (a defgenerate's grids) at its step."""
    if isinstance(event.get("step"), int):
      self._step = event["step"]
    walltime = event.get("time")
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      for tag, value in scalars(event):
        self._writer.add_scalar(tag, value, self._step, walltime=walltime)
      for tag, text in texts(event):
        self._writer.add_text(tag, text, self._step, walltime=walltime)
      for tag, path in images(event):
        self._writer.add_image(tag, picture(path), self._step, walltime=walltime,
                               dataformats="HWC")

  def close(self) -> None:
    """Flushes and closes the event file."""
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      self._writer.close()


def _open_writer(logdir: str):
  """A tensorboardX SummaryWriter with its own logging kept off stderr."""
  logging.getLogger("tensorboardX").setLevel(logging.CRITICAL + 1)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      from tensorboardX import SummaryWriter
    except ImportError as e:
      raise TargetError("tensorboardX is not installed",
                        "pip install tensorboardX") from e
    try:
      return SummaryWriter(logdir=logdir, flush_secs=_FLUSH_SECS)
    except OSError as e:
      raise TargetError(f"cannot open TensorBoard log {logdir}: "
                        f"{os_reason(e)}",
                        "give a directory you can write") from e

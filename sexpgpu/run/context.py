"""What the loop's helpers read: the run's configuration and where its outputs go."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
  from sexpgpu.run.compile import Compiled
  from sexpgpu.run.loop import RunOptions
  from sexpgpu.run.progress import Progress
  from sexpgpu.run.training import Training


@dataclasses.dataclass(frozen=True)
class Outputs:
  """Where a run's numbers and lines go (the objects themselves change as the run goes;
  which objects they are does not)."""

  progress: Progress  # the status file, the counters, step and pass times, the summary's numbers
  metrics: Any  # the metrics stream's targets (track.Metrics)
  log: Callable[[str], None]  # a line of standard error (nothing under the API's quiet)


@dataclasses.dataclass(frozen=True)
class RunContext:
  """One run as its helpers see it: the compiled experiment and what `run` was asked (its
  configuration), its Training (steps and placement), and its Outputs."""

  c: Compiled
  o: RunOptions
  training: Training
  out: Outputs

  @property
  def place(self):
    """The run's Placement (its devices)."""
    return self.training.place

"""Run tracking: metrics targets (jsonl, TensorBoard, MLflow) and the status file."""

from sexpgpu.track.metrics import Metrics, open_metrics
from sexpgpu.track.status import STATES, StatusFile, read_status

__all__ = ["Metrics", "STATES", "StatusFile", "open_metrics", "read_status"]

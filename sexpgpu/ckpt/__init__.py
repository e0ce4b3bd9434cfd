"""Checkpoints: orbax locally, orbax plus a committed upload on s3:// and gs://."""

from sexpgpu.ckpt.restore import peek_meta, read_meta, resolve_resume, restore_checkpoint
from sexpgpu.ckpt.store import CheckpointInfo, CheckpointStore

__all__ = ["CheckpointInfo", "CheckpointStore", "read_meta", "resolve_resume",
           "restore_checkpoint"]

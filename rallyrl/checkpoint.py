"""Compatibility: the checkpoint files are ``rallyrl.run.checkpoint`` now (atomic save, verify, resume
choice, load). Import from there in new code; these names keep working."""

from __future__ import annotations

from .errors import CheckpointError
from .run.checkpoint import (FORMAT_VERSION, SHARDED_DIR, checkpoint_dir, join_tensors, list_checkpoints,
                             load_checkpoint, resolve_resume, save_checkpoint, split_tensors, verify_checkpoint)

__all__ = ["FORMAT_VERSION", "SHARDED_DIR", "CheckpointError", "checkpoint_dir", "join_tensors", "list_checkpoints", "load_checkpoint",
           "resolve_resume", "save_checkpoint", "split_tensors", "verify_checkpoint"]

"""World-size-independent, crash-safe checkpoints (safetensors + a JSON index)."""

from moeflow.checkpoint.io import (
    FORMAT,
    CheckpointError,
    complete_checkpoints,
    describe_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    partial_checkpoints,
    read_index,
    reshard_checkpoint,
    save_checkpoint,
)
from moeflow.checkpoint.background import PendingSave, save_checkpoint_async

__all__ = [
    "save_checkpoint",
    "save_checkpoint_async",
    "PendingSave",
    "load_checkpoint",
    "complete_checkpoints",
    "latest_checkpoint",
    "partial_checkpoints",
    "read_index",
    "describe_checkpoint",
    "reshard_checkpoint",
    "CheckpointError",
    "FORMAT",
]

"""Megatron-core checkpoints on any store: ``dist_checkpointing`` save/load to a URL.

    from cloudckpt import megatron as ckpt

    ckpt.save(model.sharded_state_dict(), "s3://bucket/run1/iter_0001000")
    state = ckpt.load(model.sharded_state_dict(), "s3://bucket/run1/iter_0001000")
    model.load_state_dict(state)

The layout is megatron-core's ``torch_dist`` checkpoint, so a checkpoint written here
loads with megatron's own ``dist_checkpointing.load`` after a plain copy, and one
megatron wrote (locally and uploaded, or with multi-storage-client) loads here. Needs
megatron-core >= 0.15 (docs/megatron.md).
"""

from __future__ import annotations

from .load import (
    is_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
)
from .save import DistributedSaveError, MegatronSaveHandle, save

__all__ = [
    "DistributedSaveError",
    "MegatronSaveHandle",
    "is_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "save",
]

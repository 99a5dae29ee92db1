"""Sharded checkpoints with torch.distributed.checkpoint (DCP) on any cloudckpt store.

    import torch.distributed.checkpoint as dcp
    from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

    dcp.save(state, storage_writer=CloudStorageWriter("s3://bucket/run1/step-100"))
    dcp.load(state, storage_reader=CloudStorageReader("s3://bucket/run1/step-100"))

The layout is ``FileSystemWriter``'s (a downloaded copy loads with ``FileSystemReader``,
and an uploaded ``FileSystemWriter`` directory loads with ``CloudStorageReader``);
``.metadata`` is written last and is the commit marker. See docs/dcp.md.
"""

from __future__ import annotations

from .reader import CloudStorageReader
from .writer import CloudStorageWriter

__all__ = ["CloudStorageReader", "CloudStorageWriter"]

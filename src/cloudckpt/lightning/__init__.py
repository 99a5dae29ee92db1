"""Lightning integration: checkpoint I/O and a ``ModelCheckpoint`` for remote dirpaths.

    from cloudckpt.lightning import CloudCheckpointIO, CloudModelCheckpoint

    trainer = Trainer(
        plugins=[CloudCheckpointIO(async_save=True)],
        callbacks=[CloudModelCheckpoint(dirpath="s3://bucket/run1", save_top_k=2,
                                        monitor="val_loss", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")

``CloudFSDPStrategy`` and ``CloudModelParallelStrategy`` (and Fabric's
``CloudFabricFSDPStrategy``, ``CloudFabricModelParallelStrategy``) write the sharded
checkpoints of those strategies through cloudckpt's DCP writer. See docs/lightning.md.
"""

from __future__ import annotations

from .callback import CloudModelCheckpoint
from .checkpoint_io import CloudCheckpointIO
from .fabric import CloudFabricFSDPStrategy, CloudFabricModelParallelStrategy
from .fs import CloudFileSystem
from .strategies import CloudFSDPStrategy, CloudModelParallelStrategy

__all__ = [
    "CloudCheckpointIO",
    "CloudFSDPStrategy",
    "CloudFabricFSDPStrategy",
    "CloudFabricModelParallelStrategy",
    "CloudFileSystem",
    "CloudModelCheckpoint",
    "CloudModelParallelStrategy",
]

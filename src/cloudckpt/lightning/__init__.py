"""Lightning integration: checkpoint I/O and a ``ModelCheckpoint`` for remote dirpaths.

    from cloudckpt.lightning import CloudCheckpointIO, CloudModelCheckpoint

    trainer = Trainer(
        plugins=[CloudCheckpointIO(async_save=True)],
        callbacks=[CloudModelCheckpoint(dirpath="s3://bucket/run1", save_top_k=2,
                                        monitor="val_loss", save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")

See docs/lightning.md.
"""

from __future__ import annotations

from .callback import CloudModelCheckpoint
from .checkpoint_io import CloudCheckpointIO
from .fs import CloudFileSystem

__all__ = ["CloudCheckpointIO", "CloudFileSystem", "CloudModelCheckpoint"]

"""NeMo 2 checkpoints on object storage: a NeMo recipe with ``s3://`` (gs://, az://).

    import nemo_run as run
    from cloudckpt import nemo as cn

    recipe = llm.llama3_8b.pretrain_recipe(dir="/local/logs", ...)
    ckpt_dir = "s3://bucket/run1/checkpoints"
    recipe.trainer.strategy.checkpoint_io = run.Config(
        cn.cloud_checkpoint_io, async_save=recipe.trainer.strategy.ckpt_async_save)
    recipe.log.ckpt.__fn_or_cls__ = cn.CloudModelCheckpoint
    recipe.log.ckpt.dirpath = ckpt_dir
    recipe.resume = run.Config(cn.CloudAutoResume, resume_if_exists=True,
                               resume_ignore_no_checkpoint=True)

- :func:`cloud_checkpoint_io` -> :class:`CloudMegatronCheckpointIO` (NeMo's
  ``MegatronCheckpointIO`` through :mod:`cloudckpt.megatron`), wrapped for async saves
  in :class:`CloudAsyncFinalizableCheckpointIO`;
- :class:`CloudModelCheckpoint`: NeMo's ``ModelCheckpoint`` with markers, top-k and
  ``last`` removal and the context dump on the store;
- :class:`CloudAutoResume`, :func:`latest_checkpoint`: the newest committed checkpoint.

NeMo is imported when one of these names is first used; without NeMo 2 that raises
ImportError naming the package. See docs/megatron.md (NeMo 2).
"""

from __future__ import annotations

from .._lazy import imported, lazy_attributes

__all__ = [
    "CheckpointEntry",
    "CloudAsyncFinalizableCheckpointIO",
    "CloudAutoResume",
    "CloudMegatronCheckpointIO",
    "CloudModelCheckpoint",
    "cloud_checkpoint_io",
    "latest_checkpoint",
    "list_checkpoints",
]

_WHERE = {
    "CheckpointEntry": "resume",
    "CloudAsyncFinalizableCheckpointIO": "checkpoint_io",
    "CloudAutoResume": "resume",
    "CloudMegatronCheckpointIO": "checkpoint_io",
    "CloudModelCheckpoint": "callback",
    "cloud_checkpoint_io": "checkpoint_io",
    "latest_checkpoint": "resume",
    "list_checkpoints": "resume",
}


__getattr__, __dir__ = lazy_attributes(
    globals(), {name: imported(f".{at}", __name__, name) for name, at in _WHERE.items()}, __all__
)

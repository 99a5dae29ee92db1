"""``CloudModelCheckpoint``: NeMo 2's ``ModelCheckpoint`` for remote ``dirpath`` URLs.

A drop-in subclass of ``nemo.lightning.pytorch.callbacks.ModelCheckpoint``; with a
local ``dirpath`` it is NeMo's class unchanged. NeMo's own does its file work with
``pathlib``, ``os`` and ``shutil`` (markers, cleanup, top-k bookkeeping, removals, the
context dump), so with ``s3://...`` it writes markers and contexts into local
``s3:/...`` folders and never deletes a remote checkpoint. With a URL this class does
the same steps on the store:

- the ``<name>-unfinished`` markers are objects (set before a save or a removal,
  cleared when it is finalized); ``setup`` deletes marked checkpoints, as NeMo does;
- top-k and ``last`` rotation delete the whole remote checkpoint (commit marker
  first), after the newer save was finalized when saving asynchronously; the
  checkpoint the run resumed from is only deleted by a newer ``-last``;
- the trainer context is dumped to a local temporary folder and uploaded to
  ``<checkpoint>/context/`` before the weights are saved.

Not supported with a URL: ``save_last="link"`` (object stores have no links).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..lightning.fs import CloudFileSystem, is_remote, remote_dirpath, setup_remote_dirpath
from ..options import TransferOptions
from ..ranks.collectives import barrier, on_first
from ._compat import ModelCheckpoint, is_global_rank_zero
from .checkpoint_io import trainer_io
from .paths import (
    CONTEXT,
    UNFINISHED_SUFFIX,
    as_url,
    checkpoint_dir,
    children,
    has_objects,
    marker_url,
    object_exists,
    remove_object,
    remove_tree,
    touch,
    upload_tree,
)

__all__ = ["CloudModelCheckpoint"]


class CloudModelCheckpoint(ModelCheckpoint):  # type: ignore[misc]
    """NeMo's ``ModelCheckpoint`` whose ``dirpath`` may be an ``s3://`` (or other) URL.

    ``options`` and ``storage_options`` reach the store for the callback's own work
    (markers, listings, removals); the weights themselves are written by the strategy's
    checkpoint I/O (:func:`cloudckpt.nemo.cloud_checkpoint_io`).
    """

    # Set by NeMo's and Lightning's constructors (declared for the type checker).
    best_k_models: dict[str, Any]
    always_save_context: bool
    save_context_on_train_end: bool

    def __init__(
        self,
        *args: Any,
        dirpath: Any = None,
        options: TransferOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        url = remote_dirpath(dirpath, options, storage_options)
        super().__init__(*args, dirpath=dirpath if url is None else None, **kwargs)
        self._remote = url is not None
        if url is not None:
            self.dirpath, self._fs = url, CloudFileSystem()

    # -- markers (NeMo's static methods, for URLs) ----------------------------------------
    @staticmethod
    def format_checkpoint_unfinished_marker_path(checkpoint_path: Any) -> Any:
        if not is_remote(checkpoint_path):
            return ModelCheckpoint.format_checkpoint_unfinished_marker_path(checkpoint_path)
        return marker_url(checkpoint_path)

    @staticmethod
    def is_checkpoint_unfinished(checkpoint_path: Any) -> bool:
        if not is_remote(checkpoint_path):
            return bool(ModelCheckpoint.is_checkpoint_unfinished(checkpoint_path))
        return object_exists(marker_url(checkpoint_path))

    @staticmethod
    def set_checkpoint_unfinished_marker(checkpoint_path: Any, barrier_after: bool = False) -> None:
        if not is_remote(checkpoint_path):
            ModelCheckpoint.set_checkpoint_unfinished_marker(checkpoint_path, barrier_after)
            return
        if is_global_rank_zero():
            touch(marker_url(checkpoint_path))
        if barrier_after:
            barrier()

    @staticmethod
    def remove_checkpoint_unfinished_marker(
        checkpoint_path: Any, barrier_before: bool = False
    ) -> None:
        if not is_remote(checkpoint_path):
            ModelCheckpoint.remove_checkpoint_unfinished_marker(checkpoint_path, barrier_before)
            return
        if barrier_before:
            barrier()
        if is_global_rank_zero():
            remove_object(marker_url(checkpoint_path))

    # -- setup: NeMo's cleanup of unfinished checkpoints, on the store ---------------------
    def setup(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if not self._remote:
            super().setup(trainer, *args, **kwargs)
            return
        setup_remote_dirpath(self, trainer)
        if is_global_rank_zero():
            self._remove_unfinished_remote()
        barrier()
        self.async_save = getattr(trainer.strategy, "async_save", False)

    def _remove_unfinished_remote(self) -> None:
        """Delete every checkpoint that has an unfinished marker, then the markers."""
        dirs, files = children(str(self.dirpath))
        for name in files:
            if name.endswith(UNFINISHED_SUFFIX):
                stem = name.removesuffix(UNFINISHED_SUFFIX)
                for candidate in (stem, stem + "-EMA"):
                    if candidate in dirs:
                        remove_tree(f"{self.dirpath}/{candidate}")
                remove_object(f"{self.dirpath}/{name}")

    # -- top-k bookkeeping and removal ----------------------------------------------------
    @property
    def _saved_checkpoint_paths(self) -> Any:
        if not self._remote:
            return super()._saved_checkpoint_paths

        def finished() -> list[str]:
            dirs, files = children(str(self.dirpath))
            return [
                f"{self.dirpath}/{name}"
                for name in sorted(dirs)
                if name.removesuffix("-EMA") + UNFINISHED_SUFFIX not in files
            ]

        return on_first(finished)

    def _remove_invalid_entries_from_topk(self) -> None:
        if not self._remote:
            super()._remove_invalid_entries_from_topk()
            return

        def valid() -> set[str]:
            return {
                k
                for k in self.best_k_models
                if has_objects(checkpoint_dir(k)) and not self.is_checkpoint_unfinished(k)
            }

        ok = on_first(valid)
        self.best_k_models = {k: v for k, v in self.best_k_models.items() if k in ok}
        if self.best_k_models:
            scores = self.best_k_models
            ordered = sorted(scores, key=lambda k: scores[k], reverse=self.mode != "min")
            self.kth_best_model_path = ordered[-1]
            self.kth_value = self.best_k_models[self.kth_best_model_path]
            self.best_model_path = ordered[0]
            self.best_model_score = self.best_k_models[self.best_model_path]
        else:
            self.kth_best_model_path, self.kth_value = "", None
            self.best_model_path, self.best_model_score = "", None

    def _del_model_without_trainer(self, filepath: str) -> None:
        if not self._remote:
            super()._del_model_without_trainer(filepath)
            return
        if is_global_rank_zero():
            remove_tree(checkpoint_dir(filepath))
        barrier()

    def _remove_checkpoint(self, trainer: Any, filepath: str, override_async: bool = False) -> None:
        if not self._remote:
            super()._remove_checkpoint(trainer, filepath, override_async)
            return
        if self.async_save and not override_async:
            # As NeMo: removed when the save that is in flight is finalized.
            if not self.deferred_ckpts_to_remove:
                self.deferred_ckpts_to_remove.append([])
            self.deferred_ckpts_to_remove[-1].append(filepath)
            return
        self.set_checkpoint_unfinished_marker(filepath, barrier_after=True)
        if is_global_rank_zero():
            _remove(trainer, filepath)
            if self._ema_callback(trainer) is not None:
                _remove(trainer, self._ema_format_filepath(filepath))
        self.remove_checkpoint_unfinished_marker(filepath, barrier_before=True)

    def _should_remove_checkpoint(self, trainer: Any, previous: str, current: str) -> bool:
        if not self._remote:
            return bool(super()._should_remove_checkpoint(trainer, previous, current))
        old, new = checkpoint_dir(previous), checkpoint_dir(current)
        if old == new or not old.startswith(f"{self.dirpath}/"):
            return False
        resumed = checkpoint_dir(trainer.ckpt_path) if trainer.ckpt_path else None
        # The checkpoint the run resumed from goes only when a newer -last replaces it.
        return old != resumed or (old.endswith("-last") and new.endswith("-last"))

    def file_exists(self, filepath: str, trainer: Any, check_dist_ckpt: bool = True) -> bool:
        if not self._remote:
            return bool(super().file_exists(filepath, trainer, check_dist_ckpt))
        url = as_url(filepath)
        exists = object_exists(url) or (check_dist_ckpt and has_objects(checkpoint_dir(url)))
        return bool(trainer.strategy.broadcast(exists))

    # -- the trainer context ---------------------------------------------------------------
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        if not self._remote or not self.always_save_context:
            super()._save_checkpoint(trainer, filepath)
            return
        # Marker, context, then the weights (NeMo dumps the context after them, locally).
        self.set_checkpoint_unfinished_marker(filepath, barrier_after=True)
        if is_global_rank_zero():
            self._upload_context(trainer, filepath)
        self.always_save_context = False
        try:
            super()._save_checkpoint(trainer, filepath)
        finally:
            self.always_save_context = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        dump = self._remote and self.save_context_on_train_end and not self.always_save_context
        if not dump:
            super().on_train_end(trainer, pl_module)
            return
        self.save_context_on_train_end = False
        try:
            super().on_train_end(trainer, pl_module)
        finally:
            self.save_context_on_train_end = True
        if self.last_model_path and is_global_rank_zero() and not trainer.fast_dev_run:
            self._upload_context(trainer, self.last_model_path)

    def _upload_context(self, trainer: Any, filepath: str) -> None:
        """NeMo's ``TrainerContext.io_dump``, to ``<checkpoint>/context/`` (errors logged)."""
        from nemo.lightning.io.pl import TrainerContext
        from nemo.utils import logging as nemo_logging

        target = f"{checkpoint_dir(filepath)}/{CONTEXT}"
        try:
            with tempfile.TemporaryDirectory(prefix="cloudckpt-nemo-context-") as tmp:
                local = Path(tmp) / CONTEXT
                TrainerContext.from_trainer(trainer).io_dump(local, yaml_attrs=["model"])
                upload_tree(local, target)
        except Exception as exc:  # NeMo's own context dump only logs its failures too
            nemo_logging.warning(
                f"Failed to dump training context for checkpoint {filepath}: {exc}"
            )


def _remove(trainer: Any, filepath: str) -> None:
    """Delete a remote checkpoint: through the strategy's CloudMegatronCheckpointIO when
    it has one (which never races its local tier's drain of it), else directly."""
    io = trainer_io(trainer)
    if io is not None:
        io.remove_checkpoint(filepath)
    else:
        remove_tree(checkpoint_dir(filepath))

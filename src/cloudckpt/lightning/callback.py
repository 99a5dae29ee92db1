"""``CloudModelCheckpoint``: Lightning's ``ModelCheckpoint`` for remote ``dirpath`` URLs.

A drop-in subclass. With a local ``dirpath`` it is ``ModelCheckpoint`` unchanged. With
a URL (``s3://...``) it uses cloudckpt for everything Lightning does through fsspec:

- listing and existence checks go through cloudckpt's stores (no s3fs needed);
- ``trainer.fit(ckpt_path="last")`` finds the newest committed ``last*.ckpt`` with one
  narrow listing of ``DIRPATH/last``; with ``torch.distributed`` initialized only rank 0
  lists and broadcasts the answer;
- top-k and ``last`` rotation never delete the checkpoint the run resumed from, nor
  anything outside ``dirpath``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..options import TransferOptions, resolve_options
from ._compat import ModelCheckpoint
from .fs import CloudFileSystem, register_options, target_for, unwrap, wrap

__all__ = ["CloudModelCheckpoint", "is_remote"]


def is_remote(path: Any) -> bool:
    """True for object-store URLs (anything with a scheme other than ``file``)."""
    text = unwrap(path) if path is not None else ""
    return "://" in text and not text.startswith("file://")


def _broadcast_from_rank0(value: Any) -> Any:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


class CloudModelCheckpoint(ModelCheckpoint):  # type: ignore[misc]
    """``ModelCheckpoint`` whose ``dirpath`` may be an ``s3://`` (or other cloudckpt) URL."""

    def __init__(
        self,
        dirpath: Any = None,
        *args: Any,
        options: TransferOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        remote = is_remote(dirpath)
        super().__init__(None if remote else dirpath, *args, **kwargs)
        self._remote = remote
        settings = {"storage_options": storage_options} if storage_options else {}
        resolve_options(options, **settings)  # a bad option fails here, not at the first save
        if remote:
            self.dirpath = unwrap(dirpath).rstrip("/")
            self._fs = CloudFileSystem()
            register_options(self.dirpath, options, **settings)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self._remote:
            super().setup(trainer, pl_module, stage)
            return
        self.dirpath = trainer.strategy.broadcast(self.dirpath)
        self._fs = CloudFileSystem()
        if self.save_last == "link":
            raise ValueError(
                f"save_last='link' needs a local dirpath; {self.dirpath} is an object store"
            )

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        if not self._remote:
            return set(super()._find_last_checkpoints(trainer))
        is_zero = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        is_zero = is_zero or torch.distributed.get_rank() == 0
        found: list[str] = []
        if is_zero:
            where = target_for(str(self.dirpath))
            store, key = where.store, where.key
            pattern = re.compile(
                rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-v?\d+)?{re.escape(self.FILE_EXTENSION)}$"
            )
            base = key.rstrip("/") + "/"
            for obj in store.list(base + self.CHECKPOINT_NAME_LAST):
                name = obj.key[len(base) :]
                if "/" not in name and pattern.match(name):
                    found.append(wrap(f"{self.dirpath}/{name}"))
        return set(_broadcast_from_rank0(found))

    def _should_remove_checkpoint(self, trainer: Any, previous: str, current: str) -> bool:
        if not self._remote:
            return bool(super()._should_remove_checkpoint(trainer, previous, current))
        previous, current = unwrap(previous), unwrap(current)
        if previous == current:
            return False
        resumed = unwrap(trainer.ckpt_path) if trainer.ckpt_path else None
        if resumed is not None and previous == resumed:
            return False
        return previous.startswith(str(self.dirpath).rstrip("/") + "/")

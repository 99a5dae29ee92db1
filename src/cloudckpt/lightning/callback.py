"""``CloudModelCheckpoint``: Lightning's ``ModelCheckpoint`` for remote ``dirpath`` URLs.

A drop-in subclass. With a local ``dirpath`` it is ``ModelCheckpoint`` unchanged. With
a URL (``s3://...``) it uses cloudckpt for everything Lightning does through fsspec:

- listing and existence checks go through cloudckpt's stores (no s3fs needed);
- ``trainer.fit(ckpt_path="last")`` finds the newest committed ``last*.ckpt`` (an
  object, or a sharded checkpoint's prefix holding its ``.metadata``) with one
  narrow listing of ``DIRPATH/last``; with ``torch.distributed`` initialized only rank 0
  lists and broadcasts the answer;
- top-k and ``last`` rotation never delete the checkpoint the run resumed from, nor
  anything outside ``dirpath``.
"""

from __future__ import annotations

import re
from typing import Any

from ..format.commit import DCP_MARKER
from ..options import TransferOptions
from ..ranks.collectives import on_first
from ._compat import ModelCheckpoint
from .fs import (
    CloudFileSystem,
    is_remote,
    remote_dirpath,
    setup_remote_dirpath,
    target_for,
    unwrap,
    wrap,
)

__all__ = ["CloudModelCheckpoint", "is_remote"]


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
        url = remote_dirpath(dirpath, options, storage_options)
        super().__init__(dirpath if url is None else None, *args, **kwargs)
        self._remote = url is not None
        if url is not None:
            self.dirpath, self._fs = url, CloudFileSystem()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self._remote:
            super().setup(trainer, pl_module, stage)
            return
        setup_remote_dirpath(self, trainer)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        if not self._remote:
            return set(super()._find_last_checkpoints(trainer))

        def scan() -> list[str]:  # rank 0 lists, every rank gets its answer
            found: list[str] = []
            where = target_for(str(self.dirpath))
            store, key = where.store, where.key
            pattern = re.compile(
                rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-v?\d+)?{re.escape(self.FILE_EXTENSION)}$"
            )
            base = key.rstrip("/") + "/"
            for obj in store.list(base + self.CHECKPOINT_NAME_LAST):
                name, _, inside = obj.key[len(base) :].partition("/")
                # One object, or a sharded checkpoint's prefix once its marker is there.
                if inside in ("", DCP_MARKER) and pattern.match(name):
                    found.append(wrap(f"{self.dirpath}/{name}"))
            return found

        return set(on_first(scan, what=f"the listing of {self.dirpath}/last"))

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

"""``CloudModelCheckpoint``: Lightning's ``ModelCheckpoint`` for remote ``dirpath`` URLs.

A drop-in subclass. With a local ``dirpath`` it is ``ModelCheckpoint`` unchanged. With
a URL (``s3://...``) it uses cloudckpt for everything Lightning does through fsspec:

- listing and existence checks go through cloudckpt's stores (no s3fs needed);
- ``trainer.fit(ckpt_path="last")`` finds the newest committed ``last*.ckpt`` (an
  object, or a sharded checkpoint's prefix holding its ``.metadata``) with one
  narrow listing of ``DIRPATH/last``; with ``torch.distributed`` initialized only rank 0
  lists and broadcasts the answer;
- top-k and ``last`` rotation never delete the checkpoint the run resumed from, nor
  anything outside ``dirpath``;
- with a :class:`~cloudckpt.lightning.CloudCheckpointIO` whose local tier serves
  ``dirpath``, Lightning's version counter (``enable_version_counter=True``: "does this
  name exist?" before every save) is answered by the IO from one listing taken at
  setup and the saves and removals since, so no save waits for the bucket; a file an
  earlier run left there still gets its ``-v1``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..format.commit import DCP_MARKER
from ..options import TransferOptions
from ..ranks.collectives import on_first
from ._compat import ModelCheckpoint
from .checkpoint_io import CloudCheckpointIO
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
        #: Set at setup (on every rank) when a local tier answers :meth:`file_exists`.
        self._tier_names: Callable[[Any], bool | None] | None = None
        if url is not None:
            self.dirpath, self._fs = url, CloudFileSystem()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self._remote:
            super().setup(trainer, pl_module, stage)
            return
        setup_remote_dirpath(self, trainer)
        self._tier_names = None
        io = _checkpoint_io(trainer)
        if isinstance(io, CloudCheckpointIO) and io.local_dir is not None:  # on every rank
            holds = io.tier_names(self.dirpath) if trainer.is_global_zero else None
            if trainer.strategy.broadcast(holds is not None):
                self._tier_names = holds or _rank_zero_answers

    def file_exists(self, filepath: Any, trainer: Any) -> bool:
        """Whether ``filepath`` exists (Lightning's version counter, before each save):
        rank 0's answer on every rank. With a local tier serving ``dirpath``, from the
        IO's listing taken at setup and the saves and removals since (no bucket request);
        else Lightning's check, through :class:`CloudFileSystem`."""
        holds = self._tier_names
        if holds is None:
            return bool(super().file_exists(filepath, trainer))
        known = holds(filepath)
        if known is None:  # outside dirpath: only the bucket knows
            known = bool(self._fs.exists(filepath))
        return bool(trainer.strategy.broadcast(known))

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


def _checkpoint_io(trainer: Any) -> Any:
    """The trainer's checkpoint IO, inside any of Lightning's wrappers of it."""
    io: Any = getattr(trainer.strategy, "checkpoint_io", None)
    for _ in range(8):  # a wrapper's wrapped IO (a few levels at most)
        if isinstance(io, CloudCheckpointIO) or not hasattr(io, "checkpoint_io"):
            break
        io = io.checkpoint_io
    return io


def _rank_zero_answers(path: Any) -> bool:
    """A rank other than 0: rank 0's answer is broadcast (this one is not used)."""
    return False

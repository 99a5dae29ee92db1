"""``CloudCheckpointIO``: Lightning's checkpoint I/O on cloudckpt, synchronous or async.

Use with any strategy: ``Trainer(plugins=[CloudCheckpointIO(async_save=True)])`` or
``strategy=DDPStrategy(checkpoint_io=CloudCheckpointIO(...))`` (NeMo's recipe).
In async mode ``save_checkpoint`` returns once the snapshot is taken. Removals that
Lightning asks for (top-k, ``last`` rotation) wait until every earlier save has
committed, and are skipped if one of them failed, so the last good checkpoint is
never the one deleted.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..engine.async_save import SaveHandle, async_save
from ..engine.load import load
from ..engine.save import save
from ..options import TransferOptions
from ..store import Settings
from ._compat import CheckpointIO
from .fs import register_settings, unwrap

__all__ = ["CloudCheckpointIO"]

log = logging.getLogger("cloudckpt")


class CloudCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Save, load and remove Lightning checkpoints at any cloudckpt URL (or local path)."""

    def __init__(
        self,
        async_save: bool = False,
        *,
        max_in_flight: int = 1,
        share_reads: bool = True,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.async_save = async_save
        self.max_in_flight = max_in_flight
        #: Under an initialized process group, every rank loads a checkpoint at once
        #: (Lightning's resume): read its bytes once in all and exchange them.
        self.share_reads = share_reads
        # Checked here (a bad option fails now, not at the first save) and resolved
        # once per call for its path, so a profile the path selects still applies.
        self._settings = Settings(options, overrides)
        register_settings("", self._settings)  # for the callback's listings and removals
        self._pending: list[SaveHandle] = []
        self._removals: list[Future[None]] = []
        self._remover: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- save ----------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path``; in async mode return once it is staged.

        ``storage_options`` (Lightning's per-call argument) are TransferOptions fields
        over the ones this IO was made with."""
        target = self._settings.open(unwrap(path), **(storage_options or {}))
        if not self.async_save:
            save(checkpoint, target)
            return
        handle = async_save(checkpoint, target, max_in_flight=self.max_in_flight)
        with self._lock:
            self._pending = [h for h in self._pending if not h.done() or h.failed()] + [handle]

    # -- load ----------------------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint; waits for a pending save of the same path first. Under
        an initialized process group (every rank resumes), the ranks read its bytes once
        in all and exchange them (``share_reads``; see ``cloudckpt.load(share=True)``)."""
        target = self._settings.open(unwrap(path))
        for h in self._pending_handles():
            if h.url == target.store.url(target.key):
                h.result()
        result: dict[str, Any] = load(
            target,
            map_location=map_location,
            weights_only=True if weights_only is None else weights_only,
            share=self.share_reads,
        )
        return result

    # -- remove --------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path``, but only after every earlier save has committed."""
        url = unwrap(path)
        with self._lock:  # still running, or failed: either way the removal must wait
            earlier = [h for h in self._pending if not h.done() or h.failed()]
        if not earlier:
            self._delete(url)
            return
        with self._lock:
            if self._remover is None:
                self._remover = ThreadPoolExecutor(1, thread_name_prefix="cloudckpt-remove")
            self._removals.append(self._remover.submit(self._delete_after, url, earlier))

    def _delete_after(self, url: str, earlier: list[SaveHandle]) -> None:
        for h in earlier:
            h.wait()
        failed = [h.url for h in earlier if h.failed()]
        if failed:
            log.warning(
                "not removing %s: the newer checkpoint(s) %s did not commit", url, ", ".join(failed)
            )
            return
        self._delete(url)

    def _delete(self, url: str) -> None:
        target = self._settings.open(url)
        target.store.delete(target.key)  # absent already is fine

    def _pending_handles(self) -> list[SaveHandle]:
        with self._lock:
            return [h for h in self._pending if not h.done()]

    # -- teardown ------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every pending save and removal; raise the first save error."""
        with self._lock:
            handles, self._pending = list(self._pending), []
            removals, self._removals = list(self._removals), []
        error: BaseException | None = None
        for h in handles:
            h.wait()
            if error is None and h.failed() and not h.reported:
                error = h.exception()
        for f in removals:
            f.result()
        if error is not None:
            raise error

    def teardown(self) -> None:
        """Called by Lightning at the end of fit: pending saves finish or raise here."""
        try:
            self.wait()
        finally:
            if self._remover is not None:
                self._remover.shutdown(wait=True)
                self._remover = None

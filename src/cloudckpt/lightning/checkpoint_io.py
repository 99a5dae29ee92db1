"""``CloudCheckpointIO``: Lightning's checkpoint I/O on cloudckpt, synchronous or async.

Use with any strategy: ``Trainer(plugins=[CloudCheckpointIO(async_save=True)])`` or
``strategy=DDPStrategy(checkpoint_io=CloudCheckpointIO(...))`` (NeMo's recipe).
In async mode ``save_checkpoint`` returns once the snapshot is taken. Removals that
Lightning asks for (top-k, ``last`` rotation) wait until every earlier save has
committed, and are skipped if one of them failed, so the last good checkpoint is
never the one deleted.

With ``local_dir=`` the checkpoints of one bucket directory are written to a local
mirror first (the single-file layout of the tier, lightning/tier.py :class:`FileTier`)
and drained to the bucket by one background thread (docs/tiers.md, "Lightning"); how
far each file's drain got is its drain record (engine/journal.py,
``_DRAINS/<file>.json``), and each save and removal sweeps the temp files of dead
writers from the mirror. No save or removal waits for the bucket: an upload reads a
private hard link of the version it sends, and removals run in a thread of their own.
Nor does Lightning's version counter: :meth:`CloudCheckpointIO.tier_names` lists the
bucket directory once (at the callback's setup) and answers "does this name exist?"
from that listing and the saves and removals asked for since.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..engine.async_save import SaveHandle, async_save
from ..engine.drain import is_outage, read_owner
from ..engine.load import load
from ..engine.remove import remove_checkpoint
from ..engine.save import save
from ..errors import CorruptCheckpointError, NotFoundError, UnsupportedFormatError
from ..options import TransferOptions
from ..ranks.collectives import rank
from ..store import Settings, Target
from ..store.local import LocalStore
from ..store.paths import dir_prefix, is_prefix
from ._compat import CheckpointIO
from .fs import is_remote, register_settings, unwrap
from .tier import JOURNAL as JOURNAL  # re-exported: the name of the earlier release's journal
from .tier import FileTier, is_name

__all__ = ["CloudCheckpointIO"]

log = logging.getLogger("cloudckpt")

#: A local copy failing so is read from the bucket instead, with a WARNING.
LOCAL_FAILURES = (NotFoundError, CorruptCheckpointError, UnsupportedFormatError)


class CloudCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Save, load and remove Lightning checkpoints at any cloudckpt URL (or local path).

    ``local_dir``: a local tier for one bucket directory (the callback's ``dirpath``,
    claimed at its setup by :meth:`tier_names`, else that of the first checkpoint
    saved): saves commit there and return, one thread drains them to the bucket, loads
    read the local copy when it is valid (docs/tiers.md, "Lightning")."""

    def __init__(
        self,
        async_save: bool = False,
        *,
        max_in_flight: int = 1,
        share_reads: bool = True,
        local_dir: str | os.PathLike[str] | None = None,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.async_save = async_save
        self.max_in_flight = max_in_flight
        #: Under an initialized process group, every rank loads a checkpoint at once
        #: (Lightning's resume): read its bytes once in all and exchange them. Not with
        #: a local tier: there each rank reads its own copy, local or the bucket's.
        self.share_reads = share_reads
        self.local_dir = None if local_dir is None else Path(local_dir).expanduser()
        # Checked here (a bad option fails now, not at the first save) and resolved
        # once per call for its path, so a profile the path selects still applies.
        self._settings = Settings(options, overrides)
        register_settings("", self._settings)  # for the callback's listings and removals
        self._pending: list[SaveHandle] = []
        self._removals: list[Future[None]] = []
        self._remover: ThreadPoolExecutor | None = None
        #: Saves asked for, by URL: a removal of a file saved again since is not done.
        self._saves: Counter[str] = Counter()
        self._lock = threading.Lock()
        #: Bucket directory -> its mirror (None: the local tier belongs to another one).
        self._mirrors: dict[str, FileTier | None] = {}
        self._resumed = False

    # -- the local tier ------------------------------------------------------------------
    def _mirror_at(self, root: str, claim_it: bool) -> FileTier | None:
        """The mirror of the bucket directory ``root``; ``claim_it``: claim the local
        tier for it if nobody has (else only a tier claimed already is used)."""
        if self.local_dir is None:
            return None
        with self._lock:
            if root in self._mirrors:
                return self._mirrors[root]
            if not claim_it and read_owner(LocalStore(self.local_dir)) is None:
                return None
            tier = FileTier(self.local_dir, root, self._settings)  # claims it, or warns
            mirror = tier if tier.owned else None
            self._mirrors[root] = mirror
            return mirror

    def _mirror_for(self, url: str, claim_it: bool) -> tuple[FileTier, str] | None:
        """The mirror holding the checkpoint ``url`` and its key there, if any."""
        if self.local_dir is None or not is_remote(url):
            return None
        root, _, name = url.rpartition("/")
        if not is_name(name):
            return None
        mirror = self._mirror_at(root, claim_it)
        return None if mirror is None else (mirror, name)

    def tier_names(self, dirpath: Any) -> Callable[[Any], bool | None] | None:
        """For a checkpoint callback's setup (rank 0): when the local tier serves the
        bucket directory ``dirpath``, whether a checkpoint path exists, answered without
        the bucket (None for paths outside that directory: ask the bucket).

        The directory is listed once, here; the answers then follow the saves and
        removals this IO is asked for, so Lightning's version counter (a check per save)
        never waits for the bucket and still finds a file an earlier run left there.
        None (ask the bucket per save, as without a tier) with no tier for ``dirpath``.
        When the listing fails for an outage (a WARNING says so) the answers come from
        the tier and this run's saves until the drainer lists the bucket, and a drain
        never overwrites a file there that the tier did not know (FileTier._vet)."""
        if self.local_dir is None or not is_remote(dirpath):
            return None
        root = unwrap(dirpath).rstrip("/")
        mirror = self._mirror_at(root, claim_it=True)
        if mirror is None:
            return None
        try:
            mirror.survey()
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.warning(
                "the bucket directory %s could not be listed (%s: %s): checkpoint names "
                "are chosen from the local tier and this run's saves until the drainer "
                "lists it; a file an earlier run left there under a name chosen meanwhile "
                "is not overwritten (its drain fails, this run's copy stays in %s)",
                root,
                type(exc).__name__,
                exc,
                self.local_dir,
            )
            mirror.survey_later()

        def holds(path: Any) -> bool | None:
            parent, _, name = unwrap(path).rpartition("/")
            return mirror.holds(name) if parent == root and is_name(name) else None

        return holds

    def _owned(self) -> list[FileTier]:
        with self._lock:
            return [m for m in self._mirrors.values() if m is not None]

    def _resume(self) -> None:
        """Once, in the process that saves (rank 0): queue the drains a killed process
        left in ``local_dir`` (its journal names them)."""
        if self._resumed or self.local_dir is None or rank() != 0:
            return
        self._resumed = True
        try:
            root = read_owner(LocalStore(self.local_dir))
        except (NotFoundError, CorruptCheckpointError):
            return
        if root is not None:
            mirror = self._mirror_at(root, claim_it=False)
            if mirror is not None:
                mirror.resume()

    # -- save ----------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path``; in async mode return once it is staged.
        With a local tier the local copy is written (in the background in async mode)
        and drained to ``path`` afterwards.

        ``storage_options`` (Lightning's per-call argument) are TransferOptions fields
        over the ones this IO was made with."""
        url = unwrap(path)
        with self._lock:
            self._saves[url] += 1
        self._resume()
        found = self._mirror_for(url, claim_it=True)
        if found is None:
            self._save(checkpoint, self._settings.open(url, **(storage_options or {})))
            return
        mirror, key = found
        mirror.note(key, present=True)
        mirror.drainer.retry_failed()
        target = self._settings.open(mirror.store.url(key), **(storage_options or {}))
        mirror.begin_write(key)
        try:
            handle = self._save(checkpoint, target)
        except BaseException:
            mirror.end_write(key, committed=False)
            raise
        if handle is None:
            mirror.end_write(key, committed=True)
        else:
            handle.add_done_callback(_ended(mirror, key))

    def _save(self, checkpoint: dict[str, Any], target: Target) -> SaveHandle | None:
        """Save to ``target``: at once, or in the background (the handle)."""
        if not self.async_save:
            save(checkpoint, target)
            return None
        handle = async_save(checkpoint, target, max_in_flight=self.max_in_flight)
        with self._lock:
            self._pending = [h for h in self._pending if not h.done() or h.failed()] + [handle]
        return handle

    # -- load ----------------------------------------------------------------------------
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a checkpoint; waits for a pending save of the same path first. Under
        an initialized process group (every rank resumes), the ranks read its bytes once
        in all and exchange them (``share_reads``; see ``cloudckpt.load(share=True)``).

        With a local tier, the local copy is read (mapped: ``load(mmap=True)``) when it
        is this run's and valid; a copy failing its checks, or missing, is read from the
        bucket with a WARNING."""
        url = unwrap(path)
        target = self._settings.open(url)
        found = self._mirror_for(url, claim_it=False)
        local = None if found is None else found[0].store.url(found[1])
        for h in self._pending_handles():
            if h.url in (target.store.url(target.key), local):
                h.result()
        only_mine = self.local_dir is not None  # the same choice on every rank
        kwargs: dict[str, Any] = {
            "map_location": map_location,
            "weights_only": True if weights_only is None else weights_only,
            "share": self.share_reads and not only_mine,
        }
        if found is not None:
            mirror, key = found
            use, why = mirror.choose(key, target)
            if use:
                try:
                    result: dict[str, Any] = load(
                        self._settings.open(str(local)), mmap=True, **kwargs
                    )
                    return result
                except LOCAL_FAILURES as exc:
                    why = f"{type(exc).__name__}: {exc}"
            if why:
                log.warning(
                    "the local copy %s of %s is not read (%s); reading the bucket's",
                    local,
                    url,
                    why,
                )
        result = load(target, **kwargs)
        return result

    # -- remove --------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path`` (and its local copy), but only after every earlier save has
        committed (and, with a local tier, every queued drain has reached the bucket).
        With a local tier this always runs in a thread of its own, so Lightning's
        rotation never waits for the bucket in the training loop."""
        url = unwrap(path)
        found = self._mirror_for(url, claim_it=False)
        if found is not None:
            found[0].note(found[1], present=False)
        with self._lock:  # still running, or failed: either way the removal must wait
            earlier = [h for h in self._pending if not h.done() or h.failed()]
        if not earlier and self.local_dir is None:
            self._delete(url)
            return
        with self._lock:
            if self._remover is None:
                self._remover = ThreadPoolExecutor(1, thread_name_prefix="cloudckpt-remove")
            removal = self._remover.submit(self._delete_after, url, earlier, self._saves[url])
            self._removals.append(removal)

    def _delete_after(self, url: str, earlier: list[SaveHandle], saves: int) -> None:
        """Delete ``url`` once ``earlier`` saves and the drains committed; not when one
        failed, nor when ``url`` was saved again since the removal was asked for (its
        ``saves`` count then)."""
        for h in earlier:
            h.wait()
        failed = [h.url for h in earlier if h.failed()]
        if failed:
            log.warning(
                "not removing %s: the newer checkpoint(s) %s did not commit", url, ", ".join(failed)
            )
            return
        for mirror in self._owned():  # the removed file's own drain among them
            mirror.settle()
            undrained = [f"{mirror.remote_url}/{key}" for key in sorted(mirror.drainer.wait())]
            if undrained:
                log.warning(
                    "not removing %s: the drain of %s to the bucket failed",
                    url,
                    ", ".join(undrained),
                )
                return
        with self._lock:
            again = self._saves[url] != saves
        if again:
            log.info("not removing %s: it was saved again after its removal was asked for", url)
            return
        self._delete(url)

    def _delete(self, url: str) -> None:
        found = self._mirror_for(url, claim_it=False)
        if found is not None:
            found[0].remove(found[1])
        target = self._settings.open(url)
        if is_prefix(target.store, target.key.rstrip("/")):  # a sharded checkpoint's folder
            remove_checkpoint(target.store, dir_prefix(target.key), target.options)
        else:
            target.store.delete(target.key)  # absent already is fine

    def _pending_handles(self) -> list[SaveHandle]:
        with self._lock:
            return [h for h in self._pending if not h.done()]

    # -- teardown ------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for every pending save, drain and removal; raise the first save error,
        else the first drain error (a StorageError naming the file)."""
        self._resume()
        with self._lock:
            handles, self._pending = list(self._pending), []
            removals, self._removals = list(self._removals), []
        error: BaseException | None = None
        for h in handles:
            h.wait()
            if error is None and h.failed() and not h.reported:
                error = h.exception()
        for mirror in self._owned():
            mirror.settle()
            mirror.drainer.retry_failed()
            failed = mirror.drainer.wait()
            if error is None and failed:
                error = failed[min(failed)]
        for f in removals:
            f.result()
        if error is not None:
            raise error

    def teardown(self) -> None:
        """Called by Lightning at the end of fit: pending saves and drains finish or
        raise here."""
        try:
            self.wait()
        finally:
            if self._remover is not None:
                self._remover.shutdown(wait=True)
                self._remover = None


def _ended(mirror: FileTier, key: str) -> Callable[[SaveHandle], None]:
    """The callback of a background local write of ``key``: queue its drain."""

    def done(handle: SaveHandle) -> None:
        mirror.end_write(key, committed=not handle.failed())

    return done

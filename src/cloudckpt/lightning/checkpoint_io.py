"""``CloudCheckpointIO``: Lightning's checkpoint I/O on cloudckpt, synchronous or async.

Use with any strategy: ``Trainer(plugins=[CloudCheckpointIO(async_save=True)])`` or
``strategy=DDPStrategy(checkpoint_io=CloudCheckpointIO(...))`` (NeMo's recipe).
In async mode ``save_checkpoint`` returns once the snapshot is taken. Removals that
Lightning asks for (top-k, ``last`` rotation) wait until every earlier save has
committed, and are skipped if one of them failed, so the last good checkpoint is
never the one deleted.

With ``local_dir=`` the checkpoints of one bucket directory are written to a local
mirror first and drained to the bucket by one background thread (docs/tiers.md,
"Lightning"); how far each file's drain got is its drain record (engine/journal.py,
``_DRAINS/<file>.json``), and each save and removal sweeps the temp files of dead
writers from the mirror. No save or removal waits for the bucket: an upload reads a
private hard link of the version it sends, and removals run in a thread of their own.
Nor does Lightning's version counter: :meth:`CloudCheckpointIO.tier_names` lists the
bucket directory once (at the callback's setup) and answers "does this name exist?"
from that listing and the saves and removals asked for since.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..engine.async_save import SaveHandle, async_save
from ..engine.copy import copy_object
from ..engine.drain import RUN_FILE, Drainer, claim, is_outage, read_owner
from ..engine.journal import (
    JOURNAL_DIR,
    DrainJournal,
    DrainRecord,
    check_name,
    identity,
    matches,
)
from ..engine.leftovers import pinned, sweep_leftovers
from ..engine.load import load
from ..engine.remove import remove_checkpoint
from ..engine.save import save
from ..errors import (
    CorruptCheckpointError,
    InvalidURLError,
    NotFoundError,
    StorageError,
    UnsupportedFormatError,
)
from ..options import TransferOptions
from ..ranks.collectives import rank
from ..store import Settings, Target
from ..store.local import LocalStore
from ..store.paths import (
    MAX_RECORD_BYTES,
    children,
    dir_prefix,
    exists,
    is_prefix,
    read_capped,
)
from ._compat import CheckpointIO
from .fs import is_remote, register_settings, unwrap

__all__ = ["CloudCheckpointIO"]

log = logging.getLogger("cloudckpt")

#: An earlier release's journal beside the run file (the files due for the bucket, and
#: each drained file's ETag): read once into the drain records, then removed.
JOURNAL = "_DRAIN.json"
JOURNAL_FORMAT = "cloudckpt.io-drain/1"
#: A local copy failing so is read from the bucket instead, with a WARNING.
LOCAL_FAILURES = (NotFoundError, CorruptCheckpointError, UnsupportedFormatError)


def _is_name(key: object) -> bool:
    """A checkpoint's file name in the mirrored directory (not a path, not ours)."""
    if key in (RUN_FILE, JOURNAL, JOURNAL_DIR):
        return False
    try:
        check_name(key)
    except InvalidURLError:
        return False
    return True


def _legacy_identity(recorded: str) -> str:
    """An earlier release's record of a drained object (its ETag, else ``size:N``) as
    :func:`~cloudckpt.engine.journal.identity` writes one (what it lacks left empty)."""
    size = recorded.removeprefix("size:")
    return f"{size}::" if size != recorded and size.isdigit() else f":{recorded}:"


class _Mirror:
    """The files of the bucket directory ``root`` mirrored in the local tier ``store``:
    each written there first (atomically), then uploaded unchanged by one drainer.

    An upload reads a private hard link of the file taken when it starts
    (engine/leftovers.py ``pinned``), so a save renames a newer version over the file
    at once, never waiting for the bucket. Each file's drain record (engine/journal.py)
    names the local version it describes (its modification time): due, that version
    waits to be sent; committed, the bucket holds it. An upload of an older version
    never marks a newer one drained: the newer one stays due and is sent next.
    """

    def __init__(self, store: LocalStore, root: str, settings: Settings) -> None:
        self.store, self.root, self._settings = store, root, settings
        self._cond = threading.Condition()
        self._writing: Counter[str] = Counter()
        self._journal_lock = threading.Lock()
        self.journal = DrainJournal(store, root)
        self._adopt_legacy()
        self._records: dict[str, DrainRecord] = {}
        for name in self.journal.names():
            found = self.journal.read(name)
            if found is not None and _is_name(name):
                self._records[name] = found
        #: The names in the directory (bucket or tier) as this run knows them, from one
        #: listing (:meth:`survey`) and the saves and removals asked for since; None
        #: until surveyed.
        self._names: set[str] | None = None
        self._names_lock = threading.Lock()
        #: Set when the listing at setup failed (an outage) until the drainer lists the
        #: bucket (:meth:`_vet`): the files saved meanwhile are recorded ``unlisted``.
        self._unlisted = False
        self.drainer: Drainer[str] = Drainer(
            self._drain,
            store.root_url,
            root,
            noun="file",
            at_exit="the next CloudCheckpointIO with this local_dir finishes it",
            retry="the next save or wait()",
        )

    def remote(self, key: str) -> Target:
        """The bucket object ``key`` mirrors, opened with the IO's settings."""
        return self._settings.open(f"{self.root}/{key}")

    # -- the drain records ---------------------------------------------------------------
    def _adopt_legacy(self) -> None:
        """Read an earlier release's journal (``_DRAIN.json``) into drain records, once:
        a file it names that has no record yet gets one; then it is removed."""
        try:
            data = json.loads(read_capped(self.store, JOURNAL, MAX_RECORD_BYTES))
            if data.get("format") != JOURNAL_FORMAT or data.get("root_url") != self.root:
                raise ValueError(f"not the journal of {self.root}")
            due, drained = data["due"], data["drained"]
            if not all(_is_name(k) for k in due) or not all(
                _is_name(k) and isinstance(v, str) for k, v in drained.items()
            ):
                raise TypeError("names must be file names of the directory, identities strings")
        except NotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError, CorruptCheckpointError) as exc:
            log.warning(
                "%s is not a drain journal (%s): files saved there earlier are not drained again",
                self.store.url(JOURNAL),
                exc,
            )
            return
        have = set(self.journal.names())
        for key in sorted(set(due) - have):
            self.journal.write(key, DrainRecord(None, self.root, due=True))
        for key, recorded in sorted(drained.items()):
            if key not in have and key not in due:
                objects = {key: _legacy_identity(recorded)}
                self.journal.write(key, DrainRecord(None, self.root, objects, committed=True))
        self.store.delete(JOURNAL)

    def _version(self, key: str) -> float | None:
        """The local copy's version: its modification time (None: there is none)."""
        try:
            return self.store.head(key).mtime
        except NotFoundError:
            return None

    def _write_record(self, key: str, record: DrainRecord | None) -> None:
        """Keep ``record`` as ``key``'s drain record (None: forget it; under the lock)."""
        if record is None:
            self._records.pop(key, None)
            self.journal.forget(key)
        else:
            self._records[key] = record
            self.journal.write(key, record)

    def _note_due(self, key: str) -> DrainRecord | None:
        """Record the local copy of ``key`` as it is now as due for the bucket (what an
        older drain put there is kept: the bucket holds it until the new one lands);
        forget ``key`` when it has no local copy. The record kept."""
        with self._journal_lock:
            version = self._version(key)
            known = self._records.get(key)
            record = None
            if version is not None:
                objects = {} if known is None else known.objects
                with self._names_lock:
                    unlisted = self._unlisted  # named without the bucket's names
                if known is not None and known.unlisted and not known.committed:
                    unlisted = True  # still never sent: still unchecked
                record = DrainRecord(version, self.root, objects, due=True, unlisted=unlisted)
            self._write_record(key, record)
            return record

    def _note_drained(self, key: str, version: float, drained: str) -> None:
        """After the version ``version`` of ``key`` became the bucket object ``drained``
        (its :func:`~cloudckpt.engine.journal.identity`): committed when that is the
        version the record names; else a newer one was saved meanwhile and stays due."""
        with self._journal_lock:
            known = self._records.get(key)
            if known is None:  # removed meanwhile: nothing here to describe
                return
            same = known.time is None or known.time == version  # None: an earlier release's
            when = version if same else known.time
            record = DrainRecord(when, self.root, {key: drained}, committed=same, due=not same)
            self._write_record(key, record)

    def _forget(self, key: str) -> None:
        """Forget ``key``'s drain record (its local copy is gone)."""
        with self._journal_lock:
            self._write_record(key, None)

    def resume(self) -> None:
        """Queue the drains a process left unfinished: the files due in their record,
        and those whose record names another version or is missing (a process killed
        between the local rename and the record)."""
        with self._journal_lock:
            records = dict(self._records)
        for key in sorted(self._local_names() | set(records)):
            known = records.get(key)
            due = known is None or known.due  # no record: killed before it was written
            stale = known is not None and known.time not in (None, self._version(key))
            if (due or stale) and self._note_due(key) is not None:
                self.drainer.submit(key)

    def _local_names(self) -> set[str]:
        """The checkpoint files in the tier (its run file, records and temp files aside)."""
        return {o.key for o in self.store.list("") if "/" not in o.key and _is_name(o.key)}

    # -- the names in the directory (Lightning's version counter) ----------------------
    def survey(self) -> None:
        """List the bucket directory once (an object, or a sharded checkpoint's prefix,
        is a name) and add the checkpoints of the tier and its drain records (due ones
        the bucket will hold): from now on :meth:`holds` answers without the bucket,
        kept current by :meth:`note`. Raises what the listing raises."""
        remote = self._settings.open(self.root)
        below = children(remote.store, remote.key)
        with self._journal_lock:
            recorded = set(self._records)
        names = set(below.files) | set(below.dirs) | self._local_names() | recorded
        with self._names_lock:
            self._names = names

    def survey_later(self) -> None:
        """The listing failed (an outage): :meth:`holds` answers from the tier's files
        and drain records and this run's saves, and each file saved until the drainer
        lists the bucket is recorded ``unlisted`` (:meth:`_vet`)."""
        with self._journal_lock:
            recorded = set(self._records)
        known = self._local_names() | recorded
        with self._names_lock:
            self._names, self._unlisted = known, True

    def _vet(self, key: str) -> None:
        """Before an upload of ``key``: once after :meth:`survey_later`, list the bucket
        (an outage fails the drain, tried again later) so later names avoid its files;
        and when ``key``'s record is ``unlisted`` (named without the bucket's names, in
        this process or an earlier one), StorageError, leaving the bucket's object, when
        the bucket holds ``key`` and the record does not name that object as its own
        drain's (an earlier run's file: the version counter would have named this one
        ``-v1``)."""
        with self._names_lock:
            pending = self._unlisted
        if pending:
            remote = self._settings.open(self.root)
            below = children(remote.store, remote.key)
            with self._names_lock:
                if self._names is not None:
                    self._names |= set(below.files) | set(below.dirs)
                self._unlisted = False
        with self._journal_lock:
            record = self._records.get(key)
        if record is None or not record.unlisted:
            return
        target = self.remote(key)
        try:
            there = target.store.head(target.key)
        except NotFoundError:
            return
        ours = record.objects.get(key)
        if ours is None or not matches(ours, there.size, there.etag):
            raise StorageError(
                f"{self.root}/{key} is in the bucket and this run did not write it (an "
                "earlier run's file: this run named its checkpoint while the bucket was "
                "unreachable); it is not overwritten, and this run's file stays at "
                f"{self.store.url(key)}"
            )

    def note(self, key: str, present: bool) -> None:
        """A save (``present``) or a removal of ``key`` was asked for: what Lightning
        sees of the directory from now on (a removal runs later, in the background)."""
        with self._names_lock:
            if self._names is not None:
                (self._names.add if present else self._names.discard)(key)

    def holds(self, key: str) -> bool | None:
        """Whether the directory holds ``key`` as this run knows it (None: not surveyed)."""
        with self._names_lock:
            return None if self._names is None else key in self._names

    # -- local writes and uploads (a write never waits for an upload) -----------------
    def begin_write(self, key: str) -> None:
        """Before replacing the local copy of ``key``: sweep the temp files of dead
        writers from the tier (never a live writer's). An upload of ``key`` under way
        goes on from its own link: nothing here waits for the bucket."""
        sweep_leftovers(self.store)
        with self._cond:
            self._writing[key] += 1

    def end_write(self, key: str, committed: bool) -> None:
        """After the local write of ``key``: due for the bucket if it committed."""
        try:
            if committed and self._note_due(key) is not None:
                self.drainer.submit(key)
        finally:
            with self._cond:
                self._writing[key] -= 1
                if self._writing[key] <= 0:
                    del self._writing[key]
                self._cond.notify_all()

    def settle(self) -> None:
        """Wait until no local write is in flight (their drains are queued then)."""
        with self._cond:
            while self._writing:
                self._cond.wait()

    def _drain(self, key: str) -> None:
        """The drainer's work: upload the local copy of ``key`` unchanged, from a private
        hard link of the version there when it starts (a save may replace the file
        meanwhile); nothing when its record is not due (sent already, or removed)."""
        with self._cond:  # a local write under way: send what it writes, not the old one
            while key in self._writing:
                self._cond.wait()
        with self._journal_lock:
            known = self._records.get(key)
        if known is None or not known.due:
            return
        self._vet(key)
        remote = self.remote(key)
        try:
            with pinned(self.store, key) as (link, version):
                copy_object(self.store, link, remote.store, remote.key, remote.options)
        except NotFoundError:
            if exists(self.store, key):
                raise
            self._forget(key)  # removed since (rotation): nothing to send
            return
        self._note_drained(key, version, identity(remote.store.head(remote.key)))

    # -- reads and removals -----------------------------------------------------------
    def choose(self, key: str, remote: Target) -> tuple[bool, str]:
        """Whether to read the local copy of ``key``; if not, why (empty: it was never
        here, nothing to say). The bucket is asked for the object's description only."""
        with self._journal_lock:
            record = self._records.get(key)
        if record is not None and record.due:  # newer than the bucket's copy, if any
            return True, ""
        drained = None if record is None or not record.committed else record.objects.get(key)
        if drained is None:
            return False, ""
        try:
            there = remote.store.head(remote.key)
        except NotFoundError:
            return True, ""  # the local copy is the only one
        except Exception as exc:
            if not is_outage(exc):
                raise
            log.warning(
                "the bucket %s is unreachable (%s: %s): reading %s, drained from here, "
                "unchecked against the bucket's copy",
                self.root,
                type(exc).__name__,
                exc,
                self.store.url(key),
            )
            return True, ""
        if not matches(drained, there.size, there.etag):
            return False, "the bucket's object is not the one drained from here"
        return True, ""

    def remove(self, key: str) -> None:
        """Delete the local copy of ``key`` and forget it; sweep the temp files of dead
        writers (Lightning's rotation is the mirror's retention)."""
        self.store.delete(key)
        self._forget(key)
        sweep_leftovers(self.store)


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
        self._mirrors: dict[str, _Mirror | None] = {}
        self._resumed = False

    # -- the local tier ------------------------------------------------------------------
    def _mirror_at(self, root: str, claim_it: bool) -> _Mirror | None:
        """The mirror of the bucket directory ``root``; ``claim_it``: claim the local
        tier for it if nobody has (else only a tier claimed already is used)."""
        if self.local_dir is None:
            return None
        with self._lock:
            if root in self._mirrors:
                return self._mirrors[root]
            store = LocalStore(self.local_dir)
            if not claim_it and read_owner(store) is None:
                return None
            self.local_dir.mkdir(parents=True, exist_ok=True)
            owner = claim(store, root)
            mirror = _Mirror(store, root, self._settings) if owner == root else None
            if mirror is None:
                log.warning(
                    "local_dir %s holds the local tier of %s, not of %s: checkpoints under "
                    "%s are saved to and loaded from the bucket only",
                    self.local_dir,
                    owner,
                    root,
                    root,
                )
            self._mirrors[root] = mirror
            return mirror

    def _mirror_for(self, url: str, claim_it: bool) -> tuple[_Mirror, str] | None:
        """The mirror holding the checkpoint ``url`` and its key there, if any."""
        if self.local_dir is None or not is_remote(url):
            return None
        root, _, name = url.rpartition("/")
        if not _is_name(name):
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
        never overwrites a file there that the tier did not know (_Mirror._vet)."""
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
            return mirror.holds(name) if parent == root and _is_name(name) else None

        return holds

    def _owned(self) -> list[_Mirror]:
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
            undrained = [f"{mirror.root}/{key}" for key in sorted(mirror.drainer.wait())]
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


def _ended(mirror: _Mirror, key: str) -> Callable[[SaveHandle], None]:
    """The callback of a background local write of ``key``: queue its drain."""

    def done(handle: SaveHandle) -> None:
        mirror.end_write(key, committed=not handle.failed())

    return done

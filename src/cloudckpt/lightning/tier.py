"""The single-file layout of the local tier: Lightning's (docs/tiers.md, "Lightning").

Each checkpoint is one file, ``LOCAL_DIR/<name>.ckpt``, mirroring the object
``<dirpath>/<name>.ckpt`` of one bucket directory: committed locally by the atomic rename
of its save (no marker), versioned by its modification time, and drained by uploading
it unchanged from a private hard link (engine/leftovers.py ``pinned``), the bucket's
commit being that upload. What every tier directory is (the directory and its store,
the run file's claim, the drain records, the sweep of dead writers' temp files) is the
base class, engine/tier.py :class:`~cloudckpt.engine.tier.TierDirectory`, as for the
manager's step folders (manager/tiers.py). Lightning keeps a layout of its own because
its checkpoint is a single object that plain Lightning reads, committed by its upload,
and its names (``last.ckpt``) get local versions of one name.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import Counter

from ..engine.copy import copy_object
from ..engine.drain import RUN_FILE, Drainer, is_outage
from ..engine.journal import JOURNAL_DIR, DrainRecord, check_name, identity, matches
from ..engine.leftovers import pinned
from ..engine.tier import TierDirectory
from ..errors import CorruptCheckpointError, InvalidURLError, NotFoundError, StorageError
from ..store import Settings, Target
from ..store.paths import MAX_RECORD_BYTES, children, exists, read_capped

__all__ = ["JOURNAL", "JOURNAL_FORMAT", "FileTier", "is_name"]

log = logging.getLogger("cloudckpt")

#: An earlier release's journal beside the run file (the files due for the bucket, and
#: each drained file's ETag): read once into the drain records, then removed.
JOURNAL = "_DRAIN.json"
JOURNAL_FORMAT = "cloudckpt.io-drain/1"


def is_name(key: object) -> bool:
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


class FileTier(TierDirectory):
    """The files of the bucket directory ``remote_url`` mirrored in the local tier
    directory ``path``: each written there first (atomically), then uploaded unchanged
    by one drainer; the single-file layout of the tier directory (engine/tier.py: its
    store, run file claim, drain records and sweep). A directory another run claimed is
    not this run's (a WARNING says so): nothing of it is read (``owned`` is False).

    An upload reads a private hard link of the file taken when it starts
    (engine/leftovers.py ``pinned``), so a save renames a newer version over the file
    at once, never waiting for the bucket. Each file's drain record (engine/journal.py)
    names the local version it describes (its modification time): due, that version
    waits to be sent; committed, the bucket holds it. An upload of an older version
    never marks a newer one drained: the newer one stays due and is sent next.
    """

    def __init__(self, path: str | os.PathLike[str], remote_url: str, settings: Settings) -> None:
        super().__init__(path, remote_url)
        self._settings = settings
        self._cond = threading.Condition()
        self._writing: Counter[str] = Counter()
        self._journal_lock = threading.Lock()
        self._records: dict[str, DrainRecord] = {}
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
            self.url,
            remote_url,
            noun="file",
            at_exit="the next CloudCheckpointIO with this local_dir finishes it",
            retry="the next save or wait()",
        )
        if not self.owned:
            log.warning(
                "local_dir %s holds the local tier of %s, not of %s: checkpoints under "
                "%s are saved to and loaded from the bucket only",
                self.path,
                self.owner,
                remote_url,
                remote_url,
            )
            return
        self._adopt_legacy()
        for name in self.drain_journal.names():
            found = self.drain_journal.read(name)
            if found is not None and is_name(name):
                self._records[name] = found

    def remote(self, key: str) -> Target:
        """The bucket object ``key`` mirrors, opened with the IO's settings."""
        return self._settings.open(f"{self.remote_url}/{key}")

    # -- the drain records ---------------------------------------------------------------
    def _adopt_legacy(self) -> None:
        """Read an earlier release's journal (``_DRAIN.json``) into drain records, once:
        a file it names that has no record yet gets one; then it is removed."""
        try:
            data = json.loads(read_capped(self.store, JOURNAL, MAX_RECORD_BYTES))
            if data.get("format") != JOURNAL_FORMAT or data.get("root_url") != self.remote_url:
                raise ValueError(f"not the journal of {self.remote_url}")
            due, drained = data["due"], data["drained"]
            if not all(is_name(k) for k in due) or not all(
                is_name(k) and isinstance(v, str) for k, v in drained.items()
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
        have = set(self.drain_journal.names())
        for key in sorted(set(due) - have):
            self.drain_journal.write(key, DrainRecord(None, self.remote_url, due=True))
        for key, recorded in sorted(drained.items()):
            if key not in have and key not in due:
                objects = {key: _legacy_identity(recorded)}
                self.drain_journal.write(
                    key, DrainRecord(None, self.remote_url, objects, committed=True)
                )
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
            self.drain_journal.forget(key)
        else:
            self._records[key] = record
            self.drain_journal.write(key, record)

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
                record = DrainRecord(version, self.remote_url, objects, due=True, unlisted=unlisted)
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
            record = DrainRecord(
                when, self.remote_url, {key: drained}, committed=same, due=not same
            )
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
        return {o.key for o in self.store.list("") if "/" not in o.key and is_name(o.key)}

    # -- the names in the directory (Lightning's version counter) ----------------------
    def survey(self) -> None:
        """List the bucket directory once (an object, or a sharded checkpoint's prefix,
        is a name) and add the checkpoints of the tier and its drain records (due ones
        the bucket will hold): from now on :meth:`holds` answers without the bucket,
        kept current by :meth:`note`. Raises what the listing raises."""
        remote = self._settings.open(self.remote_url)
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
            remote = self._settings.open(self.remote_url)
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
                f"{self.remote_url}/{key} is in the bucket and this run did not write it (an "
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
        self.sweep()
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
                self.remote_url,
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
        self.sweep()

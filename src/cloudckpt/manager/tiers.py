"""A manager's local tier: each checkpoint committed to a node-local directory first,
then drained to the bucket by one background thread (docs/tiers.md).

The local tier is a run root of its own (the same ``step-N/`` layout and marker as the
bucket), claimed for one bucket root by its run file ``_TIER.json``, so a directory left
by another job is never restored from. A step due for the bucket is drained by copying
its objects as they are (``engine/copy.copy_tree``: data first, resumable), then the
manager commits the bucket's step with its own marker, create-only.

An object the drain finds under the bucket's uncommitted step is kept only when it is
proven to hold this local commit's bytes: this drain's journal recorded it as written
(``_DRAINS/step-N.json``, the drain record every tier keeps, engine/journal.py: each
object's size, ETag and time as the bucket listed them after the copy), or a checksum
the bucket reports matches the local file (engine/proof.py). Anything else there is
replaced, and an object that is none of the step's files is deleted: the same size and
a recent time prove nothing (another node's save of the same step). What the journal
records of an object this drain sent is checked first against the ETag its upload got:
one another save wrote over it meanwhile fails the drain (tried again later), never a
journal entry. The journal also records the bucket's commit, so "is this step drained?"
is answered from the tier itself, without asking the bucket: a save never waits for it.

What every tier directory is, whatever its layout (the directory and its store, the
run file's claim, the drain records, the sweep of crashed writers' temp files), is
:class:`~cloudckpt.engine.tier.TierDirectory`; :class:`LocalTier` is its step-folder
layout, Lightning's single-file layout is ``lightning/tier.py``.

The tier addresses a checkpoint by a key: the manager's are steps (``step-N/``), NeMo's
tier (nemo/tier.py) uses its checkpoint names (``<name>/``, the files the bucket gets
in ``weights/``: the tier's ``payload`` folder). The drain of one checkpoint by several
ranks (:meth:`LocalTier.drain_ranks`) is the same for both.
"""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeAlias

from ..engine.copy import PARTIAL_SUFFIX, copy_tree
from ..engine.drain import RUN_FILE, Drainer, complete_directories, directory_owner
from ..engine.journal import JOURNAL_DIR, DrainJournal, DrainRecord, identity, matches
from ..engine.proof import replaced
from ..engine.remove import remove_checkpoint, remove_markers
from ..engine.tier import TierDirectory
from ..errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    LocalTierFullError,
    NotFoundError,
    StorageError,
)
from ..format.commit import read_committed
from ..options import TransferOptions
from ..ranks.collectives import agree, on_first, settle, world_size
from ..store import MultipartUpload, ObjectInfo, Store
from .marker import (
    MARKER_NAME,
    CheckpointInfo,
    DamagedMarker,
    check_files,
    check_remote,
    commit_step,
    decode_marker,
    list_checkpoints,
    read_marker,
    step_dir,
)
from .payload import PayloadKind, Wrote
from .retention import KeepLast, positive, to_delete

__all__ = [
    "JOURNAL_DIR",
    "LOCAL",
    "REMOTE",
    "RUN_FILE",
    "Drainer",
    "Key",
    "LocalTier",
    "check_free",
    "check_positive",
    "merge_tiers",
    "tensor_bytes",
]

log = logging.getLogger("cloudckpt")

LOCAL = "local"
REMOTE = "remote"
#: How the tier addresses one checkpoint: a step (the manager's ``step-N/``) or a
#: checkpoint's name (NeMo's ``<name>/``).
Key: TypeAlias = int | str
#: The key, in a checkpoint's folder, of the locked temp file its saving process holds
#: from the clearing of the folder to the local commit (never a file of the checkpoint:
#: listings skip temp files).
SAVE_LOCK = "_SAVING"


def check_positive(name: str, value: object) -> None:
    """ConfigError unless ``value`` (the option ``name``) is None or a positive int."""
    if value is not None:
        positive(name, value)  # type: ignore[arg-type]


class LocalTier(TierDirectory):
    """The local copy of one run: a folder per checkpoint under ``path`` (``step-N/``;
    NeMo's ``<name>/``) committed by the same marker as the bucket's, for the bucket
    root ``remote_url`` only: the step-folder layout of the tier directory
    (engine/tier.py: its store, run file claim, drain records and sweep).

    ``keep_local`` newest local steps are kept (None: all); steps divisible by
    ``every`` are due for the bucket. ``payload``: the folder of each checkpoint that
    the bucket gets (``""``: all of it; NeMo's ``weights/``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        remote_url: str,
        options: TransferOptions,
        keep_local: int | None,
        every: int,
        *,
        payload: str = "",
    ) -> None:
        check_positive("keep_local", keep_local)
        check_positive("drain_every_n_steps", every)
        self.payload = payload
        super().__init__(path, remote_url)
        if not self.owned:
            log.warning(
                "local_dir %s holds the local tier of %s, not of %s: it is neither "
                "restored from nor saved to",
                self.path,
                self.owner,
                self.remote_url,
            )
        # The bucket's storage options (endpoint, credentials) mean nothing here, and its
        # writes take nothing from the process's byte budget, which the drains' parts
        # hold while a bucket stalls: a save never waits for the bucket.
        self.options = options.replace(storage_options={}, max_bytes_in_flight=None)
        self.keep = keep_local
        self.every = every
        self._cache: dict[tuple[str, int], CheckpointInfo] = {}
        self._lock = threading.Lock()
        self._retain_lock = threading.Lock()
        #: (name, local commit time) of the checkpoints whose journal records the bucket's
        #: commit.
        self._drained: set[tuple[str, float]] = set()
        #: The thread removing the files of the steps a deferred retention dropped.
        self._removing: threading.Thread | None = None
        #: The save locks this process holds, by folder name (:meth:`clear`).
        self._saving: dict[str, MultipartUpload] = {}

    def check_ready(self, kind: PayloadKind) -> None:
        """Refuse a save the tier cannot take: a directory of another run, or a job of
        several processes saving a kind that writes no per-rank files (no
        ``coordinator_files`` to complete each rank's directory with)."""
        if not self.owned:
            raise ConfigError(
                f"local_dir {self.path} holds the local tier of {self.owner}; give the run "
                f"{self.remote_url} a directory of its own"
            )
        if world_size() > 1 and not kind.coordinator_files:
            raise ConfigError(
                "a local tier (local_dir=) in a job of several processes takes kind='dcp' "
                f"or kind='megatron', not {kind.name!r}"
            )

    # -- naming --------------------------------------------------------------------------
    @staticmethod
    def name_of(key: Key) -> str:
        """The folder (and drain record) name of ``key``: ``step-N``, or the name itself."""
        return key if isinstance(key, str) else step_dir(key)

    @classmethod
    def step_prefix(cls, key: Key) -> str:
        """The local prefix of ``key``'s checkpoint (its marker's folder; ends in ``/``)."""
        return f"{cls.name_of(key)}/"

    def step_url(self, key: Key) -> str:
        """URL of ``key``'s local prefix (ends in ``/``)."""
        return self.store.url(self.step_prefix(key))

    def save_url(self, step: int) -> str:
        """:meth:`step_url`, for a save addressing the tier by URL: ``step-N/`` is made
        first by the tier's store, so a ``step-N`` that is a symbolic link is refused
        (UnsafePathError) rather than saved through."""
        self.store.make_dirs(self.step_prefix(step))
        return self.step_url(step)

    def due(self, step: int) -> bool:
        """Whether ``step`` goes to the bucket (every ``drain_every_n_steps``-th)."""
        return step % self.every == 0

    def undrained(
        self, remote: Iterable[int], local: Iterable[CheckpointInfo] | None = None
    ) -> list[int]:
        """The local steps (``local``, else this tier's listing) due for the bucket and
        not among the bucket's committed ``remote`` steps, oldest first."""
        there = set(remote)
        found = self.list() if local is None else local
        return sorted(c.step for c in found if self.due(c.step) and c.step not in there)

    # -- discovery -----------------------------------------------------------------------
    def list(
        self, damaged: builtins.list[DamagedMarker] | None = None
    ) -> builtins.list[CheckpointInfo]:
        """This run's locally committed steps, oldest first (none from another run);
        the steps whose marker is damaged are added to ``damaged`` when given."""
        if not self.owned:
            return []
        with self._lock:
            cache = dict(self._cache)
        found = list_checkpoints(self.store, "", self.options, cache, damaged=damaged)
        with self._lock:
            self._cache.update(cache)
        return found

    def info(self, key: Key) -> CheckpointInfo | None:
        """The local commit of ``key``, or None (none from another run)."""
        return read_marker(self.store, self.step_prefix(key) + MARKER_NAME) if self.owned else None

    def saved_by(self) -> dict[int, int]:
        """How many ranks saved each local step, for the steps whose marker says so
        (those a job of several processes committed)."""
        return {c.step: c.ranks for c in self.list() if c.ranks}

    # -- save ----------------------------------------------------------------------------
    def check_room(
        self,
        state: Any,
        copies: int = 1,
        waiting: Callable[[], Sequence[int]] = lambda: (),
    ) -> None:
        """LocalTierFullError, before anything is written, when the free space is below
        the last local checkpoint's size (or the state's tensor bytes, if larger), times
        ``copies`` (2 when the directory also keeps a peer's copy); it names the steps
        ``waiting()`` returns (due for the bucket, not drained: kept until they are)."""
        found = self.list()
        last = found[-1].size if found else 0
        try:
            check_free(self.path, max(last, tensor_bytes(state)) * copies)
        except LocalTierFullError as exc:
            raise self.full(str(exc), waiting()) from None

    def full(self, why: str, waiting: Sequence[int]) -> LocalTierFullError:
        """The error of a save the tier has no room for: ``why``, and the ``waiting``
        steps (due for the bucket, not drained: kept until they are)."""
        if not waiting:
            return LocalTierFullError(why)
        return LocalTierFullError(
            f"{why}; {len(waiting)} step(s) wait for the bucket and are kept until "
            f"drained: {list(waiting)}"
        )

    def clear(self, key: Key, *, replaced: bool = False) -> None:
        """Before a save writes ``key``'s folder: take the folder's save lock, then
        remove what is there uncommitted (a killed save's files, the temp files of its
        dead writers, its subfolders), so the commit, which lists the folder, records
        this save's files only. Never a committed copy (AlreadyExistsError: uncommit it
        first) nor a live writer's files (StorageError: another process saves there,
        its temp files or its save lock are held).

        The lock (a locked temp file, ``SAVE_LOCK``, held until :meth:`commit` or
        :meth:`release`) is made before the check for other writers: of two processes
        saving the same checkpoint into one directory, at least one sees the other's and
        fails, so neither's clearing removes the other's finished files and no commit
        lists another save's bytes. A process that dies releases it with its
        descriptors; the next save sweeps it. ``replaced``: the caller uncommitted its
        own earlier copy of ``key`` for this save, whose files are removed here (INFO,
        not the WARNING a killed save's leftovers get)."""
        prefix = self.step_prefix(key)
        if self.info(key) is not None:
            raise AlreadyExistsError(
                f"{self.label(key)} is committed at {self.step_url(key)}; it is not saved over"
            )
        self.store.sweep_temps(prefix)  # a dead writer's: its lock is free
        lock = self._hold(key)
        try:  # whatever fails from here (Ctrl-C included), the lock is given up
            live = [
                self.store.url(u.key)
                for u in self.store.list_multipart(prefix)
                if u.upload_id != lock.upload_id
            ]
            if live:
                raise StorageError(
                    f"{self.step_url(key)} is being written by another process "
                    f"({', '.join(live)}): {self.label(key)} is not saved there meanwhile"
                )
            removed = remove_checkpoint(self.store, prefix, self.options)
        except BaseException:
            self.release(key)
            raise
        if removed and replaced:
            log.info(
                "removed %d file(s) of the earlier copy of %s (uncommitted for this save) at %s",
                removed,
                self.label(key),
                self.step_url(key),
            )
        elif removed:
            log.warning(
                "removed %d file(s) an earlier, uncommitted save of %s left at %s",
                removed,
                self.label(key),
                self.step_url(key),
            )

    def _hold(self, key: Key) -> MultipartUpload:
        """This process's save lock on ``key``'s folder: the one it holds already (a
        save of it that failed before its commit), else a new locked temp file."""
        name = self.name_of(key)
        with self._lock:
            held = self._saving.get(name)
        if held is not None:
            return held
        lock = self.store.create_multipart(self.step_prefix(key) + SAVE_LOCK)
        with self._lock:
            self._saving[name] = lock
        return lock

    def release(self, key: Key) -> None:
        """Give up the save lock on ``key``'s folder, if this process holds it (after
        the local commit, or a save that failed: its folder goes too when the lock was
        all it held)."""
        with self._lock:
            lock = self._saving.pop(self.name_of(key), None)
        if lock is not None:
            self.store.abort_multipart(lock)
            self.store.remove_prefix_dir(self.step_prefix(key))

    def clear_ranks(self, key: Key, group: Any, *, replaced: bool = False) -> None:
        """:meth:`clear` on every rank of ``group`` (a collective): each directory's
        first rank clears ``key``'s folder, and no rank returns (and writes there)
        before every directory is cleared; raises on every rank if any failed (each
        first rank's save lock given up then: the save does not go on)."""
        owner, _ = directory_owner(self.path, group)
        error: BaseException | None = None
        try:
            if owner:
                self.clear(key, replaced=replaced)
        except Exception as exc:
            error = exc
        try:
            settle(error, f"clearing {self.step_url(key)} before its save", group=group)
        except BaseException:
            self.release(key)
            raise

    def commit(
        self,
        step: int,
        kind: str,
        metrics: Mapping[str, float],
        metadata: Mapping[str, Any],
        key: Key | None = None,
        files: Wrote = None,
    ) -> CheckpointInfo:
        """Write the local marker of ``step`` (after its payload; under ``key``'s
        folder, default the step's), create-only; in a job of several processes it
        records their number (``ranks``), which decides whether a restore on another
        number of ranks may read this copy. ``files``: the names the save wrote (then
        exactly those are recorded), else the folder's listing."""
        ranks = world_size()
        try:
            info = commit_step(
                self.store,
                self.step_prefix(step if key is None else key),
                step,
                kind,
                metrics,
                metadata,
                ranks=ranks if ranks > 1 else 0,
                files=files,
            )
        finally:
            self.release(step if key is None else key)
        return replace(info, tiers=(LOCAL,))

    def commit_ranks(
        self,
        key: Key,
        step: int,
        kind: PayloadKind,
        metrics: Mapping[str, float],
        metadata: Mapping[str, Any],
        group: Any,
        what: str,
    ) -> None:
        """After a save into each rank's directory (a collective on ``group``): every
        directory gets the files the coordinator alone wrote (``kind``'s
        ``coordinator_files``, in commit order), then its first rank commits it
        locally (:meth:`commit`); raises on every rank if any rank failed. ``what``
        names the checkpoint in errors."""
        try:
            owner, coordinators = directory_owner(self.path, group)
            prefix = self.step_prefix(key) + self.payload
            names = kind.coordinator_files
            for folder, batch in _by_folder(names):  # DeepSpeed's: some in the tag's folder
                complete_directories(
                    self.store,
                    prefix + folder,
                    batch,
                    owner=owner,
                    coordinators=coordinators,
                    group=group,
                    what=f"{what}'s coordinator files ({', '.join(names)})",
                )
            error: BaseException | None = None
            try:  # every directory is whole: each commits (a checkpoint some rank lacks is skipped)
                if owner:
                    self.commit(step, kind.name, metrics, metadata, key)
            except Exception as exc:
                error = exc
            settle(error, f"the local commit of {what} in {self.path}", group=group)
        finally:  # the save lock of each directory's first rank, whatever the outcome
            self.release(key)

    def retain(
        self, protected: Callable[[], set[int]], *, defer: bool = False
    ) -> builtins.list[int]:
        """Delete local steps beyond the ``keep_local`` newest, never one in
        ``protected()`` (due and not drained, being saved, restored), with their drain
        journals; sweep the temp files crashed writers left. Returns the steps deleted.

        ``defer`` (a synchronous save, which returns right after): each step dropped is
        uncommitted here (its marker deleted first, then its journal) and its files are
        removed by a thread of their own, so the save does not wait for their pages to
        be freed. :meth:`settle` waits for that thread; every retention does first, and
        the manager before a save, a drain, a delete or gc. A process killed in between
        leaves the files without a marker: gc's, as a retention killed midway always did."""
        self.settle()
        self.sweep()
        if self.keep is None:
            return []
        with self._retain_lock:  # the saving thread and the drainer both prune
            found = self.list()
            if len(found) <= self.keep:
                return []
            doomed = to_delete(found, [KeepLast(self.keep)], protected())
            self.drop(doomed, defer=defer)
        return doomed

    def drop(self, keys: Iterable[Key], *, defer: bool = False) -> None:
        """Delete the local copies of ``keys`` (each marker first, then its files and
        folders) and their drain journals. ``defer``: each is uncommitted here and its
        files are removed by a thread of their own (:meth:`retain`)."""
        later: builtins.list[tuple[str, builtins.list[ObjectInfo]]] = []
        for key in keys:
            prefix = self.step_prefix(key)
            if defer:
                later.append((prefix, remove_markers(self.store, prefix, self.options)))
            else:
                remove_checkpoint(self.store, prefix, self.options)
            self.forget(key)
        if later:
            self._removing = threading.Thread(
                target=self._remove, args=(later,), name="cloudckpt-local-retention"
            )
            self._removing.start()  # not a daemon: an exit waits for it

    def _remove(self, doomed: Sequence[tuple[str, builtins.list[ObjectInfo]]]) -> None:
        """The thread of a deferred retention: the files of each uncommitted step."""
        for prefix, listed in doomed:
            try:
                remove_checkpoint(self.store, prefix, self.options, listed)
            except Exception as exc:  # uncommitted already: gc removes what is left
                log.warning(
                    "removing %s from the local tier failed (no longer committed; gc() "
                    "removes what is left): %s",
                    self.store.url(prefix),
                    exc,
                )

    def settle(self) -> None:
        """Wait until the files of the steps a deferred retention dropped are removed."""
        removing = self._removing
        if removing is not None and removing is not threading.current_thread():
            removing.join()

    # -- the drain journal ---------------------------------------------------------------
    @classmethod
    def journal_key(cls, key: Key) -> str:
        return DrainJournal.key(cls.name_of(key))

    def journal(self, key: Key, local: CheckpointInfo) -> dict[str, Any] | None:
        """The journal of the drain of ``local`` (the local commit of ``key``): the
        objects it wrote ({name: identity}) and whether the bucket's commit is done.
        None when there is none, or it is of another commit of the checkpoint (or
        unreadable: a WARNING; the drain then proves nothing by it)."""
        found = self.drain_journal.read(self.name_of(key), local.time)
        if found is None:
            return None
        return {"objects": dict(found.objects), "committed": found.committed}

    def record(
        self,
        key: Key,
        local: CheckpointInfo,
        *,
        objects: Mapping[str, str] | None = None,
        committed: bool = False,
    ) -> None:
        """Write the journal of the drain of ``local``: ``objects`` this drain wrote (or
        proved; None: those recorded already), and whether the bucket has committed it.
        A journal is written by a drain of the commit only: it is ``started``."""
        if objects is None:
            found = self.journal(key, local)
            objects = found["objects"] if found else {}
        name = self.name_of(key)
        self.drain_journal.write(
            name,
            DrainRecord(
                time=local.time,
                remote=self.remote_url,
                objects=objects,
                committed=committed,
                started=True,
            ),
        )
        if committed:
            with self._lock:
                self._drained.add((name, local.time))

    def forget(self, key: Key) -> None:
        """Delete the drain journal of ``key`` (its local copy is gone, or replaced)."""
        name = self.name_of(key)
        self.drain_journal.forget(name)
        with self._lock:
            self._drained = {d for d in self._drained if d[0] != name}

    def drained(self, info: CheckpointInfo, key: Key | None = None) -> bool:
        """Whether the journal of the local commit ``info`` (of ``key``, default its
        step) records the bucket's commit."""
        name = self.name_of(info.step if key is None else key)
        with self._lock:
            if (name, info.time) in self._drained:
                return True
        found = self.journal(name, info)
        if found is None or not found["committed"]:
            return False
        with self._lock:
            self._drained.add((name, info.time))
        return True

    def waiting(
        self, in_bucket: Iterable[int] = (), local: Iterable[CheckpointInfo] | None = None
    ) -> builtins.list[int]:
        """The local steps due for the bucket and not drained, oldest first, known from
        the tier alone: no journal records their bucket commit and they are not among
        ``in_bucket`` (the steps the drainer saw committed there). Asks the bucket
        nothing: what this says waits may be there already (a drain by an earlier
        release, or another node's), never the other way."""
        there = set(in_bucket)
        found = self.list() if local is None else local
        return [
            c.step
            for c in found
            if self.due(c.step) and c.step not in there and not self.drained(c)
        ]

    # -- drain ---------------------------------------------------------------------------
    def drain_step(
        self,
        step: int,
        remote: Store,
        remote_prefix: str,
        options: TransferOptions,
        commit: Callable[[CheckpointInfo], CheckpointInfo],
    ) -> bool:
        """Copy ``step``'s payload to ``remote_prefix``, keeping only the objects there
        proven to be this commit's (:meth:`send_payload`; the others replaced, objects
        that are none of its files deleted), then ``commit(local_info)`` writes the
        bucket's marker, and the journal records it. False when the bucket had the step
        committed already: by this commit (a drain that finished: recorded now), or by
        another save of the step (WARNING: the bucket keeps its own). A marker listing
        an object this drain did not write is withdrawn (:meth:`check_commit`)."""
        local = self.info(step)
        if local is None:
            raise NotFoundError(f"step {step} is not committed in the local tier {self.url}")
        key = remote_prefix + MARKER_NAME
        data = read_committed(remote, key)
        if data is not None:
            try:
                there: CheckpointInfo | None = decode_marker(data, remote.url(key))
            except CorruptCheckpointError:
                there = None
            if there is not None and there.time == local.time:
                self.record(step, local, committed=True)
            else:
                log.warning(
                    "step %d is committed at %s by another save (not this local commit of "
                    "%s): the bucket keeps its own; the local copy is not drained",
                    step,
                    remote.url(remote_prefix),
                    self.step_url(step),
                )
            return False
        self.remove_strays(remote, remote_prefix, {f.name for f in local.files})
        # The payload only: the bucket gets a marker of its own (its sizes and ETags).
        self.send_payload(step, local, remote, remote_prefix, options, exclude=(MARKER_NAME,))
        self.check_commit(step, local, remote, remote_prefix, commit(local))
        self.record(step, local, committed=True)
        return True

    def check_commit(
        self,
        step: int,
        local: CheckpointInfo,
        remote: Store,
        remote_prefix: str,
        committed: CheckpointInfo,
    ) -> None:
        """After the bucket's marker of ``local`` was written: every object it lists
        (``committed.files``, as the bucket listed them for the commit) must be the one
        this drain's journal recorded, at the same size and ETag. Another save of the
        step writing there at the same time (two nodes saving one step) can replace an
        object between this drain's copy and its commit; the marker would then put that
        save's bytes under this commit. Such a marker is deleted again and StorageError
        names the objects: the drain is tried again later (it sends its own bytes, or
        finds the other save's commit and keeps it)."""
        found = self.journal(step, local)
        mine = found["objects"] if found else {}
        changed = [f.name for f in committed.files if not matches(mine.get(f.name), f.size, f.etag)]
        if not changed:
            self.confirm(step, remote, remote_prefix, committed)
            return
        self.withdraw(remote, remote_prefix + MARKER_NAME)
        raise StorageError(
            f"step {step} was written at {remote.url(remote_prefix)} by another save while "
            f"this drain committed it: {sorted(changed)} changed since this drain wrote "
            f"them; its marker is withdrawn, the drain of {self.step_url(step)} tries again"
        )

    def confirm(
        self, key: Key, remote: Store, remote_prefix: str, committed: CheckpointInfo
    ) -> None:
        """After the bucket's marker was written: one listing shows every file it lists
        still there at its size and ETag. One removed meanwhile (a delete of the step by
        another process while this drain committed it) would leave a committed step
        with its files gone: the marker is deleted again and StorageError names it."""
        try:
            check_remote(remote, remote_prefix, committed)
        except (NotFoundError, CorruptCheckpointError) as exc:
            self.withdraw(remote, remote_prefix + MARKER_NAME)
            raise StorageError(
                f"{self.label(key)} changed at {remote.url(remote_prefix)} while this drain "
                f"committed it ({exc}); its marker is withdrawn"
            ) from None

    @staticmethod
    def withdraw(remote: Store, key: str) -> None:
        """Delete the bucket's commit marker ``key`` of a commit that would hold another
        save's bytes (the caller raises, naming them); a failure is a WARNING."""
        try:
            remote.delete(key)
        except Exception as exc:  # named by the caller's error: the marker may stay
            log.warning("withdrawing the marker %s failed: %s", remote.url(key), exc)

    @staticmethod
    def remove_strays(remote: Store, remote_prefix: str, names: set[str]) -> builtins.list[str]:
        """Delete the objects under the bucket's uncommitted ``remote_prefix`` that are
        none of ``names`` (the files of the commit being drained): leftovers of another
        save of the step, which the bucket's marker would otherwise list. A partial
        download of one of ``names`` (a drain to the filesystem) is left to the copy,
        which resumes it only when its journal names the same source."""
        removed = []
        for o in list(remote.list(remote_prefix)):
            rel = o.key[len(remote_prefix) :]
            partial = any(rel in (n + PARTIAL_SUFFIX, n + PARTIAL_SUFFIX + ".json") for n in names)
            if rel in names or rel == MARKER_NAME or partial:
                continue
            remote.delete(o.key)
            removed.append(rel)
        return removed

    def payload_files(self, local: CheckpointInfo) -> dict[str, int | None]:
        """The files of the local commit ``local`` that the bucket gets (those in the
        tier's ``payload`` folder, named from it), with their sizes: what its drain
        commits in the bucket, exactly (an earlier save's leftovers there stay out)."""
        cut = len(self.payload)
        return {f.name[cut:]: f.size for f in local.files if f.name.startswith(self.payload)}

    def send_payload(
        self,
        step: Key,
        local: CheckpointInfo,
        remote: Store,
        remote_prefix: str,
        options: TransferOptions,
        exclude: Sequence[str],
    ) -> None:
        """Copy the local files of ``step`` (a step or a name: the commit ``local``; its
        ``payload`` folder) but those named in ``exclude`` to ``remote_prefix``. An
        object already there is kept when this drain's journal recorded it as written
        (size, ETag and time unchanged) or a checksum the bucket reports matches the
        local file (copy_tree's ``same_object``: engine/proof.py); any other is sent
        again over it. Then the journal records what is there of these files, before
        the bucket's commit."""
        files = {
            n: size
            for n, size in self.payload_files(local).items()
            if n.rpartition("/")[2] not in exclude
        }
        journal = self.journal(step, local)
        mine: Mapping[str, str] = journal["objects"] if journal else {}
        kept: set[str] = set()
        for o in remote.list(remote_prefix):
            rel = o.key[len(remote_prefix) :]
            if rel in files and o.size == files[rel] and mine.get(rel) == identity(o):
                kept.add(rel)
        todo = [n for n in files if n not in kept]
        made: dict[str, str | None] = {}
        if todo:
            # copy_tree excludes by name: a kept name shared with one to send is checked.
            sending = {n.rpartition("/")[2] for n in todo}
            proven = {n.rpartition("/")[2] for n in kept} - sending
            made = copy_tree(
                self.store,
                self.step_prefix(step) + self.payload,
                remote,
                remote_prefix,
                options,
                exclude=(*exclude, *sorted(proven)),
            ).etags
        written: dict[str, str] = {}
        for o in remote.list(remote_prefix):
            rel = o.key[len(remote_prefix) :]
            if rel not in files:
                continue
            if replaced(made.get(rel), o.etag):
                raise StorageError(
                    f"{remote.url(o.key)} was written by another save while this drain sent "
                    f"it (its ETag is not the one this drain's upload got): "
                    f"{self.label(step)} is not committed; the drain of "
                    f"{self.step_url(step)} tries again"
                )
            written[rel] = identity(o)
        self.record(step, local, objects={**mine, **written})

    def copy_payload(
        self,
        step: Key,
        remote: Store,
        remote_prefix: str,
        options: TransferOptions,
        exclude: Sequence[str],
        local: CheckpointInfo | None = None,
    ) -> None:
        """Copy the local objects of ``step`` (a step or a name; its local commit
        ``local``, default the one committed now) to ``remote_prefix`` but those named
        in ``exclude``, keeping only what is proven this commit's (:meth:`send_payload`)."""
        local = self.info(step) if local is None else local
        if local is None:
            raise NotFoundError(f"{self.label(step)} is not committed in the local tier {self.url}")
        self.send_payload(step, local, remote, remote_prefix, options, exclude)

    @staticmethod
    def label(key: Key) -> str:
        """``key`` as messages name it: ``step N``, or the checkpoint's name."""
        return key if isinstance(key, str) else f"step {key}"

    def drain_ranks(
        self,
        key: Key,
        remote: Store,
        remote_prefix: str,
        *,
        group: Any,
        owner: bool,
        send: Callable[[CheckpointInfo], None],
        commit: Callable[[CheckpointInfo, dict[str, int | None]], None],
        uncommit: Sequence[str] = (),
    ) -> None:
        """Drain ``key``'s local commit on every rank of ``group`` (a collective): the
        first rank deletes the bucket's commit markers named in ``uncommit`` (an earlier
        save's), then what under ``remote_prefix`` is none of any directory's files
        (:meth:`remove_strays`); each directory's first rank (``owner``) sends its files
        but the coordinator's (``send``: :meth:`send_payload`, keeping only objects
        proven its own); once every rank's are there, the first rank's ``commit(local,
        files)`` sends the rest, commit markers last, and commits; each owner journals
        the commit."""
        local = self.info(key)
        mine = self.payload_files(local) if owner and local is not None else {}
        files: dict[str, int | None] = {}
        for each in agree(value=mine, group=group).values:
            files.update(each)
        url, what = remote.url(remote_prefix), self.label(key)

        def clear() -> None:  # an earlier save's commit goes first, then its leftovers
            for name in uncommit:
                remote.delete(remote_prefix + name)
            self.remove_strays(remote, remote_prefix, set(files))

        error: BaseException | None = None
        try:  # a collective: every rank reaches it
            on_first(clear, group, what=f"clearing leftovers under {url}")
        except Exception as exc:
            error = exc
        try:
            if error is None and local is None:
                raise NotFoundError(f"{what} is not committed in {self.url}")
            if error is None and owner and local is not None:
                send(local)  # each directory holds the coordinator's files: sent once, last
        except Exception as exc:
            error = exc
        settle(error, f"the drain of {what} to {url}", group=group)

        def first() -> None:  # every rank's files are in the bucket
            assert local is not None
            commit(local, files)

        on_first(first, group, what=f"the commit of {url}")
        if owner and local is not None:
            try:
                self.record(key, local, committed=True)
            except Exception as exc:  # the bucket has it; a later listing learns it
                log.warning("recording the drain of %s failed: %s", what, exc)

    def whole_steps(
        self, damaged: builtins.list[DamagedMarker] | None = None
    ) -> builtins.list[int]:
        """This run's local steps whose every file is there at its marker's size (those
        whose marker is damaged: added to ``damaged`` when given)."""
        found = []
        for info in self.list(damaged):
            try:
                self.check_files(info)
            except (CorruptCheckpointError, NotFoundError):
                continue
            found.append(info.step)
        return found

    # -- restore -------------------------------------------------------------------------
    def check_files(self, info: CheckpointInfo, prefix: str | None = None) -> None:
        """Every file the local marker lists is there, at its size (else NotFoundError
        or CorruptCheckpointError naming it); under ``prefix`` (default: the step's)."""
        check_files(self.store, self.step_prefix(info.step) if prefix is None else prefix, info)


def _by_folder(names: Sequence[str]) -> builtins.list[tuple[str, builtins.list[str]]]:
    """``names`` (paths under a step, in commit order) as runs of names in one folder:
    each folder (``""`` or ``"a/"``) with its names' last parts, the order kept."""
    runs: builtins.list[tuple[str, builtins.list[str]]] = []
    for name in names:
        folder, _, last = name.rpartition("/")
        folder = folder + "/" if folder else ""
        if runs and runs[-1][0] == folder:
            runs[-1][1].append(last)
        else:
            runs.append((folder, [last]))
    return runs


def merge_tiers(
    remote: Sequence[CheckpointInfo], local: Sequence[CheckpointInfo]
) -> list[CheckpointInfo]:
    """One entry per step committed in either tier, oldest first, saying which tiers
    hold it (the bucket's description where it has the step)."""
    by_step: dict[int, CheckpointInfo] = {c.step: replace(c, tiers=(LOCAL,)) for c in local}
    for c in remote:
        tiers = (LOCAL, REMOTE) if c.step in by_step else (REMOTE,)
        by_step[c.step] = replace(c, tiers=tiers)
    return [by_step[s] for s in sorted(by_step)]


def check_free(path: Path, need: int) -> None:
    """LocalTierFullError, before anything is written, when the filesystem of the local
    tier ``path`` has less than ``need`` bytes free."""
    free = shutil.disk_usage(path).free
    if free < need:
        raise LocalTierFullError(
            f"the local tier {path} has {free} bytes free, less than the {need} bytes a "
            "checkpoint takes; free space there or lower keep_local"
        )


def tensor_bytes(state: Any, depth: int = 0) -> int:
    """The bytes of the tensors in ``state`` (nested dicts, lists, tuples, and objects
    holding a tensor as ``data``, such as megatron's ``ShardedTensor``): an estimate of a
    first checkpoint's size, found without importing torch."""
    if depth > 64:
        return 0
    if isinstance(state, Mapping):
        return sum(tensor_bytes(v, depth + 1) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v, depth + 1) for v in state)
    if type(state).__module__.startswith("torch"):
        nbytes = getattr(state, "nbytes", None)
        return nbytes if isinstance(nbytes, int) else 0
    data = getattr(state, "data", None)
    if data is not None and type(data).__module__.startswith("torch"):
        return tensor_bytes(data, depth + 1)
    return 0

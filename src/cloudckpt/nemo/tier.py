"""A local tier for NeMo's checkpoint I/O: named checkpoints saved to node-local disk,
committed there, then drained to the bucket in the background (docs/megatron.md, "NeMo:
local tier").

It is the manager's tier (manager/tiers.py, :class:`LocalTier`) keyed by NeMo's names:
``local_dir/<name>/weights/`` on every rank (the bucket's layout under its ``dirpath``;
``weights/`` is the tier's payload folder), each directory completed with the
coordinator's files and committed by the manager's marker (``<name>/_CHECKPOINT.json``:
the checkpoint's global step, NeMo's name in its metadata), claimed for one bucket
``dirpath`` by the run file of :mod:`cloudckpt.engine.drain`. The local commit, the
drain of one name on every rank (:meth:`LocalTier.drain_ranks`), its drain record
(``_DRAINS/<name>.json``), the removal of a copy and the sweep of crash leftovers are
that tier's; what is NeMo's here is the binding to a ``dirpath``, which names to drain
or keep, and the fences between a name's saves, drains and removals.

A name can be saved again (NeMo's names repeat: a ``-last`` checkpoint saved twice at
one step), so the bucket's files of a name may belong to an earlier save, whatever
their time or size. A drain first deletes the bucket's ``metadata.json`` of the name
(megatron's commit: an earlier save's), then every object that is none of this commit's
files, and keeps one of its files only when proven this commit's bytes (this drain's
record, or a checksum the bucket reports: engine/proof.py), sending the others again;
``metadata.json`` goes last, once every rank's files are there. "Is this copy drained?"
(retention, loads, the drains left to do) is read from the drain record, with no request
to the bucket. A new save of a name waits for a drain of it under way
(:meth:`NemoTier.forget`). An earlier release's record (``<name>.drain.json`` beside the
folder) still says whether its copy was drained; a copy without any record is drained
again, keeping what is proven.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engine.drain import Drainer, directory_owner, is_outage, read_owner
from ..engine.journal import identity
from ..errors import CorruptCheckpointError, LocalTierFullError, NotFoundError, StorageError
from ..format.commit import MEGATRON_MARKER
from ..manager.marker import MARKER_NAME, CheckpointInfo, read_marker
from ..manager.payload import MegatronPayload
from ..manager.tiers import LocalTier, check_free, check_positive, tensor_bytes
from ..options import TransferOptions
from ..ranks.collectives import agree, on_first, settle
from ..ranks.groups import checkpoint_group, drain_group
from ..store import ObjectInfo, Target
from ..store.local import LocalStore
from ..store.overlay import OverlayStore
from ..store.paths import MAX_RECORD_BYTES, read_capped
from .paths import WEIGHTS

__all__ = ["NemoTier", "committed_locally", "local_commits", "newer_in_bucket"]

log = logging.getLogger("cloudckpt")

#: The metadata key of a local marker naming NeMo's checkpoint.
NAME_KEY = "nemo_name"
#: Beside a checkpoint's folder (``<name>`` + this): whether its drain was done, as an
#: earlier release recorded it (now ``_DRAINS/<name>.json``, engine/journal.py).
LEGACY_RECORD = ".drain.json"


class NemoTier:
    """One rank's local copy of the named checkpoints of one bucket ``dirpath``.

    Bound to the first ``dirpath`` it serves (:meth:`bind`, on every rank); the
    ``keep_local`` newest local copies are kept (None: all), never one not drained.
    """

    def __init__(
        self, local_dir: str | os.PathLike[str], keep_local: int | None, options: TransferOptions
    ) -> None:
        check_positive("keep_local", keep_local)
        self.path = Path(local_dir).expanduser()
        self.keep = keep_local
        # The bucket's storage options (endpoint, credentials) mean nothing here.
        self.options = options.replace(storage_options={})
        self.tier: LocalTier | None = None
        self.dirpath: str | None = None
        self.remote: Target | None = None
        self.usable = False
        self.drainer: Drainer[str] | None = None
        self._cond = threading.Condition()
        self._draining: str | None = None
        self._removed: set[str] = set()  # removed from the bucket: never drained
        self._forgetting: set[str] = set()  # being saved again: no drain of the old copy
        #: Per name saved again in this process: the bucket objects its drained earlier
        #: commit left there, which the new commit replaces (``bucket_newer``).
        self._replaced: dict[str, dict[str, str]] = {}
        #: The local commit each drain under way sends (read when it began: a new save
        #: of the name uncommits it meanwhile, and waits for the drain to end).
        self._sending: dict[str, CheckpointInfo] = {}
        self._drain_owner: bool | None = None
        self._retain_lock = threading.Lock()

    # -- binding -------------------------------------------------------------------------
    def bind(self, dirpath: str, remote: Target) -> bool:
        """Serve the bucket ``dirpath`` (``remote``: its store and key), on every rank
        (a collective the first time); False when the tier does not serve it: another
        ``dirpath``, or a directory some rank's run file gives to another run (WARNING).
        The first time, the drains an earlier process left unfinished are queued."""
        if self.dirpath is not None:
            return self.usable and dirpath == self.dirpath
        error: BaseException | None = None
        owned = False
        try:  # the manager's tier: its run file claimed for dirpath (WARNING if another's)
            tier = LocalTier(self.path, dirpath, self.options, self.keep, 1, payload=f"{WEIGHTS}/")
            self.tier, owned = tier, tier.owned
        except Exception as exc:
            error = exc
        values = agree(error, value=owned, group=checkpoint_group()).values
        self.dirpath, self.remote = dirpath, remote
        self.usable = all(values)
        if error is not None:
            log.warning(
                "local_dir %s has an unreadable run file (%s): checkpoints go straight to "
                "the bucket",
                self.path,
                error,
            )
        elif owned and not self.usable:
            log.warning(
                "local_dir %s is not used: another rank's local_dir belongs to another run; "
                "checkpoints go straight to the bucket",
                self.path,
            )
        if self.usable:
            self.drainer = Drainer(
                self._drain_queued,
                self._local().url,
                dirpath,
                noun="checkpoint",
                at_exit="the next CloudMegatronCheckpointIO with this local_dir finishes it",
                retry="drain()",
                merge=False,  # its drains are collectives: every rank runs every submit
            )
            for name in self._undrained(checkpoint_group()):
                self.drainer.submit(name)
        return self.usable

    def weights_path(self, name: str) -> str:
        """The local directory of checkpoint ``name``'s megatron files."""
        return str(self.path / name / WEIGHTS)

    def save_path(self, name: str) -> str:
        """:meth:`weights_path`, for megatron's save by path: made first by the tier's
        store, so a ``name`` or ``weights`` that is a symbolic link is refused
        (UnsafePathError) rather than saved through."""
        self._local().store.make_dirs(f"{name}/{WEIGHTS}/")
        return self.weights_path(name)

    def _remote_prefix(self, name: str) -> str:
        assert self.remote is not None
        return f"{self.remote.key}/{name}/{WEIGHTS}/"

    def _local(self) -> LocalTier:
        assert self.tier is not None, "the tier is not bound yet"
        return self.tier

    # -- local commits -------------------------------------------------------------------
    def info(self, name: str) -> CheckpointInfo | None:
        """The local commit of ``name`` (None: not committed here)."""
        return self._local().info(name)

    def local(self) -> list[tuple[CheckpointInfo, str]]:
        """This rank's locally committed checkpoints and their names, oldest first."""
        return local_commits(self._local().store)

    def check_room(self, checkpoint: Any) -> None:
        """Before a save writes anything, on every rank (a collective): each rank's local
        tier has room for the larger of its last local copy and this rank's tensors;
        else LocalTierFullError on the rank lacking it, CollectiveError naming it on the
        others."""
        error: BaseException | None = None
        try:
            self._local().sweep()  # before the room is counted
            last = max((info.size for info, _ in self.local()), default=0)
            check_free(self.path, max(last, tensor_bytes(checkpoint)))
        except LocalTierFullError as exc:
            error = exc
        settle(error, f"the room check of the local tiers ({self.path})", group=checkpoint_group())

    def forget(self, name: str) -> None:
        """Uncommit an older local copy of ``name`` before it is saved again, then remove
        its files and whatever a killed save of the name left (every rank, collectives
        on the checkpoint group), so the commit, which lists the folder, records this
        save's files only. A drain of it under way ends first: the first rank's drain of
        a name spans every rank's copying of it, so once the first rank has waited for
        it no rank's drainer reads the files this save replaces; every rank waits for
        that before any uncommits (the drain commits the bucket's copy first), and no
        drain of the old copy starts meanwhile. Each directory's
        first rank then clears the folder (LocalTier.clear_ranks) before any rank writes."""
        group = checkpoint_group()
        with self._cond:  # only the first rank's drainer ever has one under way
            while self._draining == name:
                self._cond.wait()
            self._forgetting.add(name)  # and none of the old copy starts from now
        try:
            # Every rank past that drain before any uncommits: a rank that uncommitted
            # at once left its copy unmarked while the drain had already removed the
            # bucket's older commit of the name; a crash then left nothing to restore.
            settle(None, f"the drain of {name} before it is saved again", group=group)
            error: BaseException | None = None
            try:
                old = self.info(name)
                found = self._local().journal(name, old) if old is not None else None
                if found is not None and found["committed"]:  # what the bucket holds of it
                    with self._cond:
                        self._replaced[name] = dict(found["objects"])
                self._local().store.delete(f"{name}/{MARKER_NAME}")
            except Exception as exc:
                error = exc
            settle(error, f"uncommitting the local copy of {name}", group=group)
        finally:
            with self._cond:
                self._forgetting.discard(name)
        self._local().clear_ranks(name, group, replaced=True)

    def release(self, name: str) -> None:
        """Give up the save lock on ``name``'s folder that :meth:`forget` took, if this
        rank holds it (a save that failed before its commit)."""
        self._local().release(name)

    def commit(self, name: str, step: int) -> None:
        """After megatron's save into every rank's ``weights_path(name)``: each directory
        gets the coordinator's files (commit order), then its first rank commits it
        (LocalTier.commit_ranks); a collective on the checkpoint group, raising on every
        rank if any rank failed. An earlier release's record of the name goes first: it
        was of the copy this save replaced."""
        tier = self._local()
        tier.store.delete(f"{name}{LEGACY_RECORD}")
        metadata = {NAME_KEY: name}
        tier.commit_ranks(name, step, MegatronPayload(), {}, metadata, checkpoint_group(), name)

    def whole(self, name: str) -> str | None:
        """Why this rank cannot read ``name`` locally (None: every file its local marker
        lists is there at its size)."""
        try:
            info = self.info(name)
            if info is None:
                return f"{name} is not committed in {self.path}"
            self._local().check_files(info, f"{name}/")
        except (NotFoundError, CorruptCheckpointError) as exc:
            return str(exc)
        return None

    def view(self, name: str) -> Target:
        """``name``'s megatron files as a load reads them: each from this rank's local
        copy when its local marker lists it, else (a file another node's ranks wrote,
        such as a tensor only the coordinator saved) from the bucket's committed copy
        (store/overlay.py); without one, such a file fails the load naming it."""
        info = self.info(name)
        if info is None:
            raise NotFoundError(f"{name} is not committed in {self.path}")
        remote = self.remote
        assert remote is not None
        view = OverlayStore(
            self._local().store,
            f"{name}/",
            [f.name for f in info.files],
            remote.store if self._drained(info, name) else None,
            f"{remote.key}/{name}/",
            what=name,
            hint="another node's local tier holds it: drain() the checkpoint to read it here",
        )
        url = self.weights_path(name)
        return Target(url, view, WEIGHTS, self.options, url)

    def bucket_newer(self, name: str, *, drain: bool = False) -> str | None:
        """Why the bucket's committed copy of ``name`` is to be read (and kept) instead
        of this local commit: it is not this copy's drain, nor this process's earlier
        commit of the name that this copy replaces, and it is newer (:func:`newer_in_bucket`):
        another save of the name, such as another node's after this copy was committed.
        None: the local commit is this name's newest as far as one listing of the
        bucket's ``weights/`` tells. A bucket that cannot be reached: for a load,
        None (the local copy, WARNING); for a ``drain``, the error (it is tried again).

        "This copy's drain" is every object its drain record lists, still there as
        listed then (size, ETag and time): megatron's ``metadata.json`` alone is the
        same bytes in every save."""
        info = self.info(name)
        if info is None or self.remote is None:
            return None
        prefix = self._remote_prefix(name)
        try:  # one listing: each object's size, ETag and time
            listed = {o.key[len(prefix) :]: o for o in self.remote.store.list(prefix)}
        except Exception as exc:
            if drain or not is_outage(exc):
                raise
            log.warning(
                "the bucket %s is unreachable (%s: %s): %s is read from the local tier %s "
                "unchecked against the bucket's commit of it",
                self.remote.url,
                type(exc).__name__,
                exc,
                name,
                self.path,
            )
            return None
        there = listed.get(MEGATRON_MARKER)
        if there is None:
            return None
        found = self._local().journal(name, info)
        if found is not None and found["committed"] and _listed_as(found["objects"], listed):
            return None  # the bucket's commit is this copy's drain
        if found is None and self._legacy_drained(name):
            return None  # an earlier release's record: no objects to compare
        with self._cond:
            replaced = self._replaced.get(name)
        if replaced is not None and _listed_as(replaced, listed):
            return None  # this process's earlier commit of the name, which this one replaces
        if there.mtime is not None and newer_in_bucket(there.mtime, info.time):
            return (
                f"the bucket's commit of {name} ({_when(there.mtime)}) is newer than the "
                f"local tier's ({_when(info.time)}): another save of the name"
            )
        return None

    # -- the drain record ----------------------------------------------------------------
    def _drained(self, info: CheckpointInfo, name: str) -> bool:
        """Whether the bucket holds this local commit of ``name`` committed, as its drain
        record says (no request to the bucket), or an earlier release's record beside
        it. A copy without either is not: its drain proves what the bucket holds."""
        return self._local().drained(info, name) or self._legacy_drained(name)

    def _legacy_drained(self, name: str) -> bool:
        """What an earlier release's ``<name>.drain.json`` says of its copy's drain
        (False: none, or one that cannot be read: a WARNING)."""
        store = self._local().store
        key = f"{name}{LEGACY_RECORD}"
        try:
            drained = json.loads(read_capped(store, key, MAX_RECORD_BYTES))["drained"]
            if not isinstance(drained, bool):
                raise ValueError(f"not a boolean: {drained!r}")
        except NotFoundError:
            return False
        except (ValueError, TypeError, KeyError, OSError, CorruptCheckpointError) as exc:
            log.warning("ignoring %s: %s", store.url(key), exc)
            return False
        return drained

    def _undrained(self, group: Any) -> list[str]:
        """The names every rank holds committed locally and the bucket lacks, in the
        first rank's order (a collective on ``group``). A name the first rank lacks was
        removed (a removal deletes the first rank's copy): the others may prune theirs."""
        mine = [n for info, n in self.local() if not self._drained(info, n)]
        lists = agree(value=mine, group=group).values
        first = lists[0]
        common = [n for n in first if all(n in other for other in lists[1:])]
        with self._cond:
            self._removed.update(n for n in mine if n not in first)
        lacking = sorted(set(first) - set(common))
        if lacking:
            log.warning("checkpoint(s) %s are not in every rank's local tier: not drained", lacking)
        return common

    # -- drains --------------------------------------------------------------------------
    def queue(self, name: str) -> None:
        """Queue the drain of ``name`` (every rank, in the same order, after its commit)."""
        assert self.drainer is not None
        self.drainer.submit(name)

    def _drain_queued(self, name: str) -> None:
        """The drainer's work, on every rank: drain ``name`` on the drain group."""
        self.drain_one(name, drain_group())
        self.retain()

    def _owner(self, group: Any) -> bool:
        """Whether this rank is its directory's first on ``group`` (found once)."""
        if self._drain_owner is None:
            self._drain_owner = directory_owner(self.path, group)[0]
        return self._drain_owner

    def drain_one(self, name: str, group: Any) -> None:
        """Copy ``name`` to the bucket (every rank of ``group``): the first rank says
        whether it is still wanted (not removed, not there yet); then the manager's
        drain of several ranks (LocalTier.drain_ranks): the bucket's ``metadata.json``
        of the name first deleted, then what is none of its files; each directory's
        first rank copies its files, then the coordinator its own, ``metadata.json``
        last. Each object there is kept only when proven this commit's."""
        owner = self._owner(group)

        def wanted() -> str:
            with self._cond:  # the marker read under the lock forget() deletes it under
                if name in self._removed:
                    return "removed"
                if name in self._forgetting:  # being saved again: its new copy drains
                    return "done"
                info = self.info(name)
                if info is None or self._drained(info, name):
                    return "done"
                self._draining = name  # a removal or a new save of it waits for this drain
            return "drain"

        def wanted_over_the_bucket() -> str:
            decision = wanted()
            if decision != "drain":
                return decision
            try:
                newer = self.bucket_newer(name, drain=True)  # one listing, outside the lock
            except BaseException:
                self._end_drain(name)
                raise
            if newer is None:
                return decision
            self._end_drain(name)
            log.warning(
                "%s: %s; the bucket keeps its own, and the local copy in %s is not drained",
                name,
                newer,
                self.path,
            )
            return "newer"

        decision = on_first(wanted_over_the_bucket, group, what=f"deciding the drain of {name}")
        if decision == "removed":  # every rank may now prune its copy
            with self._cond:
                self._removed.add(name)
        if decision != "drain":
            return
        tier, prefix = self._local(), self._remote_prefix(name)
        assert self.remote is not None
        remote = self.remote.store
        try:
            tier.drain_ranks(
                name,
                remote,
                prefix,
                group=group,
                owner=owner,
                send=lambda local: self._send(name, local, MegatronPayload().coordinator_files),
                commit=lambda local, files: self._send(name, local, ()),
                uncommit=(MEGATRON_MARKER,),
            )
            if owner:  # the drain record says it now
                tier.store.delete(f"{name}{LEGACY_RECORD}")
        finally:
            self._end_drain(name)

    def _end_drain(self, name: str) -> None:
        """The drain of ``name`` (or the decision to skip it) is over."""
        with self._cond:
            if self._draining == name:
                self._draining = None
            self._cond.notify_all()

    def _send(self, name: str, local: CheckpointInfo, exclude: tuple[str, ...]) -> None:
        """A drain's copy of ``name``'s local commit ``local`` (:meth:`_copy`); with no
        ``exclude`` (the coordinator's, ``metadata.json`` last: the bucket's commit) a
        commit whose objects another save wrote meanwhile is withdrawn."""
        self._sending[name] = local
        try:
            self._copy(name, exclude)
        except StorageError:
            if not exclude:
                assert self.remote is not None
                prefix = self._remote_prefix(name)
                LocalTier.withdraw(self.remote.store, prefix + MEGATRON_MARKER)
            raise
        finally:
            self._sending.pop(name, None)

    def _copy(self, name: str, exclude: tuple[str, ...]) -> None:
        """Copy ``name``'s local megatron files (of the drain under way, else of its
        local commit) to the bucket but those in ``exclude`` (commit markers last),
        keeping only the objects there proven this commit's (LocalTier.send_payload)."""
        assert self.remote is not None
        self._local().copy_payload(
            name,
            self.remote.store,
            self._remote_prefix(name),
            self.remote.options,
            exclude,
            self._sending.get(name),
        )

    def drain(self, timeout: float | None = None) -> None:
        """Every rank: try the failed drains again (every rank failed the same ones: a
        drain's error reaches every rank) and wait for the background drains, raising
        the first one that fails again; then drain together whatever else the bucket
        lacks (an earlier process's)."""
        if self.drainer is None:
            return
        self.drainer.retry_failed()
        failed = self.drainer.wait(timeout)
        if failed:
            raise failed[min(failed)]
        group = drain_group()
        for name in self._undrained(group):
            self.drain_one(name, group)
        self.retain()

    def unfinished(self) -> set[str]:
        """Names queued, draining or failed on this rank."""
        return set() if self.drainer is None else self.drainer.unfinished()

    # -- removal and retention -----------------------------------------------------------
    def removing(self, name: str) -> None:
        """Before ``name`` is deleted from the bucket (on the first rank): its drain, if
        not started, never starts; one under way is waited for. This rank's local copy
        is deleted, so no later process drains it again."""
        with self._cond:
            self._removed.add(name)
            while self._draining == name:
                self._cond.wait()
        self._delete(name)

    def _delete(self, name: str) -> None:
        """Delete this rank's local copy of ``name`` (its marker first, its folders and
        records too: LocalTier.drop)."""
        tier = self._local()
        tier.drop([name])
        tier.store.delete(f"{name}{LEGACY_RECORD}")

    def recorded_dirpath(self) -> str | None:
        """The bucket ``dirpath`` this directory's run file names (None: none yet)."""
        if not self.path.is_dir():
            return None
        return read_owner(LocalStore(self.path))

    def retain(self) -> None:
        """Delete this rank's local copies beyond the ``keep_local`` newest, never one
        queued, draining, or not in the bucket (unless removed from it); first sweep the
        temp files of dead writers (never a live writer's)."""
        if self.tier is None:
            return
        self.tier.sweep()
        if self.keep is None:
            return
        with self._retain_lock:
            found = self.local()
            busy = self.unfinished()
            for info, name in found[: max(0, len(found) - self.keep)]:
                with self._cond:
                    if name in busy or name == self._draining:
                        continue
                    gone = name in self._removed
                try:
                    if gone or self._drained(info, name):
                        self._delete(name)
                except Exception as exc:
                    log.warning("retention in the local tier %s failed: %s", self.path, exc)


def newer_in_bucket(bucket_time: float, local_time: float) -> bool:
    """Whether a bucket commit made at ``bucket_time`` is newer than a local commit made
    at ``local_time``. A bucket time in whole seconds (S3's listings) stands for any
    moment of that second, so a local commit made within it counts as the older: the
    bucket's is read and nothing is drained over it (the other order would destroy a
    newer commit when wrong)."""
    resolution = 1.0 if float(bucket_time).is_integer() else 0.0
    return bucket_time + resolution > local_time


def _listed_as(recorded: Mapping[str, str], listed: Mapping[str, ObjectInfo]) -> bool:
    """Whether every object ``recorded`` (name: identity) is in ``listed`` as recorded
    (size, ETag and time), ``metadata.json`` among them."""
    return MEGATRON_MARKER in recorded and all(
        n in listed and identity(listed[n]) == v for n, v in recorded.items()
    )


def _when(seconds: float) -> str:
    """A commit time as UTC ISO 8601, to the second."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def local_commits(store: LocalStore) -> list[tuple[CheckpointInfo, str]]:
    """The checkpoints committed in the local tier ``store`` and their names, oldest
    first (a damaged marker is skipped, WARNING)."""
    found = []
    for o in store.list(""):
        parts = o.key.split("/")
        if len(parts) == 2 and parts[1] == MARKER_NAME:
            try:
                info = read_marker(store, o.key)
            except CorruptCheckpointError as exc:
                log.warning("skipping %s: %s", store.url(o.key), exc)
                continue
            if info is not None:
                found.append((info, parts[0]))
    return sorted(found, key=lambda item: (item[0].time, item[1]))


def committed_locally(
    local_dir: str | os.PathLike[str], dirpath: str
) -> list[tuple[CheckpointInfo, str]]:
    """The checkpoints committed in the local tier at ``local_dir`` for the bucket
    ``dirpath`` and their names, oldest first: none when the directory is missing or
    its run file names another ``dirpath`` (read only: nothing is claimed or made)."""
    path = Path(local_dir).expanduser()
    if not path.is_dir():
        return []
    store = LocalStore(path)
    try:
        if read_owner(store) != dirpath:
            return []
    except CorruptCheckpointError as exc:
        log.warning("local_dir %s is not read: %s", path, exc)
        return []
    return local_commits(store)

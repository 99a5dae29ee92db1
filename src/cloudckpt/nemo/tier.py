"""A local tier for NeMo's checkpoint I/O: named checkpoints saved to node-local disk,
committed there, then drained to the bucket in the background (docs/megatron.md, "NeMo:
local tier").

The tier is ``local_dir/<name>/weights/`` on every rank (the bucket's layout under its
``dirpath``), each directory completed with the coordinator's files and committed by
the manager's marker (``<name>/_CHECKPOINT.json``: the checkpoint's global step, NeMo's
name in its metadata). The directory is claimed for one bucket ``dirpath`` by the run
file of :mod:`cloudckpt.engine.drain`. A drain runs on every rank, on a gloo group of
its own: each directory's first rank copies its files, then the coordinator copies its
own with megatron's ``metadata.json`` last, so the bucket's copy commits only once whole.

A name can be saved again (NeMo's names repeat: a ``-last`` checkpoint saved twice at
one step), so the bucket's files of a name may belong to an earlier save, whatever
their time or size. Each directory records how far the drain of its local commit got
in the drain record every tier keeps (engine/journal.py, ``_DRAINS/<name>.json``, tied
to the local marker's time): written before the local marker, ``started`` once the
first drain of that commit has emptied the bucket's folder, ``committed`` after the
bucket's commit; "is this copy drained?" (retention, loads, the drains left to do) is
read there, with no request to the bucket. The first drain of a commit deletes every
file of the name in the bucket (the earlier save's commit marker first); a drain after
a crash keeps what the started one sent. A new save of a name waits for a drain of it
under way (:meth:`NemoTier.forget`). An earlier release's record (``<name>.drain.json``
beside the folder) is read as such until a drain writes the new one. A copy committed
without any record (an earlier release still) keeps the time rule of the manager's
tier, asking the bucket: its files older than the copy are stale.

Each save (before it writes) and each retention sweeps the temp files of dead writers
from the tier (``engine/leftovers.sweep_leftovers``), never a live writer's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..engine.copy import copy_tree
from ..engine.drain import Drainer, claim, complete_directories, directory_owner, read_owner
from ..engine.journal import DrainJournal, DrainRecord
from ..engine.leftovers import sweep_leftovers
from ..engine.remove import remove_checkpoint
from ..errors import ConfigError, CorruptCheckpointError, LocalTierFullError, NotFoundError
from ..format.commit import MEGATRON_MARKER
from ..manager.marker import MARKER_NAME, CheckpointInfo, check_files, commit_step, read_marker
from ..manager.payload import MegatronPayload
from ..manager.tiers import CLOCK_SLACK, LocalTier, check_free, tensor_bytes
from ..options import TransferOptions
from ..ranks.collectives import agree, on_first, settle, world_size
from ..ranks.groups import checkpoint_group, drain_group
from ..store import Target
from ..store.local import LocalStore
from ..store.overlay import OverlayStore
from ..store.paths import MAX_RECORD_BYTES, read_capped
from .paths import WEIGHTS

__all__ = ["NemoTier"]

log = logging.getLogger("cloudckpt")

#: The metadata key of a local marker naming NeMo's checkpoint.
NAME_KEY = "nemo_name"
#: Beside a checkpoint's folder (``<name>`` + this): how far its drain got, as an
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
        if keep_local is not None and (
            not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 1
        ):
            raise ConfigError(f"keep_local={keep_local!r} must be a positive integer")
        self.path = Path(local_dir).expanduser()
        self.keep = keep_local
        # The bucket's storage options (endpoint, credentials) mean nothing here.
        self.options = options.replace(storage_options={})
        self.store: LocalStore | None = None
        self.journal: DrainJournal | None = None
        self.dirpath: str | None = None
        self.remote: Target | None = None
        self.usable = False
        self.drainer: Drainer[str] | None = None
        self._cond = threading.Condition()
        self._draining: str | None = None
        self._removed: set[str] = set()  # removed from the bucket: never drained
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
        self.path.mkdir(parents=True, exist_ok=True)
        self.store = LocalStore(self.path)
        error: BaseException | None = None
        owner = dirpath
        try:
            owner = claim(self.store, dirpath)
        except Exception as exc:
            error = exc
        values = agree(error, value=owner == dirpath, group=checkpoint_group()).values
        self.dirpath, self.remote = dirpath, remote
        self.journal = DrainJournal(self.store, dirpath)
        self.usable = error is None and all(values)
        if error is not None or owner != dirpath:
            log.warning(
                "local_dir %s holds the local tier of %s, not of %s: checkpoints go "
                "straight to the bucket",
                self.path,
                owner if error is None else f"an unreadable run file ({error})",
                dirpath,
            )
        elif not self.usable:
            log.warning(
                "local_dir %s is not used: another rank's local_dir belongs to another run; "
                "checkpoints go straight to the bucket",
                self.path,
            )
        if self.usable:
            self.drainer = Drainer(
                self._drain_queued,
                self.store.root_url,
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
        self._local_store().make_dirs(f"{name}/{WEIGHTS}/")
        return self.weights_path(name)

    def _remote_prefix(self, name: str) -> str:
        assert self.remote is not None
        return f"{self.remote.key}/{name}/{WEIGHTS}/"

    def _local_store(self) -> LocalStore:
        assert self.store is not None, "the tier is not bound yet"
        return self.store

    # -- local commits -------------------------------------------------------------------
    def info(self, name: str) -> CheckpointInfo | None:
        """The local commit of ``name`` (None: not committed here)."""
        return read_marker(self._local_store(), f"{name}/{MARKER_NAME}")

    def local(self) -> list[tuple[CheckpointInfo, str]]:
        """This rank's locally committed checkpoints and their names, oldest first."""
        store = self._local_store()
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

    def check_room(self, checkpoint: Any) -> None:
        """Before a save writes anything, on every rank (a collective): each rank's local
        tier has room for the larger of its last local copy and this rank's tensors;
        else LocalTierFullError on the rank lacking it, CollectiveError naming it on the
        others."""
        error: BaseException | None = None
        try:
            sweep_leftovers(self._local_store())  # before the room is counted
            last = max((info.size for info, _ in self.local()), default=0)
            check_free(self.path, max(last, tensor_bytes(checkpoint)))
        except LocalTierFullError as exc:
            error = exc
        settle(error, f"the room check of the local tiers ({self.path})", group=checkpoint_group())

    def forget(self, name: str) -> None:
        """Uncommit an older local copy of ``name`` before it is saved again (every rank,
        a collective on the checkpoint group). A drain of it under way ends first: the
        first rank's drain of a name spans every rank's copying of it, so once the first
        rank has waited for it no rank's drainer reads the files this save replaces; and
        with the first rank's marker gone, no drain of the old copy starts after."""
        error: BaseException | None = None
        try:
            with self._cond:
                while self._draining == name:
                    self._cond.wait()
                self._local_store().delete(f"{name}/{MARKER_NAME}")
        except Exception as exc:
            error = exc
        settle(error, f"uncommitting the local copy of {name}", group=checkpoint_group())

    def commit(self, name: str, step: int) -> None:
        """After megatron's save into every rank's ``weights_path(name)``: each directory
        gets the coordinator's files (commit order), then its first rank commits it; a
        collective on the checkpoint group, raising on every rank if any rank failed."""
        store = self._local_store()
        group = checkpoint_group()
        owner, coordinators = directory_owner(self.path, group)
        prefix = f"{name}/{WEIGHTS}/"
        names = MegatronPayload().coordinator_files
        what = f"{name}'s coordinator files ({', '.join(names)})"
        complete_directories(
            store, prefix, names, owner=owner, coordinators=coordinators, group=group, what=what
        )
        error: BaseException | None = None
        try:
            if owner:
                when = time.time()  # the record's and the marker's: one local commit
                self._record(name, when, started=False, committed=False)
                ranks = world_size()
                commit_step(
                    store,
                    f"{name}/",
                    step,
                    "megatron",
                    {},
                    {NAME_KEY: name},
                    when=when,
                    ranks=ranks if ranks > 1 else 0,
                )
        except Exception as exc:
            error = exc
        settle(error, f"the local commit of {name} in {self.path}", group=group)

    def whole(self, name: str) -> str | None:
        """Why this rank cannot read ``name`` locally (None: every file its local marker
        lists is there at its size)."""
        try:
            info = self.info(name)
            if info is None:
                return f"{name} is not committed in {self.path}"
            check_files(self._local_store(), f"{name}/", info)
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
            self._local_store(),
            f"{name}/",
            [f.name for f in info.files],
            remote.store if self._drained(info, name) else None,
            f"{remote.key}/{name}/",
            what=name,
            hint="another node's local tier holds it: drain() the checkpoint to read it here",
        )
        url = self.weights_path(name)
        return Target(url, view, WEIGHTS, self.options, url)

    # -- the bucket ----------------------------------------------------------------------
    def _bucket_commit(self, name: str) -> float | None:
        """When the bucket's copy of ``name`` was committed (None: it is not)."""
        assert self.remote is not None
        try:
            found = self.remote.store.head(self._remote_prefix(name) + MEGATRON_MARKER)
        except NotFoundError:
            return None
        return float("inf") if found.mtime is None else found.mtime  # no time: trust it

    def _drained(self, info: CheckpointInfo, name: str) -> bool:
        """Whether the bucket holds this local commit of ``name`` committed: as its drain
        record says (no request to the bucket); without one (a copy an earlier release
        committed), whether the bucket's commit is there and no older than the local one."""
        recorded = self._drain_record(info, name)
        if recorded is not None:
            return recorded.committed
        when = self._bucket_commit(name)
        return when is not None and when >= info.time - CLOCK_SLACK

    def _drain_record(self, info: CheckpointInfo, name: str) -> DrainRecord | None:
        """The record of the drain of ``name``'s local commit ``info`` in this directory
        (engine/journal.py), else an earlier release's ``<name>.drain.json`` (None:
        neither, or one that cannot be read: a WARNING)."""
        assert self.journal is not None and self.dirpath is not None
        found = self.journal.read(name, info.time)
        if found is not None:
            return found
        key = f"{name}{LEGACY_RECORD}"
        try:
            body = json.loads(read_capped(self._local_store(), key, MAX_RECORD_BYTES))
            started, drained = body["started"], body["drained"]
            if not isinstance(started, bool) or not isinstance(drained, bool):
                raise ValueError(f"not booleans: {body}")
        except NotFoundError:
            return None
        except (ValueError, TypeError, KeyError, OSError, CorruptCheckpointError) as exc:
            log.warning("ignoring %s: %s", self._local_store().url(key), exc)
            return None
        return DrainRecord(info.time, self.dirpath, committed=drained, started=started)

    def _record(self, name: str, when: float, *, started: bool, committed: bool) -> None:
        """Write this directory's record of the drain of ``name``'s local commit at
        ``when`` (an earlier release's record of it goes)."""
        assert self.journal is not None and self.dirpath is not None
        record = DrainRecord(when, self.dirpath, committed=committed, started=started)
        self.journal.write(name, record)
        self._local_store().delete(f"{name}{LEGACY_RECORD}")

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
        group = drain_group()
        if self._drain_owner is None:
            self._drain_owner = directory_owner(self.path, group)[0]
        self.drain_one(name, group, self._drain_owner)
        self.retain()

    def drain_one(self, name: str, group: Any, owner: bool) -> None:
        """Copy ``name`` to the bucket (every rank of ``group``): the first rank says
        whether it is still wanted (not removed, not there yet); each directory's first
        rank copies its files, then the coordinator its own, ``metadata.json`` last."""
        remote = self.remote
        assert remote is not None
        prefix = self._remote_prefix(name)
        url = remote.store.url(prefix)

        def wanted() -> str:
            with self._cond:  # the marker read under the lock forget() deletes it under
                if name in self._removed:
                    return "removed"
                info = self.info(name)
                if info is None or self._drained(info, name):
                    return "done"
                self._draining = name  # a removal or a new save of it waits for this drain
            return "drain"

        decision = on_first(wanted, group, what=f"deciding the drain of {name}")
        if decision == "removed":  # every rank may now prune its copy
            with self._cond:
                self._removed.add(name)
        if decision != "drain":
            return
        try:
            error: BaseException | None = None
            local = self.info(name)
            try:
                if local is None:
                    raise NotFoundError(f"{name} is not committed in {self.path}")

                def clear() -> None:  # an earlier save's commit goes first, then its data
                    remote.store.delete(prefix + MEGATRON_MARKER)
                    recorded = self._drain_record(local, name)
                    if recorded is None:  # committed by an earlier release: by time
                        LocalTier.clear_stale(local, remote.store, prefix)
                    elif not recorded.started:  # all of them an earlier save's
                        remove_checkpoint(remote.store, prefix, remote.options)
                        self._record(name, local.time, started=True, committed=False)

                on_first(clear, group, what=f"clearing leftovers under {url}")
                if owner:  # each directory holds the coordinator's files: sent once, last
                    self._copy(name, MegatronPayload().coordinator_files)
            except Exception as exc:
                error = exc
            settle(error, f"the drain of {name} to {url}", group=group)
            on_first(lambda: self._copy(name, ()), group, what=f"the commit of {url}")
            if owner and local is not None:
                self._record(name, local.time, started=True, committed=True)
        finally:
            with self._cond:
                if self._draining == name:
                    self._draining = None
                self._cond.notify_all()

    def _copy(self, name: str, exclude: tuple[str, ...]) -> None:
        """Copy ``name``'s local megatron files to the bucket but those in ``exclude``
        (commit markers last; files already there whole skipped)."""
        assert self.remote is not None
        copy_tree(
            self._local_store(),
            f"{name}/{WEIGHTS}/",
            self.remote.store,
            self._remote_prefix(name),
            self.remote.options,
            exclude=exclude,
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
        if self._drain_owner is None:
            self._drain_owner = directory_owner(self.path, group)[0]
        for name in self._undrained(group):
            self.drain_one(name, group, self._drain_owner)
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
        """Delete this rank's local copy of ``name`` (its marker first), folders too."""
        remove_checkpoint(self._local_store(), f"{name}/", self.options)
        assert self.journal is not None
        self.journal.forget(name)
        self._local_store().delete(f"{name}{LEGACY_RECORD}")
        for folder in (self.path / name / WEIGHTS, self.path / name):
            with contextlib.suppress(OSError):  # not empty: a newer save of it began
                folder.rmdir()

    def recorded_dirpath(self) -> str | None:
        """The bucket ``dirpath`` this directory's run file names (None: none yet)."""
        if not self.path.is_dir():
            return None
        return read_owner(LocalStore(self.path))

    def retain(self) -> None:
        """Delete this rank's local copies beyond the ``keep_local`` newest, never one
        queued, draining, or not in the bucket (unless removed from it); first sweep the
        temp files of dead writers (never a live writer's)."""
        if self.store is None:
            return
        sweep_leftovers(self.store)
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

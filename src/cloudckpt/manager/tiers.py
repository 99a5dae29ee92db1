"""A manager's local tier: each checkpoint committed to a node-local directory first,
then drained to the bucket by one background thread (docs/tiers.md).

The local tier is a run root of its own (the same ``step-N/`` layout and marker as the
bucket), claimed for one bucket root by its run file ``_TIER.json``, so a directory left
by another job is never restored from. A step due for the bucket is drained by copying
its objects as they are (``engine/copy.copy_tree``: data first, resumable, whole objects
skipped), then the manager commits the bucket's step with its own marker, create-only.
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
from typing import Any

from ..dist.collectives import world_size
from ..engine.copy import copy_tree
from ..engine.drain import RUN_FILE, Drainer, claim
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    LocalTierFullError,
    NotFoundError,
)
from ..format.commit import read_committed
from ..options import TransferOptions
from ..store import Store
from ..store.local import LocalStore
from .gc import delete_prefix
from .marker import (
    MARKER_NAME,
    CheckpointInfo,
    check_files,
    commit_step,
    list_checkpoints,
    marker_key,
    read_marker,
    step_dir,
)
from .payload import PayloadKind
from .retention import KeepLast, to_delete

__all__ = [
    "LOCAL",
    "REMOTE",
    "RUN_FILE",
    "Drainer",
    "LocalTier",
    "check_free",
    "merge_tiers",
    "tensor_bytes",
]

log = logging.getLogger("cloudckpt")

LOCAL = "local"
REMOTE = "remote"
#: A bucket object under an uncommitted step older than the local commit by more than
#: this (seconds; clocks and the bucket's whole-second times differ) is a leftover of an
#: earlier save of the same step, not of this drain: it is sent again, never kept.
CLOCK_SLACK = 60.0


class LocalTier:
    """The local copy of one run: ``step-N/`` prefixes under ``path`` committed by the
    same marker as the bucket's, for the bucket root ``remote_url`` only.

    ``keep_local`` newest local steps are kept (None: all); steps divisible by
    ``every`` are due for the bucket.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        remote_url: str,
        options: TransferOptions,
        keep_local: int | None,
        every: int,
    ) -> None:
        for name, value in (("keep_local", keep_local), ("drain_every_n_steps", every)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        self.path = Path(path).expanduser()
        self.path.mkdir(parents=True, exist_ok=True)
        self.store = LocalStore(self.path)
        self.url = self.store.root_url
        self.remote_url = remote_url
        # The bucket's storage options (endpoint, credentials) mean nothing here.
        self.options = options.replace(storage_options={})
        self.keep = keep_local
        self.every = every
        self.owner = self._claim()
        self._cache: dict[tuple[str, int], CheckpointInfo] = {}
        self._lock = threading.Lock()
        self._retain_lock = threading.Lock()

    def _claim(self) -> str:
        """Create the run file naming ``remote_url`` (create-only), or read the owner
        an earlier manager recorded there."""
        owner = claim(self.store, self.remote_url)
        if owner != self.remote_url:
            log.warning(
                "local_dir %s holds the local tier of %s, not of %s: it is neither "
                "restored from nor saved to",
                self.path,
                owner,
                self.remote_url,
            )
        return owner

    @property
    def owned(self) -> bool:
        """Whether the directory belongs to this run (its run file names our bucket root)."""
        return self.owner == self.remote_url

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
    def step_prefix(step: int) -> str:
        return f"{step_dir(step)}/"

    def step_url(self, step: int) -> str:
        """URL of ``step``'s local prefix (ends in ``/``)."""
        return self.store.url(self.step_prefix(step))

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
    def list(self) -> list[CheckpointInfo]:
        """This run's locally committed steps, oldest first (none from another run)."""
        if not self.owned:
            return []
        with self._lock:
            cache = dict(self._cache)
        found = list_checkpoints(self.store, "", self.options, cache)
        with self._lock:
            self._cache.update(cache)
        return found

    def info(self, step: int) -> CheckpointInfo | None:
        """The local commit of ``step``, or None (none from another run)."""
        return read_marker(self.store, marker_key("", step)) if self.owned else None

    def saved_by(self) -> dict[int, int]:
        """How many ranks saved each local step, for the steps whose marker says so
        (those a job of several processes committed)."""
        return {c.step: c.ranks for c in self.list() if c.ranks}

    # -- save ----------------------------------------------------------------------------
    def check_room(self, state: Any, copies: int = 1) -> None:
        """LocalTierFullError, before anything is written, when the free space is below
        the last local checkpoint's size (or the state's tensor bytes, if larger), times
        ``copies`` (2 when the directory also keeps a peer's copy)."""
        found = self.list()
        last = found[-1].size if found else 0
        check_free(self.path, max(last, tensor_bytes(state)) * copies)

    def commit(
        self, step: int, kind: str, metrics: Mapping[str, float], metadata: Mapping[str, Any]
    ) -> CheckpointInfo:
        """Write the local marker of ``step`` (after its payload), create-only; in a job
        of several processes it records their number (``ranks``), which decides whether
        a restore on another number of ranks may read this copy."""
        ranks = world_size()
        info = commit_step(
            self.store,
            self.step_prefix(step),
            step,
            kind,
            metrics,
            metadata,
            ranks=ranks if ranks > 1 else 0,
        )
        return replace(info, tiers=(LOCAL,))

    def retain(self, protected: set[int]) -> builtins.list[int]:
        """Delete local steps beyond the ``keep_local`` newest, never a ``protected``
        one (due and not drained, being saved, restored); returns their steps."""
        if self.keep is None:
            return []
        with self._retain_lock:  # the saving thread and the drainer both prune
            doomed = to_delete(self.list(), [KeepLast(self.keep)], protected)
            for step in doomed:
                delete_prefix(self.store, self.step_prefix(step), self.options)
        return doomed

    # -- drain ---------------------------------------------------------------------------
    def drain_step(
        self,
        step: int,
        remote: Store,
        remote_prefix: str,
        options: TransferOptions,
        commit: Callable[[CheckpointInfo], object],
    ) -> bool:
        """Copy ``step``'s payload to ``remote_prefix`` (objects this drain already sent
        whole are skipped; older leftovers are replaced), then ``commit(local_info)``
        writes the bucket's marker. False when the bucket had the step committed already."""
        local = self.info(step)
        if local is None:
            raise NotFoundError(f"step {step} is not committed in the local tier {self.url}")
        if read_committed(remote, remote_prefix + MARKER_NAME) is not None:
            return False
        self.clear_stale(local, remote, remote_prefix)
        # The payload only: the bucket gets a marker of its own (its sizes and ETags).
        self.copy_payload(step, remote, remote_prefix, options, exclude=(MARKER_NAME,))
        commit(local)
        return True

    @staticmethod
    def clear_stale(local: CheckpointInfo, remote: Store, remote_prefix: str) -> None:
        """Delete the bucket's objects under ``remote_prefix`` older than the local
        commit ``local``: leftovers of an earlier save of the same step."""
        for o in list(remote.list(remote_prefix)):
            if o.mtime is not None and o.mtime < local.time - CLOCK_SLACK:
                remote.delete(o.key)  # same size is no proof of the same bytes

    def copy_payload(
        self,
        step: int,
        remote: Store,
        remote_prefix: str,
        options: TransferOptions,
        exclude: Sequence[str],
    ) -> None:
        """Copy ``step``'s local objects to ``remote_prefix`` but those named in
        ``exclude`` (objects already there whole are skipped)."""
        copy_tree(
            self.store, self.step_prefix(step), remote, remote_prefix, options, exclude=exclude
        )

    def whole_steps(self) -> builtins.list[int]:
        """This run's local steps whose every file is there at its marker's size."""
        found = []
        for info in self.list():
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

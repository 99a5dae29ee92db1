"""CheckpointManager: save, find, resume, prune and clean up the checkpoints of one run.

Two lines to resume::

    manager = cloudckpt.CheckpointManager("s3://bucket/run1", keep_last=3)
    state = manager.restore()  # the newest committed checkpoint; None on a fresh run

Order of one save (each step after the previous one succeeded):

1. the payload is written under ``ROOT/step-N/`` (nothing counts as committed yet);
2. rank 0 lists ``step-N/`` and writes the marker ``_CHECKPOINT.json`` (the commit);
3. rank 0 applies retention: the marker of a pruned checkpoint is deleted before its
   payload; the newest committed step, the restored step and saves in flight are kept.

In a distributed job only rank 0 talks to storage for listings, commits and deletes;
every other rank receives rank 0's answer (or error) by broadcast.

With ``local_dir=`` a save commits to that local tier instead and returns; the steps due
for the bucket are drained there in the background (manager/tiers.py, docs/tiers.md).
Such a save sends no request to the bucket: whether the step is committed already is
answered by the tier and by what the drainer learned, and the drainer alone talks to the
bucket, so saves go on at local speed while the bucket is away.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from ..engine.background import SaveLine
from ..engine.handle import SaveHandle, in_flight
from ..engine.remove import remove_checkpoint
from ..errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    DistributedSaveError,
    NotFoundError,
)
from ..format.commit import read_committed
from ..options import TransferOptions, check_seconds
from ..ranks.collectives import (
    barrier,
    is_distributed,
    on_first,
    rank,
    settle,
)
from ..ranks.groups import checkpoint_group, drain_group
from ..store import Store, open_target
from ..store.deadline import Deadline, deadline_scope, start_deadline, within
from ..store.local import LocalStore
from .gc import DEFAULT_GRACE_SECONDS, GcReport, collect_garbage
from .marker import (
    CheckpointInfo,
    DamagedMarker,
    check_remote,
    commit_step,
    list_checkpoints,
    marker_key,
    read_marker,
    root_prefix,
    step_dir,
)
from .payload import (
    DcpPayload,
    MegatronPayload,
    ObjectPayload,
    PayloadKind,
    Wrote,
    described,
    payload_kind,
    rank_failures,
)
from .retention import KeepEveryNSteps, KeepLast, KeepTopK, RetentionPolicy, to_delete
from .tiered import TieredRun
from .tiers import LOCAL, Drainer, LocalTier, merge_tiers

__all__ = ["CheckpointManager", "ManagedSaveHandle"]

log = logging.getLogger("cloudckpt")


class ManagedSaveHandle(SaveHandle[CheckpointInfo]):
    """A checkpoint saving in the background: ``staged()`` then committed (marker
    written); ``result()`` returns the committed :class:`CheckpointInfo` or raises the
    save's error. The one :class:`~cloudckpt.SaveHandle`, with the checkpoint's step."""

    kind = "checkpoint save"

    def __init__(self, step: int, url: str, stall_seconds: float) -> None:
        super().__init__(url, staged=True)  # returned once the state is captured
        self.step = step
        self.stall_seconds = stall_seconds


class CheckpointManager:
    """The checkpoints of one run under ``root_url``, each in its own ``step-N/`` prefix.

    Retention (any combination; a checkpoint survives if any policy keeps it):
    ``keep_last`` newest steps, every step divisible by ``keep_every_n_steps``, the
    ``keep_top_k`` best by ``metric`` (``mode`` "min"/"max"). ``policies=`` takes
    ready :mod:`~cloudckpt.manager.retention` objects instead. ``kind`` is "object" (one
    ``torch.save`` archive, ``filename``), "dcp" (a torch.distributed.checkpoint
    directory) or "megatron" (a Megatron-core sharded state dict, saved with
    ``cloudckpt.megatron.save``). Other keyword arguments are
    :class:`~cloudckpt.TransferOptions` fields.

    ``local_dir``: a local tier (docs/tiers.md). Saves commit there and return; steps
    divisible by ``drain_every_n_steps`` (default 1) are copied to ``root_url`` by a
    background thread (:meth:`drain` waits for them); ``keep_local`` newest local steps
    are kept (default all). ``restore`` reads the newest step of either tier, from
    local when its copy there is whole. ``replicate_to_peer``: with several ranks, each
    node's local directory also keeps the next node's steps, so a replaced node
    restores from its peer rather than the bucket. With several ranks (``kind="dcp"`` or
    ``"megatron"``), each rank
    keeps its own files in its ``local_dir``; an ``async_save``'s due steps are drained
    by every rank's drainer together, and ``drain()`` on every rank drains what is left
    (docs/tiers.md, "Several ranks").
    """

    def __init__(
        self,
        root_url: str | os.PathLike[str],
        keep_last: int | None = None,
        keep_every_n_steps: int | None = None,
        keep_top_k: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        *,
        policies: Sequence[RetentionPolicy] | None = None,
        kind: str | PayloadKind = "object",
        filename: str = "state.pt",
        gc_grace_seconds: float = DEFAULT_GRACE_SECONDS,
        local_dir: str | os.PathLike[str] | None = None,
        keep_local: int | None = None,
        drain_every_n_steps: int | None = None,
        replicate_to_peer: bool = False,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        where = open_target(root_url, options, **overrides)
        self.options = where.options
        store, key = where.store, where.key
        self.store: Store = store
        self.root_key = key.strip("/")
        if isinstance(store, LocalStore):  # no write through a link below the run root
            self.store = store.checked(self.root_key)
        self.root_url = store.url(root_prefix(self.root_key))
        if policies is not None and any(
            v is not None for v in (keep_last, keep_every_n_steps, keep_top_k)
        ):
            raise ConfigError("pass either policies= or keep_* arguments, not both")
        if policies is None:
            built: list[RetentionPolicy] = []
            if keep_last is not None:
                built.append(KeepLast(keep_last))
            if keep_every_n_steps is not None:
                built.append(KeepEveryNSteps(keep_every_n_steps))
            if keep_top_k is not None:
                built.append(KeepTopK(keep_top_k, metric or "", mode))
            elif metric is not None:
                raise ConfigError("metric= is only used with keep_top_k=")
            policies = built
        self.policies: list[RetentionPolicy] = list(policies)
        self.kind = payload_kind(kind, filename)
        self.gc_grace_seconds = gc_grace_seconds
        self.restored_step: int | None = None
        self._cache: dict[tuple[str, int], CheckpointInfo] = {}
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        #: This manager's DCP and Megatron saves in flight (engine/background.py).
        self._ranked_saves = SaveLine()
        #: The local tier, its drainer and what it learned of the bucket (manager/tiered.py).
        self._tiered: TieredRun | None = None
        if local_dir is not None:
            tier = LocalTier(
                local_dir, self.root_url, self.options, keep_local, drain_every_n_steps or 1
            )
            self._tiered = TieredRun(self, tier, bool(replicate_to_peer))
        elif keep_local is not None or drain_every_n_steps is not None or replicate_to_peer:
            raise ConfigError(
                "keep_local=, drain_every_n_steps= and replicate_to_peer= need local_dir="
            )
        #: Each local directory's steps are also kept by the next one (docs/tiers.md).
        self.replicate_to_peer = bool(replicate_to_peer)

    @property
    def _tier(self) -> LocalTier | None:
        """The local tier, if any."""
        return None if self._tiered is None else self._tiered.tier

    @property
    def _drainer(self) -> Drainer[int] | None:
        """The local tier's drainer, if any."""
        return None if self._tiered is None else self._tiered.drainer

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root_url!r}, kind={self.kind.name!r})"

    # -- naming --------------------------------------------------------------------------
    def step_url(self, step: int) -> str:
        """URL of ``step``'s prefix (ends in ``/``)."""
        return self.store.url(self._step_prefix(step))

    def _step_prefix(self, step: int) -> str:
        return f"{root_prefix(self.root_key)}{step_dir(step)}/"

    @staticmethod
    def _check_step(step: int) -> int:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative integer")
        return step

    # -- discovery -----------------------------------------------------------------------
    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest step first (one listing, markers only); with a
        local tier, those of either tier, each saying which tiers hold it. The bucket's
        listing and marker reads are bounded by the manager's ``deadline``. With a local
        tier and the bucket unreachable, the local tier's alone (WARNING)."""
        return self._scan()[0]

    def _list_local(self) -> builtins.list[CheckpointInfo]:
        return self._scan_local()[0]

    def _scan_local(
        self,
    ) -> tuple[builtins.list[CheckpointInfo], builtins.list[DamagedMarker]]:
        """The bucket's committed steps and the steps whose marker is damaged (each
        logged at WARNING by the listing)."""
        with self._lock:
            cache = dict(self._cache)
        damaged: builtins.list[DamagedMarker] = []
        with deadline_scope(self.options.deadline):  # the listing and its marker reads
            found = list_checkpoints(
                self.store, self.root_key, self.options, cache, damaged=damaged
            )
        with self._lock:
            self._cache.update(cache)
        if self._tiered is not None:
            self._tiered.learn(found)
        return found, damaged

    def _scan(
        self,
    ) -> tuple[builtins.list[CheckpointInfo], builtins.list[DamagedMarker], str | None]:
        """:meth:`list`, with the damaged steps no tier holds a valid copy of, and why
        the bucket was not listed (None: it was): with a local tier, a bucket that
        cannot be reached leaves the local tier's steps (TieredRun.scan_bucket)."""
        what = f"the listing of {self.root_url}"
        if self._tiered is None:
            found, damaged = on_first(self._scan_local, what=what)
            away = None
        else:
            found, damaged, away = on_first(self._tiered.scan_bucket, what=what)
            found = merge_tiers(found, self._tiered.tier.list(damaged))
        valid = {c.step for c in found}
        return found, [d for d in damaged if d.step not in valid], away

    def _damaged_error(self, damaged: Sequence[DamagedMarker]) -> CorruptCheckpointError:
        """What a restore of the newest step raises when every step's marker is damaged:
        never a fresh start over a run that has checkpoints (docs/manager.md)."""
        steps = sorted({d.step for d in damaged})
        return CorruptCheckpointError(
            f"no valid committed checkpoint under {self.root_url}, but the commit marker "
            f"of step(s) {steps} is damaged, so the run is not started fresh: "
            + "; ".join(d.reason for d in damaged)
            + " (repair the marker, or delete the step with CheckpointManager.delete)"
        )

    def _warn_fallback(self, chosen: int, damaged: Sequence[DamagedMarker]) -> None:
        """A WARNING when a restore of the newest step loads ``chosen`` because a newer
        step's marker is damaged."""
        newer = [d for d in damaged if d.step > chosen]
        if newer:
            log.warning(
                "restoring step %d, the newest step with a valid commit marker: the "
                "marker of newer step(s) %s is damaged (%s)",
                chosen,
                sorted({d.step for d in newer}),
                ", ".join(d.url for d in newer),
            )

    def latest(self) -> CheckpointInfo | None:
        """The committed checkpoint with the highest step, or None."""
        found = self.list()
        return found[-1] if found else None

    def info(self, step: int) -> CheckpointInfo:
        """The committed checkpoint of ``step``; NotFoundError if it is not committed.
        The marker read is bounded by the manager's ``deadline``."""
        self._check_step(step)

        def read() -> CheckpointInfo:
            local = self._tier.info(step) if self._tier is not None else None
            try:
                with deadline_scope(self.options.deadline):
                    found = read_marker(self.store, marker_key(self.root_key, step))
            except Exception as exc:  # with a local tier, a bucket away leaves its copy
                if local is None or self._tiered is None or not self._tiered.away(exc):
                    raise
                found = None
            if self._tier is not None:
                both = merge_tiers([found] if found else [], [local] if local else [])
                found = both[0] if both else None
            if found is None:
                raise NotFoundError(
                    f"no committed checkpoint for step {step} at {self.step_url(step)}"
                )
            return found

        return on_first(read, what=f"reading the marker of step {step}")

    # -- save ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write ``state`` as checkpoint ``step``, commit it, then apply retention.

        The manager's ``deadline`` bounds every request of it: the check that the step is
        new, the payload, the commit (listing and marker) and retention."""
        self._check_step(step)
        metrics = _check_metrics(metrics)
        if self._ranked_tier():  # an async save's commit uses the group this one will
            self._await_in_flight()
        with deadline_scope(self.options.deadline):  # the whole save (store/deadline.py)
            return self._save(step, state, metrics, metadata)

    def _save(
        self,
        step: int,
        state: Any,
        metrics: dict[str, float],
        metadata: Mapping[str, Any] | None,
    ) -> CheckpointInfo:
        """:meth:`save`'s work, under its deadline."""
        self._before_save(step, state)
        with self._lock:
            self._pending.add(step)
        try:
            url, options = self._target(step)
        except BaseException:
            self._saved(step)
            raise
        tiered = self._tiered
        if tiered is not None and tiered.ranked():
            try:
                self.kind.save(state, url, options)
                info = tiered.commit_ranks(step, metrics, metadata or {})
            finally:
                self._saved(step)
            tiered.retain_local()
            return info
        try:
            with self._room():
                wrote = self.kind.save(state, url, options)
            barrier()
            info = on_first(
                lambda: self._commit_save(step, metrics, metadata or {}, wrote),
                what=f"the commit of {url}",
            )
        finally:
            self._saved(step)
        on_first(
            lambda: self._after_commit(step, defer=True), what=f"retention under {self.root_url}"
        )
        return info

    def async_save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ManagedSaveHandle:
        """Like :meth:`save`, but returns once ``state`` is snapshotted.

        The marker is written when the payload has committed, then retention runs; the
        handle's ``result()`` returns the committed checkpoint. ``kind="object"``: one
        process (``cloudckpt.async_save``). ``kind="dcp"`` or ``"megatron"``: call it on
        every rank; DCP's ``async_save`` (or ``cloudckpt.megatron.save(async_save=True)``)
        stages each rank's state and writes it in the background, on a gloo group of the
        checkpoint's own, and once the payload has committed (``.metadata``, or
        megatron's ``metadata.json``: every rank's data durable) rank 0 writes the
        marker and every rank's handle gets the committed checkpoint (or the error).
        Such a save waits for this manager's previous one to finish first.

        The manager's ``deadline`` starts with the call and bounds every request of the
        save: the checks before it (on the caller's thread, so the call raises
        ``DeadlineExceededError`` at the deadline), the write, the commit and retention
        (the handle's); the snapshot and a wait for an earlier save are not counted.
        """
        self._check_step(step)
        metrics = _check_metrics(metrics)
        if isinstance(self.kind, (DcpPayload, MegatronPayload)):
            return self._async_save_ranks(step, state, metrics, metadata or {})
        if self.kind.name != "object" or not hasattr(self.kind, "filename"):
            raise ConfigError(f"async_save does not support kind={self.kind.name!r}")
        try:
            from ..engine.async_save import async_save as engine_async_save
        except ImportError as exc:  # the engine's async save is not in this build
            raise NotImplementedError(
                "CheckpointManager.async_save needs cloudckpt.engine.async_save"
            ) from exc
        deadline = start_deadline(self.options.deadline)
        with within(deadline):
            self._before_save(step, state)
        with self._lock:
            self._pending.add(step)
        called = time.monotonic()
        try:
            prefix_url, options = self._target(step)
            if deadline is not None:  # the write, in its thread: what is left of the deadline
                options = replace(options, deadline=max(deadline.remaining(), 1e-3))
            inner = engine_async_save(state, prefix_url + self.kind.filename, options=options)
        except BaseException:
            self._saved(step)
            raise
        # The write's deadline starts once the call returns (after the snapshot and the
        # wait for earlier saves, neither of them this save's requests): the commit's too.
        deadline = _moved_on(deadline, called)
        handle = ManagedSaveHandle(step, prefix_url, inner.stall_seconds)
        in_flight.add(handle)

        def commit() -> CheckpointInfo:
            with self._room():
                saved = inner.result()
            wrote = self.kind.wrote(saved) if isinstance(self.kind, ObjectPayload) else None
            return self._commit_save(step, metrics, metadata or {}, wrote)

        inner.add_done_callback(
            lambda _inner: self._finish(handle, commit, retain=True, deadline=deadline)
        )
        return handle

    def _finish(
        self,
        handle: ManagedSaveHandle,
        commit: Callable[[], CheckpointInfo],
        retain: bool,
        deadline: Deadline | None = None,
    ) -> None:
        """Complete ``handle`` with ``commit()`` (the marker) or its error, then apply
        retention (``retain``: this process is the one that prunes); both under the
        save's ``deadline``."""
        with within(deadline):
            try:
                info = commit()
            except BaseException as exc:
                self._saved(handle.step)  # before the handle says so: nothing of it left
                handle.finish(None, exc)
                return
            self._saved(handle.step)
            if retain:
                self._after_commit(handle.step)
        handle.finish(info, None)

    def _async_save_ranks(
        self, step: int, state: Any, metrics: dict[str, float], metadata: Mapping[str, Any]
    ) -> ManagedSaveHandle:
        """``async_save`` of a kind every rank writes (DCP, Megatron): the payload's own
        background save, then the commit on every rank once it is done."""
        assert isinstance(self.kind, (DcpPayload, MegatronPayload))
        ranked = self._ranked_tier()
        if ranked:  # its local commit runs on the checkpoint group: never beside ours
            self._await_in_flight()
        deadline = start_deadline(self.options.deadline)
        with within(deadline):
            self._before_save(step, state)
        waiting = time.monotonic()
        self._await_in_flight()  # its collectives and ours share the checkpoint group
        deadline = _moved_on(deadline, waiting)  # that wait is the earlier save's time
        group = checkpoint_group() if is_distributed() else None
        if ranked:
            drain_group()  # made here, by every rank in step, before the drainer uses it
        with self._lock:
            self._pending.add(step)
        started = time.perf_counter()
        try:
            prefix_url, options = self._target(step)
            with within(deadline):  # the payload's save starts under it (DCP: set_up...)
                pending = self.kind.async_save(state, prefix_url, options, group)
        except BaseException:
            self._saved(step)
            raise
        handle = ManagedSaveHandle(step, prefix_url, time.perf_counter() - started)
        self._ranked_saves.add(handle)
        self._commit_when_done(handle, pending, group, metrics, metadata, deadline)
        return handle

    def _commit_when_done(
        self,
        handle: ManagedSaveHandle,
        pending: Future[Any] | SaveHandle[Any],
        group: Any,
        metrics: Mapping[str, float],
        metadata: Mapping[str, Any],
        deadline: Deadline | None = None,
    ) -> None:
        """Once the payload's background save (``pending``) is done, on every rank in its
        saving thread: the ranks agree on its outcome, then rank 0 commits and the group
        hears it (with a local tier on several ranks, each directory commits and every
        rank queues the step's drain, so every rank's drainer takes the same steps in
        the same order); ``handle`` gets the committed checkpoint or the error. The
        commit's requests run under the save's ``deadline``."""
        step, ranked = handle.step, self._ranked_tier()
        what = f"the commit of {handle.url}"

        def commit() -> CheckpointInfo:
            error = pending.exception()  # seen here: never reported again as unchecked
            if error is not None:
                error = _named_failure(error, handle.url)
            settle(error, f"the save of {handle.url}", group=group, error_type=DistributedSaveError)
            if self._tiered is not None and ranked:
                return self._tiered.commit_ranks(step, metrics, metadata)
            wrote = None
            if isinstance(self.kind, DcpPayload) and isinstance(pending, Future):
                wrote = self.kind.wrote_async(pending)
            return on_first(
                lambda: self._commit_save(step, metrics, metadata, wrote), group, what=what
            )

        pending.add_done_callback(
            lambda _done: self._finish(
                handle, commit, retain=ranked or rank() == 0, deadline=deadline
            )
        )

    def _await_in_flight(self) -> None:
        """Wait for this manager's DCP or Megatron save in flight, whose commit (in its
        saving thread) runs collectives on the checkpoint group a new save or restore
        would use too."""
        self._ranked_saves.make_room()

    def _refuse_committed(self, step: int) -> None:
        """AlreadyExistsError when ``step`` is committed. With a local tier, asked of the
        tier and of what the drainer learned of the bucket, never of the bucket: a save
        does not wait for it (a step another process committed there that the drainer
        has not seen yet is found by its drain, which keeps the bucket's, WARNING)."""
        tiered = self._tiered

        def check() -> None:
            if tiered is not None:
                tiered.refuse_committed(step)
                return
            if read_committed(self.store, marker_key(self.root_key, step)) is not None:
                raise AlreadyExistsError(
                    f"step {step} is already committed at {self.step_url(step)}; "
                    "delete it first to overwrite"
                )

        on_first(check, what=f"the check that step {step} is not committed")

    def _before_save(self, step: int, state: Any) -> None:
        """The checks before a save writes anything: the step is new, and a local tier
        is this run's and has room (LocalTierFullError, naming the steps that wait for
        the bucket). With a local tier nothing here asks the bucket: crash leftovers are
        swept from the tier and a killed save's files of the step removed (the drainer,
        started after the commit, finds the drains an earlier process left, in its own
        thread)."""
        tiered = self._tiered
        if tiered is not None:
            tiered.before_save(self.kind)
        self._refuse_committed(step)
        if tiered is not None:
            tiered.clear(step)  # takes the step folder's save lock (LocalTier.clear)
            try:
                tiered.check_room(state)
            except BaseException:
                tiered.tier.release(step)
                raise

    def _saved(self, step: int) -> None:
        """A save of ``step`` ended, committed or not: it is no longer in flight, and the
        local tier's save lock on its folder is given up."""
        with self._lock:
            self._pending.discard(step)
        if self._tier is not None:
            self._tier.release(step)

    def _target(self, step: int) -> tuple[str, TransferOptions]:
        """Where a save writes ``step``'s payload: the local tier if any, else the bucket."""
        if self._tier is not None:
            return self._tier.save_url(step), self._tier.options  # no step-N link followed
        if isinstance(self.store, LocalStore):  # a save by URL: step-N made here, unlinked
            self.store.make_dirs(self._step_prefix(step))
        return self.step_url(step), self.options

    def _commit_save(
        self,
        step: int,
        metrics: Mapping[str, float],
        metadata: Mapping[str, Any],
        wrote: Wrote = None,
    ) -> CheckpointInfo:
        """Commit a save where it was written: the local tier if any, else the bucket
        (exactly the files the save ``wrote``, where it says)."""
        if self._tier is not None:
            return self._tier.commit(step, self.kind.name, metrics, metadata, files=wrote)
        return self._commit(step, metrics, metadata, files=wrote)

    def _commit(
        self,
        step: int,
        metrics: Mapping[str, float],
        metadata: Mapping[str, Any],
        when: float | None = None,
        files: Wrote = None,
    ) -> CheckpointInfo:
        """Write the step's marker in the bucket (rank 0, after the payload), recording
        ``files`` (the save's own, each checked there: manager/marker.commit_step), else
        every object listed under the step; ``when``: the commit time (default now)."""
        prefix = self._step_prefix(step)
        return commit_step(
            self.store, prefix, step, self.kind.name, metrics, metadata, when, files=files
        )

    def _after_commit(self, step: int, defer: bool = False) -> None:
        """After a save's commit: bucket retention; with a local tier, local retention,
        then queue the step's drain if it is due (and retry failed ones). The drainer
        starts last, so a synchronous save does not share the CPUs with it; ``defer``
        (such a save): the files of the steps local retention drops are removed after
        it returns (:meth:`LocalTier.retain`)."""
        if self._tiered is None:
            self._retain_quietly()
        else:
            self._tiered.after_commit(step, defer=defer)

    # -- the local tier ------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> None:
        """Wait until every step due for the bucket is committed there (nothing to do
        without a local tier). Failed drains are tried again first; the error of one
        that fails again is raised (naming its step); TimeoutError after ``timeout`` s.
        With several ranks, call it on every rank (docs/tiers.md, "Several ranks")."""
        check_seconds("timeout", timeout)
        if self._tiered is not None:
            self._tiered.drain(timeout)

    def _room(self) -> contextlib.AbstractContextManager[None]:
        """Around a write to the local tier: running out of space there is
        LocalTierFullError naming the steps that wait for the bucket."""
        return contextlib.nullcontext() if self._tiered is None else self._tiered.room()

    def _ranked_tier(self) -> bool:
        """Whether a local tier serves several ranks: each rank keeps its own files."""
        return self._tiered is not None and self._tiered.ranked()

    def _restore_bucket(self, step: int, map_location: Any, weights_only: bool, state: Any) -> Any:
        """Load ``step`` from the bucket (a restore that has chosen it there)."""
        return self.kind.load(
            self.step_url(step),
            self.options,
            map_location=map_location,
            weights_only=weights_only,
            state=state,
        )

    # -- retention -----------------------------------------------------------------------
    def _retain_quietly(self) -> builtins.list[int]:
        """Retention after a commit; a failure is logged, never blamed on the save."""
        try:
            return self.apply_retention()
        except Exception as exc:
            log.warning(
                "retention under %s failed (the checkpoint is committed): %s", self.root_url, exc
            )
            return []

    def apply_retention(self) -> builtins.list[int]:
        """Delete the committed checkpoints no policy keeps; returns their steps.

        Never the newest committed one, the one restored from, or a save in flight.
        """
        if not self.policies:
            return []
        found = self._list_local()
        with self._lock:
            protected = set(self._pending)
        if self.restored_step is not None:
            protected.add(self.restored_step)
        doomed = to_delete(found, self.policies, protected)
        for step in doomed:
            remove_checkpoint(self.store, self._step_prefix(step), self.options)
            if self._tiered is not None:
                self._tiered.left_bucket(step)
        return doomed

    def delete(self, step: int) -> None:
        """Delete checkpoint ``step`` (its marker first), in both tiers if there is a local
        one; NotFoundError if nothing is there. A drain of it under way ends first. With
        several processes call it on every rank (with a local tier, each rank deletes
        its own copy)."""
        self._check_step(step)
        if self._tiered is not None and self._tiered.ranked():  # every rank its own copy
            self._tiered.delete_ranks(step)
            return

        def remove() -> None:
            if self._tiered is not None:  # a drain of it under way ends first
                self._tiered.stop_drain(step)
            removed = self._remove_step(step)
            if self._tiered is not None:
                self._tiered.left_bucket(step)
                removed += self._tiered.delete(step)
            if removed == 0:
                raise NotFoundError(f"no checkpoint for step {step} at {self.step_url(step)}")

        on_first(remove, what=f"deleting step {step}")

    def _remove_step(self, step: int) -> int:
        """Remove ``step`` from the bucket (marker first, then its files), then delete
        its marker once more: a drain by another process that wrote the marker after
        this removal listed the step is not left committed over deleted files (a
        marker written after this last delete finds them gone at its drain's check and
        is withdrawn: LocalTier.confirm). Returns the objects deleted."""
        removed = remove_checkpoint(self.store, self._step_prefix(step), self.options)
        self.store.delete(marker_key(self.root_key, step))  # absent: nothing to do
        return removed

    def gc(self, grace_seconds: float | None = None, dry_run: bool = False) -> GcReport:
        """Remove uncommitted ``step-N/`` leftovers and stale multipart uploads, in the
        bucket and (with a local tier) in this rank's local directory too.

        Only what is older than the grace period (default ``gc_grace_seconds``) and not
        being saved by this manager. On the filesystem an upload is a temp file its
        writer holds locked (store/local.py): one a live process writes stays whatever
        its age; in the local tier one whose writer is gone goes whatever its age.
        """
        grace = self.gc_grace_seconds if grace_seconds is None else grace_seconds
        with self._lock:
            protected = set(self._pending)
        if self._tiered is not None:
            protected |= self._tiered.drainer.unfinished()
        report = on_first(
            lambda: collect_garbage(
                self.store,
                self.root_key,
                self.options,
                grace_seconds=grace,
                dry_run=dry_run,
                protected=protected,
            ),
            what=f"garbage collection under {self.root_url}",
        )
        local = None
        if self._tiered is not None:
            local = self._tiered.collect_garbage(grace, dry_run, protected)
        if local is not None:
            report.prefixes += local.prefixes
            report.uploads += local.uploads
            report.skipped_young += local.skipped_young
            report.leftovers += local.leftovers
        return report

    # -- restore -------------------------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        map_location: Any = None,
        *,
        weights_only: bool = True,
        state: Any = None,
    ) -> Any:
        """Load checkpoint ``step`` (default: the newest committed one) and return it.

        A run with no committed checkpoint yet (an empty prefix in a bucket that exists;
        a step without a marker does not count) returns None for ``step=None``, with one
        INFO line, so a job's first start runs the same code as its restarts; with
        several ranks every rank returns None. A ``step`` that is not committed is a
        NotFoundError; a missing bucket, rejected credentials or an unreachable store
        raise as on any other call, except that with a local tier an unreachable
        bucket leaves the tier's steps (WARNING; none there: StorageError, never a
        fresh start). Retention never deletes the restored step afterwards.

        A step whose marker exists but is damaged (cannot be decoded, or names another
        step) is not committed and not nothing: ``restore()`` loads the newest valid step
        with a WARNING naming the damaged newer ones, and raises CorruptCheckpointError
        naming them when no valid step is left (never "starting fresh");
        ``restore(step=N)`` of one raises CorruptCheckpointError.
        """
        tiered = self._tiered
        if tiered is not None and tiered.restores_ranked():
            self._await_in_flight()
            return tiered.restore_ranks(step, map_location, weights_only, state)
        if step is None:
            found, damaged, away = self._scan()
            if not found:
                if away is not None and tiered is not None:
                    raise tiered.nothing_local(away)
                if damaged:
                    raise self._damaged_error(damaged)
                return self._start_fresh()
            info = found[-1]
            self._warn_fallback(info.step, damaged)
        else:
            info = self.info(step)

        def load(url: str, options: TransferOptions, local: bool = False) -> Any:
            return self.kind.load(
                url,
                options,
                map_location=map_location,
                weights_only=weights_only,
                state=state,
                local=local,
            )

        if tiered is not None and LOCAL in info.tiers:
            result = tiered.restore_local(info, load)
        else:
            result = self._load_committed(info, load)
        self.restored_step = info.step
        return result

    def _load_committed(self, info: CheckpointInfo, load: Callable[..., Any]) -> Any:
        """``load`` the bucket's copy of ``info``'s step, once one listing showed every
        file its marker lists there at the marker's size and ETag (as ``cloudckpt
        verify`` checks): another step's file copied over one of them, or one rewritten
        since the commit, is CorruptCheckpointError naming it, never loaded. The first
        rank lists; every rank hears the outcome."""
        prefix = self._step_prefix(info.step)

        def check() -> None:
            with deadline_scope(self.options.deadline):
                check_remote(self.store, prefix, info)

        on_first(check, what=f"the check of {self.step_url(info.step)} against its marker")
        return load(self.step_url(info.step), self.options)

    def _start_fresh(self) -> None:
        """What a restore of the newest checkpoint returns when the run has none: None,
        said at INFO (docs/manager.md, "Nothing to restore yet")."""
        log.info("no committed checkpoint under %s: starting fresh", self.root_url)
        return None


def _moved_on(deadline: Deadline | None, since: float) -> Deadline | None:
    """``deadline`` moved on by the seconds since ``since`` (a wait for an earlier save
    or a snapshot: time that is not this save's requests')."""
    if deadline is None:
        return None
    return Deadline(deadline.seconds, deadline.expires + time.monotonic() - since)


def _named_failure(error: BaseException, url: str) -> BaseException:
    """A ``CheckpointException`` of DCP's writer (DCP and Megatron saves; its message
    names only the ranks) as a :class:`DistributedSaveError` naming each failed rank
    and its error."""
    named = rank_failures(error)
    if not named:
        return error
    return DistributedSaveError.of(f"the save of {url}", described(named))


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"metric {name!r}={value!r} is not a number") from exc
    return out

"""CheckpointManager: save, find, resume, prune and clean up the checkpoints of one run.

Two lines to resume::

    manager = cloudckpt.CheckpointManager("s3://bucket/run1", keep_last=3)
    state = manager.restore()  # the newest committed checkpoint

Order of one save (each step after the previous one succeeded):

1. the payload is written under ``ROOT/step-N/`` (nothing counts as committed yet);
2. rank 0 lists ``step-N/`` and writes the marker ``_CHECKPOINT.json`` (the commit);
3. rank 0 applies retention: the marker of a pruned checkpoint is deleted before its
   payload; the newest committed step, the restored step and saves in flight are kept.

In a distributed job only rank 0 talks to storage for listings, commits and deletes;
every other rank receives rank 0's answer (or error) by broadcast.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..dist.collectives import barrier, is_distributed, on_first, rank
from ..dist.groups import checkpoint_group
from ..engine.handle import SaveHandle, in_flight
from ..errors import AlreadyExistsError, ConfigError, DistributedSaveError, NotFoundError
from ..format.commit import read_committed
from ..options import TransferOptions
from ..store import Store, open_target
from .gc import DEFAULT_GRACE_SECONDS, GcReport, collect_garbage, delete_prefix
from .marker import (
    MARKER_NAME,
    CheckpointInfo,
    FileEntry,
    list_checkpoints,
    marker_key,
    read_marker,
    root_prefix,
    step_dir,
    write_marker,
)
from .payload import DcpPayload, PayloadKind, payload_kind
from .retention import KeepEveryNSteps, KeepLast, KeepTopK, RetentionPolicy, to_delete

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
    ``torch.save`` archive, ``filename``) or "dcp" (a torch.distributed.checkpoint
    directory). Other keyword arguments are :class:`~cloudckpt.TransferOptions` fields.
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
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        where = open_target(root_url, options, **overrides)
        self.options = where.options
        store, key = where.store, where.key
        self.store: Store = store
        self.root_key = key.strip("/")
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
        self._dcp_in_flight: ManagedSaveHandle | None = None

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
        """Committed checkpoints, oldest step first (one listing, markers only)."""
        return on_first(self._list_local, what=f"the listing of {self.root_url}")

    def _list_local(self) -> builtins.list[CheckpointInfo]:
        with self._lock:
            cache = dict(self._cache)
        found = list_checkpoints(self.store, self.root_key, self.options, cache)
        with self._lock:
            self._cache.update(cache)
        return found

    def latest(self) -> CheckpointInfo | None:
        """The committed checkpoint with the highest step, or None."""
        found = self.list()
        return found[-1] if found else None

    def info(self, step: int) -> CheckpointInfo:
        """The committed checkpoint of ``step``; NotFoundError if it is not committed."""
        self._check_step(step)

        def read() -> CheckpointInfo:
            found = read_marker(self.store, marker_key(self.root_key, step))
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
        """Write ``state`` as checkpoint ``step``, commit it, then apply retention."""
        self._check_step(step)
        metrics = _check_metrics(metrics)
        self._refuse_committed(step)
        with self._lock:
            self._pending.add(step)
        try:
            self.kind.save(state, self.step_url(step), self.options)
            barrier()
            info = on_first(
                lambda: self._commit(step, metrics, metadata or {}),
                what=f"the commit of {self.step_url(step)}",
            )
        finally:
            with self._lock:
                self._pending.discard(step)
        on_first(self._retain_quietly, what=f"retention under {self.root_url}")
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
        process (``cloudckpt.async_save``). ``kind="dcp"``: call it on every rank; DCP's
        ``async_save`` stages each rank's state and writes it through the cloudckpt
        writer in the background, on a gloo group of the checkpoint's own, and once
        ``.metadata`` is written (every rank's data durable) rank 0 writes the marker
        and every rank's handle gets the committed checkpoint (or the error). A DCP
        save waits for this manager's previous one to finish first.
        """
        self._check_step(step)
        metrics = _check_metrics(metrics)
        if isinstance(self.kind, DcpPayload):
            return self._async_save_dcp(step, state, metrics, metadata or {})
        if self.kind.name != "object" or not hasattr(self.kind, "filename"):
            raise ConfigError(f"async_save does not support kind={self.kind.name!r}")
        try:
            from ..engine.async_save import async_save as engine_async_save
        except ImportError as exc:  # the engine's async save is not in this build
            raise NotImplementedError(
                "CheckpointManager.async_save needs cloudckpt.engine.async_save"
            ) from exc
        self._refuse_committed(step)
        with self._lock:
            self._pending.add(step)
        url = self.step_url(step) + self.kind.filename
        try:
            inner = engine_async_save(state, url, options=self.options)
        except BaseException:
            with self._lock:
                self._pending.discard(step)
            raise
        handle = ManagedSaveHandle(step, self.step_url(step), inner.stall_seconds)
        in_flight.add(handle)

        def commit() -> CheckpointInfo:
            inner.result()
            return self._commit(step, metrics, metadata or {})

        inner.add_done_callback(lambda _inner: self._finish(handle, commit, retain=True))
        return handle

    def _finish(
        self, handle: ManagedSaveHandle, commit: Callable[[], CheckpointInfo], retain: bool
    ) -> None:
        """Complete ``handle`` with ``commit()`` (the marker) or its error, then apply
        retention (``retain``: this process is the one that prunes)."""
        try:
            info = commit()
        except BaseException as exc:
            handle.finish(None, exc)
            return
        finally:
            with self._lock:
                self._pending.discard(handle.step)
        if retain:
            self._retain_quietly()
        handle.finish(info, None)

    def _async_save_dcp(
        self, step: int, state: Any, metrics: dict[str, float], metadata: Mapping[str, Any]
    ) -> ManagedSaveHandle:
        assert isinstance(self.kind, DcpPayload)
        self._refuse_committed(step)
        previous = self._dcp_in_flight
        if previous is not None:  # its collectives and ours share the checkpoint group
            previous.wait()
        group = checkpoint_group() if is_distributed() else None
        with self._lock:
            self._pending.add(step)
        started = time.perf_counter()
        try:
            future = self.kind.async_save(state, self.step_url(step), self.options, group)
        except BaseException:
            with self._lock:
                self._pending.discard(step)
            raise
        handle = ManagedSaveHandle(step, self.step_url(step), time.perf_counter() - started)
        in_flight.add(handle)

        def write_marker() -> CheckpointInfo:  # rank 0, once DCP's save is done
            error = future.exception()  # DCP's outcome, the same on every rank
            if error is not None:
                raise _named_failure(error, self.step_url(step))
            return self._commit(step, metrics, metadata)

        # On every rank, in DCP's saving thread: rank 0 commits, the group hears it.
        what = f"the commit of {self.step_url(step)}"
        future.add_done_callback(
            lambda _f: self._finish(
                handle, lambda: on_first(write_marker, group, what=what), retain=rank() == 0
            )
        )
        self._dcp_in_flight = handle
        return handle

    def _refuse_committed(self, step: int) -> None:
        def check() -> None:
            if read_committed(self.store, marker_key(self.root_key, step)) is not None:
                raise AlreadyExistsError(
                    f"step {step} is already committed at {self.step_url(step)}; "
                    "delete it first to overwrite"
                )

        on_first(check, what=f"the check that step {step} is not committed")

    def _commit(
        self, step: int, metrics: Mapping[str, float], metadata: Mapping[str, Any]
    ) -> CheckpointInfo:
        """List the step's objects and write its marker (rank 0, after the payload)."""
        prefix = self._step_prefix(step)
        objects = list(self.store.list(prefix))
        files = tuple(
            FileEntry(o.key[len(prefix) :], o.size, o.etag.strip('"') if o.etag else None)
            for o in objects
            if o.key != prefix + MARKER_NAME
        )
        if not files:
            where = self.store.url(prefix)
            raise NotFoundError(f"the payload of step {step} is missing under {where}")
        from .._version import __version__

        info = CheckpointInfo(
            step=step,
            url=self.store.url(prefix),
            time=time.time(),
            size=sum(f.size for f in files),
            kind=self.kind.name,
            files=files,
            metrics=dict(metrics),
            metadata=dict(metadata),
            library_version=__version__,
        )
        write_marker(self.store, prefix + MARKER_NAME, info)
        return info

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
            delete_prefix(self.store, self._step_prefix(step), self.options)
        return doomed

    def delete(self, step: int) -> None:
        """Delete checkpoint ``step`` (its marker first); NotFoundError if nothing is there."""
        self._check_step(step)

        def remove() -> None:
            if delete_prefix(self.store, self._step_prefix(step), self.options) == 0:
                raise NotFoundError(f"no checkpoint for step {step} at {self.step_url(step)}")

        on_first(remove, what=f"deleting step {step}")

    def gc(self, grace_seconds: float | None = None, dry_run: bool = False) -> GcReport:
        """Remove uncommitted ``step-N/`` leftovers and stale multipart uploads.

        Only what is older than the grace period (default ``gc_grace_seconds``) and not
        being saved by this manager.
        """
        grace = self.gc_grace_seconds if grace_seconds is None else grace_seconds
        with self._lock:
            protected = set(self._pending)
        return on_first(
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

        NotFoundError when there is no committed checkpoint (a step without a marker does
        not count). Retention never deletes the restored step afterwards.
        """
        if step is None:
            info = self.latest()
            if info is None:
                raise NotFoundError(f"no committed checkpoint under {self.root_url}")
        else:
            info = self.info(step)
        result = self.kind.load(
            info.url,
            self.options,
            map_location=map_location,
            weights_only=weights_only,
            state=state,
        )
        self.restored_step = info.step
        return result


def _named_failure(error: BaseException, url: str) -> BaseException:
    """DCP's ``CheckpointException`` (whose message names only the ranks) as a
    :class:`DistributedSaveError` naming each failed rank and its error."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    named = {}
    for r, wrapped in failures.items():
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        named[int(r)] = f"{type(exc).__name__}: {exc}"
    return DistributedSaveError.of(f"the DCP save of {url}", named)


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"metric {name!r}={value!r} is not a number") from exc
    return out

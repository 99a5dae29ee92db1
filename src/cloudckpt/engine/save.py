"""Synchronous save: a ``torch.save`` archive streamed into a multipart upload, committed last."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from .._runtime.gcpause import paused_gc
from ..format.torch.archive_writer import ArchivePlan, plan_archive
from ..format.torch.picklability import raise_if_unpicklable
from ..format.torch.tensors import scan_storages
from ..io.progress import progress_bar
from ..io.sink import BORROW_MIN, BorrowingSink, BorrowingWriter, ObjectSink
from ..options import TransferOptions
from ..store import Store, object_url, open_target
from ..store.deadline import deadline_scope

__all__ = ["SaveResult", "save", "write_object"]


@dataclass(frozen=True)
class SaveResult:
    """What a committed save wrote."""

    url: str
    size: int
    seconds: float
    #: The ETag the store gave the object (None: it gave none): what tells this save's
    #: object from another write of the same key (a commit checks it).
    etag: str | None = None

    @property
    def throughput(self) -> float:
        """Bytes per second, end to end."""
        return self.size / self.seconds if self.seconds > 0 else float("inf")


def write_object(
    obj: Any, store: Store, key: str, opts: TransferOptions, *, size_hint: int | None = None
) -> SaveResult:
    """Stream ``torch.save(obj)`` to ``key``; commit on success, abort on any failure,
    all within ``opts.deadline`` (store/deadline.py)."""
    with deadline_scope(opts.deadline):
        return _write_object(obj, store, key, opts, size_hint)


def _write_object(
    obj: Any, store: Store, key: str, opts: TransferOptions, size_hint: int | None
) -> SaveResult:
    target = store.url(key)
    started = time.perf_counter()
    try:
        plan = plan_archive(obj)
    except BaseException as exc:  # nothing written yet: name what could not be pickled
        raise_if_unpicklable(obj, exc, target)
        raise
    if plan is not None:
        size, etag = _write_plan(plan, store, key, opts, size_hint or plan.size_hint)
        return SaveResult(target, size, time.perf_counter() - started, etag)
    # torch.save writes what the archive builder does not (format/torch/archive_writer.py).
    # Large CPU storages are sent from their own memory (no copy, no part buffers); the
    # caller keeps them unchanged until this returns, as a sync save always required.
    payload, storages = scan_storages(obj, BORROW_MIN)
    if size_hint is None:
        size_hint = payload
    with progress_bar(f"save {key.rsplit('/', 1)[-1]}", size_hint, opts.progress) as advance:
        sink: ObjectSink
        if storages:
            sink = BorrowingSink(store, key, opts, size_hint=size_hint, on_progress=advance)
            stream: Any = BorrowingWriter(sink, storages)
        else:
            sink = stream = ObjectSink(store, key, opts, size_hint=size_hint, on_progress=advance)
        try:
            torch.save(obj, stream)  # a write-only stream is enough
            size = sink.commit()
        except BaseException as exc:
            error = sink.abort_after(exc)
            if error is not exc:  # torch.save turned our failure into a RuntimeError
                raise error from None
            raise_if_unpicklable(obj, exc, target)
            raise
    return SaveResult(target, size, time.perf_counter() - started, sink.etag)


def _write_plan(
    plan: ArchivePlan, store: Store, key: str, opts: TransferOptions, size_hint: int
) -> tuple[int, str | None]:
    """Send a built archive's pieces; commit on success, abort on any failure. Returns
    the size and the ETag the store gave the object."""
    with progress_bar(f"save {key.rsplit('/', 1)[-1]}", size_hint, opts.progress) as advance:
        sink = BorrowingSink(store, key, opts, size_hint=size_hint, on_progress=advance)
        try:
            # Every piece is sent from where it lies: a storage's own memory (unchanged
            # until this returns, as a sync save always required) or a copied chunk.
            for view, owner in plan.pieces(BORROW_MIN):
                sink.write_borrowed(view, owner)
            return sink.commit(), sink.etag
        except BaseException as exc:
            sink.abort_after(exc)  # nothing wraps the sink's failures here: exc is the one
            raise


@paused_gc()  # the pickling's per-tensor objects (_runtime/gcpause.py)
def save(
    obj: Any,
    url: str | os.PathLike[str],
    *,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> SaveResult:
    """Write ``obj`` as a standard ``torch.save`` archive at ``url``; visible only once complete.

    ``overrides`` are :class:`~cloudckpt.TransferOptions` fields for this call (e.g.
    ``part_size``, ``write_concurrency``, ``storage_options``).
    """
    where = open_target(object_url(url), options, **overrides)
    return write_object(obj, where.store, where.key, where.options)

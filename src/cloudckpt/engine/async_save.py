"""Asynchronous save: return once a snapshot is taken; serialize and upload in the background.

A :class:`SaveHandle` has two moments: *staged* (the snapshot is taken, training may
mutate its tensors) and *done* (the object committed, or the save failed). At most
``max_in_flight`` saves run at once; a new save first waits for the oldest. A failed
save's error is raised by ``result()``; if nobody asked, by the next ``async_save``,
by :func:`wait_all`, and at interpreter exit it is logged and printed: never dropped.

Background work runs on a thread per save: the measurement behind that choice (a
thread vs a worker process) is in docs/async.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .._runtime.gcpause import paused_gc
from ..format.torch.picklability import PICKLE_ERRORS, raise_if_unpicklable
from ..options import TransferOptions
from ..store import object_url, open_target
from .background import SaveLine
from .handle import SaveHandle, in_flight, wait_all
from .save import SaveResult, write_object
from .staging import get_pool, snapshot

__all__ = ["SaveHandle", "async_save", "pending_saves", "wait_all"]

log = logging.getLogger("cloudckpt")

#: The process's one line of object saves (engine/background.py).
_line = SaveLine()


class _NoSnapshot(Exception):
    """The snapshot failed on the caller's thread, which raises the error: the save's
    thread ends without writing."""


def pending_saves() -> list[SaveHandle[SaveResult]]:
    """Saves started by :func:`async_save` and not yet done, oldest first."""
    return _line.pending()


def async_save(
    obj: Any,
    url: str | os.PathLike[str],
    *,
    max_in_flight: int = 1,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> SaveHandle:
    """Snapshot ``obj`` now, write it to ``url`` in the background; returns a SaveHandle.

    Takes the same options as :func:`cloudckpt.save`. Raises at once for what can be
    known at once: a bad URL or option, an unpicklable object, or an earlier async
    save's failure that nobody has seen yet.
    """
    if max_in_flight < 1:
        from ..errors import ConfigError

        raise ConfigError(f"max_in_flight={max_in_flight} must be at least 1")
    started = time.perf_counter()
    in_flight.raise_unreported()
    where = open_target(object_url(url), options, **overrides)
    store, key, opts = where.store, where.key, where.options
    target = store.url(key)
    _line.make_room(limit=max_in_flight)  # wait for the oldest ones beyond it
    in_flight.raise_unreported()

    pool = get_pool()
    handle: SaveHandle[SaveResult] = SaveHandle(target)
    staged: list[Any] = []  # the snapshot, once taken; empty when it failed
    go = threading.Event()

    # The thread is started before the snapshot and waits for it: started after, it
    # would take the GIL from the caller (materializing at once) while the caller still
    # has to return, and that wait would count in the stall (docs/async.md).
    def run() -> SaveResult:
        go.wait()
        if not staged:
            raise _NoSnapshot
        snap = staged[0]
        try:
            return write_object(snap.materialize(), store, key, opts, size_hint=snap.nbytes)
        finally:
            snap.release(pool)

    _line.start(handle, run, name=f"cloudckpt-save-{key.rsplit('/', 1)[-1]}")
    try:
        with paused_gc(kept=True):  # the staging's per-tensor objects (_runtime/gcpause.py)
            staged.append(snapshot(obj, pool))
    except PICKLE_ERRORS as exc:
        raise_if_unpicklable(obj, exc, target)
        raise
    finally:
        if not staged:
            go.set()  # no snapshot: the thread ends
    handle.mark_staged()
    _line.add(handle)
    handle.stall_seconds = time.perf_counter() - started
    go.set()
    return handle

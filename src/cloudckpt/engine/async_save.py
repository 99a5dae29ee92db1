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
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..format.torch.picklability import PICKLE_ERRORS, raise_if_unpicklable
from ..options import TransferOptions
from ..store import open_target
from .save import SaveResult, write_object
from .staging import get_pool, snapshot

__all__ = ["SaveHandle", "async_save", "pending_saves", "wait_all"]

log = logging.getLogger("cloudckpt")


class SaveHandle:
    """The state of one background save."""

    def __init__(self, url: str) -> None:
        self.url = url
        #: Seconds ``async_save`` blocked the caller (snapshot plus any wait for room).
        self.stall_seconds = 0.0
        self._staged = threading.Event()
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self._done.is_set() else "running"
        return f"<SaveHandle {self.url} {state}>"

    def staged(self) -> bool:
        """The snapshot is taken: the caller's tensors may change without affecting the save."""
        return self._staged.is_set()

    def done(self) -> bool:
        """The save has committed or failed."""
        return self._done.is_set()

    def failed(self) -> bool:
        """The save is done and did not commit."""
        return self._done.is_set() and self._error is not None

    @property
    def reported(self) -> bool:
        """The save's error reached the caller (``result()``, ``exception()`` or a later
        save), so nobody needs to raise it again."""
        return self._reported

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save commits or fails; returns ``done()``. Does not raise."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> SaveResult:
        """The committed save's result; raises the save's error, or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save of {self.url} still running after {timeout} s")
        self._reported = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it committed); marks the error as reported."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save of {self.url} still running after {timeout} s")
        self._reported = True
        return self._error

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save is done (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        with self._lock:
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's failure must not hide the save's outcome
                log.exception("callback for the async save of %s failed", self.url)


_handles: list[SaveHandle] = []  # started, not yet reported or committed
_registry_lock = threading.Lock()


def pending_saves() -> list[SaveHandle]:
    """Saves not yet done, oldest first."""
    with _registry_lock:
        return [h for h in _handles if not h.done()]


def _take_unreported_error() -> BaseException | None:
    with _registry_lock:
        for h in list(_handles):
            if h.done():
                _handles.remove(h)
                if h._error is not None and not h._reported:
                    h._reported = True
                    return h._error
    return None


def _raise_unreported() -> None:
    error = _take_unreported_error()
    if error is not None:
        raise error


def wait_all(timeout: float | None = None) -> None:
    """Wait for every pending async save; raise the first error nobody has seen yet."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for h in pending_saves():
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not h.wait(left):
            raise TimeoutError(f"async save of {h.url} still running")
    _raise_unreported()


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
    _raise_unreported()
    where = open_target(url, options, **overrides)
    store, key, opts = where.store, where.key, where.options
    target = store.url(key)
    # Room for this save: wait for the oldest ones beyond max_in_flight.
    while True:
        running = pending_saves()
        if len(running) < max_in_flight:
            break
        running[0].wait()
    _raise_unreported()

    pool = get_pool()
    handle = SaveHandle(target)
    staged: list[Any] = []  # the snapshot, once taken; empty when it failed
    go = threading.Event()

    # The thread is started before the snapshot and waits for it: started after, it
    # would take the GIL from the caller (materializing at once) while the caller still
    # has to return, and that wait would count in the stall (docs/async.md).
    def run() -> None:
        go.wait()
        if not staged:
            return
        snap = staged[0]
        try:
            staged_obj = snap.materialize()
            result = write_object(staged_obj, store, key, opts, size_hint=snap.nbytes)
        except BaseException as exc:
            snap.release(pool)
            handle._finish(None, exc)
            return
        snap.release(pool)
        handle._finish(result, None)

    threading.Thread(
        target=run, name=f"cloudckpt-save-{key.rsplit('/', 1)[-1]}", daemon=True
    ).start()
    try:
        staged.append(snapshot(obj, pool))
    except PICKLE_ERRORS as exc:
        raise_if_unpicklable(obj, exc, target)
        raise
    finally:
        if not staged:
            go.set()  # no snapshot: the thread ends
    handle._staged.set()
    with _registry_lock:
        _handles.append(handle)
    handle.stall_seconds = time.perf_counter() - started
    go.set()
    return handle


def _finish_at_exit() -> None:
    """Let pending saves finish before the interpreter tears down, and report failures."""
    for h in pending_saves():
        h.wait()
    while (error := _take_unreported_error()) is not None:
        log.error("cloudckpt: an async save failed and was never checked: %s", error)
        print(f"cloudckpt: an async save failed and was never checked: {error}", file=sys.stderr)


# Runs before concurrent.futures shuts its pools down (the I/O pool must stay usable).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_at_exit)
else:  # pragma: no cover - very old interpreters
    import atexit

    atexit.register(_finish_at_exit)

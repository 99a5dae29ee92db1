"""Waits that Ctrl-C can end, in the main thread as in any other.

Linux hands a process's SIGINT to any of its threads. When a worker thread takes it,
Python only notes it: the main thread acts on it at its next bytecode, and a main
thread blocked in one unbounded lock wait (a future that a stalled request never
completes) never gets there; the process ignores Ctrl-C for as long as the request
stalls. These waits block the main thread in slices of at most :data:`SLICE`
seconds, so a pending KeyboardInterrupt is raised within one slice; other threads,
which never get KeyboardInterrupt, wait in one piece.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

__all__ = ["SLICE", "wait_event", "wait_futures"]

#: The longest the main thread blocks at once: how late a Ctrl-C may be acted on.
SLICE = 0.25


def _sliced(wait: Callable[[float | None], bool], timeout: float | None) -> bool:
    """Run ``wait(t)`` (true once what it waits for is done) until done or ``timeout``
    seconds passed; in the main thread, ``t`` is at most :data:`SLICE`."""
    if threading.current_thread() is not threading.main_thread():
        return wait(timeout)
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if end is None else max(0.0, end - time.monotonic())
        if wait(SLICE if left is None else min(left, SLICE)):
            return True
        if left is not None and left <= SLICE:
            return False


def wait_futures(
    futures: Iterable[Future[Any]], timeout: float | None = None
) -> tuple[set[Future[Any]], set[Future[Any]]]:
    """``concurrent.futures.wait(futures, timeout)`` (all completed), acting on Ctrl-C
    within :data:`SLICE` seconds in the main thread. Returns (done, not done)."""
    pending = list(futures)
    _sliced(lambda t: not futures_wait(pending, timeout=t).not_done, timeout)
    done = {f for f in pending if f.done()}
    return done, set(pending) - done


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)``, acting on Ctrl-C within :data:`SLICE` seconds in the
    main thread. Returns whether the event is set."""
    return _sliced(event.wait, timeout)

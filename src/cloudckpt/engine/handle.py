"""One handle for every save that runs in the background, whatever started it.

A :class:`SaveHandle` has two moments: *staged* (the caller's state was captured and
may change again) and *done* (committed, or failed). ``async_save``, the manager's
``async_save`` and Megatron's asynchronous save all return one (the manager's and
Megatron's add what only they know: the step, megatron-core's ``AsyncRequest``).

Every handle is registered in one place (:data:`in_flight`) until its outcome has been
seen, so a failure is never dropped: ``result()`` or ``exception()`` raise or return
it; if nobody asked, the next ``async_save`` raises it, :func:`wait_all` raises it, and
at interpreter exit it is logged and printed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..ranks.groups import runs_collectives
from ..store.waits import wait_event

__all__ = ["InFlight", "SaveHandle", "in_flight", "wait_all"]

log = logging.getLogger("cloudckpt")
T = TypeVar("T")


class SaveHandle(Generic[T]):
    """The state of one background save: ``staged()``, ``done()``, ``result()``."""

    #: What the handle is called in its repr and errors.
    kind = "save"

    def __init__(self, url: str, *, staged: bool = False) -> None:
        self.url = url
        #: Seconds the call that started the save blocked its caller.
        self.stall_seconds = 0.0
        self._staged = threading.Event()
        if staged:
            self._staged.set()
        self._done = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._callbacks: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self._done.is_set() else "running"
        return f"<{type(self).__name__} {self.url} {state}>"

    def staged(self) -> bool:
        """The state is captured: the caller's tensors may change without affecting the save."""
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
        return wait_event(self._done, timeout)

    def result(self, timeout: float | None = None) -> T:
        """The committed save's result; raises the save's error, or TimeoutError."""
        if not wait_event(self._done, timeout):
            raise TimeoutError(f"{self.kind} of {self.url} still running after {timeout} s")
        self._reported = True
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it committed); marks the error as reported."""
        if not wait_event(self._done, timeout):
            raise TimeoutError(f"{self.kind} of {self.url} still running after {timeout} s")
        self._reported = True
        return self._error

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` once the save is done (at once if it already is)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def mark_staged(self) -> None:
        """The starter's side: the state is captured."""
        self._staged.set()

    def finish(self, result: T | None, error: BaseException | None) -> None:
        """The starter's side: the save committed (``result``) or failed (``error``)."""
        with self._lock:
            self._result, self._error = result, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's failure must not hide the save's outcome
                log.exception("callback for the %s of %s failed", self.kind, self.url)


#: Seconds the exit hook waits for each finished save's thread to end.
WORKER_EXIT_WAIT = 10.0


class InFlight:
    """Handles started and not yet seen through: pending ones and unseen failures."""

    def __init__(self) -> None:
        self._handles: list[SaveHandle[Any]] = []
        self._lock = threading.Lock()
        self._workers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

    def add_worker(self, thread: threading.Thread) -> None:
        """A daemon thread running a save, joined at exit: it still runs a moment after
        its handle is finished (dropping the snapshot's tensors), and an interpreter
        torn down under it aborts the process ("terminate called without an active
        exception"). Its collectives, if any, run on cloudckpt's groups, which the
        groups' own exit hook then leaves alone while it lives (ranks/groups.py)."""
        with self._lock:
            self._workers.add(thread)
        runs_collectives(thread)

    def add(self, handle: SaveHandle[Any]) -> None:
        with self._lock:
            self._handles.append(handle)

    def pending(self, kind: type[SaveHandle[Any]] | None = None) -> list[SaveHandle[Any]]:
        """Saves not yet done (only those of exactly ``kind``, if given), oldest first."""
        with self._lock:
            handles = [h for h in self._handles if not h.done()]
        return handles if kind is None else [h for h in handles if type(h) is kind]

    def take_unreported_error(self) -> BaseException | None:
        """The oldest failure nobody has seen (now marked seen); forgets finished saves."""
        with self._lock:
            for h in list(self._handles):
                if h.done():
                    self._handles.remove(h)
                    if h._error is not None and not h._reported:
                        h._reported = True
                        return h._error
        return None

    def raise_unreported(self) -> None:
        error = self.take_unreported_error()
        if error is not None:
            raise error

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait for every pending save; raise the first error nobody has seen yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self.pending():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                raise TimeoutError(f"{h.kind} of {h.url} still running")
        self.raise_unreported()

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's saves run in threads the child does not have
        (waiting for them at exit would wait forever), and are the parent's to report."""
        self._handles = []
        self._lock = threading.Lock()
        self._workers = weakref.WeakSet()

    def finish_at_exit(self) -> None:
        """Let pending saves finish, and their threads end, before the interpreter tears
        down; report failures."""
        for h in self.pending():
            h.wait()
        with self._lock:
            workers = list(self._workers)
        for thread in workers:  # each handle is done: only the thread's return is left
            thread.join(WORKER_EXIT_WAIT)
        while (error := self.take_unreported_error()) is not None:
            message = f"cloudckpt: a background save failed and was never checked: {error}"
            log.error("%s", message)
            print(message, file=sys.stderr)


#: The process's one registry of background saves.
in_flight = InFlight()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=in_flight.forget_after_fork)


def wait_all(timeout: float | None = None) -> None:
    """Wait for every pending background save; raise the first error nobody has seen."""
    in_flight.wait_all(timeout)


# Runs before the interpreter joins its non-daemon threads and shuts pools down.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(in_flight.finish_at_exit)
else:  # pragma: no cover - very old interpreters
    import atexit

    atexit.register(in_flight.finish_at_exit)

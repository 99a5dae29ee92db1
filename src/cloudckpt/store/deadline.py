"""One deadline per operation: a whole save or load, across every request it makes.

An entry point (``save``, ``load``, a DCP writer or reader, a Megatron save) opens
:func:`deadline_scope` with ``TransferOptions.deadline``; every transfer group and every
retry loop inside, in any thread the operation hands work to (they re-enter the scope
with :func:`within`), reads the same expiry. Retries stop at it
(:class:`~cloudckpt.errors.DeadlineExceededError`), groups stop waiting at it, and the
cleanup after a failure (aborting an upload, deleting what was written) gets
:data:`CLEANUP_GRACE` seconds more, never a retry past that.

A request its caller waits for directly (a load's first HEAD and directory reads, a
listing, a marker read, a copy's HEAD: anything not sent through a transfer group, which
bounds its own requests) runs under a deadline through :func:`call_within`: in a daemon
thread, waited for until the deadline, then abandoned (it ends at its own request
timeout; nobody waits for it) with :class:`~cloudckpt.errors.DeadlineExceededError`
naming the request. The store's retry loop does this for every attempt
(cloudckpt.store.retry), so no request of a bounded operation outlives its deadline in
the caller's thread, whatever its socket timeout.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import DeadlineExceededError
from .waits import wait_futures

__all__ = [
    "CLEANUP_GRACE",
    "Deadline",
    "call_within",
    "cleanup_scope",
    "current_deadline",
    "deadline_scope",
    "start_deadline",
    "within",
]

T = TypeVar("T")

#: Seconds the cleanup after a failed operation may take past its deadline (one abort
#: or a few deletes); what is not done by then is left for ``cloudckpt gc``.
CLEANUP_GRACE = 5.0


@dataclass(frozen=True)
class Deadline:
    """An operation's time limit: ``seconds`` as asked, ``expires`` on the monotonic clock."""

    seconds: float
    expires: float

    def remaining(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.expires - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.expires


_current: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "cloudckpt_deadline", default=None
)


def start_deadline(seconds: float | None) -> Deadline | None:
    """A deadline starting now, for an operation spread over several calls (a DCP writer
    starts one at ``set_up_storage_writer`` and re-enters it with :func:`within`); the
    earlier of it and the scope it starts in."""
    if seconds is None:
        return _current.get()
    mine = Deadline(seconds, time.monotonic() + seconds)
    outer = _current.get()
    return outer if outer is not None and outer.expires <= mine.expires else mine


def current_deadline() -> Deadline | None:
    """The deadline of the innermost scope, if any."""
    return _current.get()


@contextlib.contextmanager
def within(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run under ``deadline`` (an operation's, handed to another thread); ``None``: as is."""
    if deadline is None:
        yield _current.get()
        return
    outer = _current.get()
    if outer is not None and outer.expires <= deadline.expires:
        deadline = outer
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


@contextlib.contextmanager
def deadline_scope(seconds: float | None) -> Iterator[Deadline | None]:
    """An operation bounded by ``seconds`` from now (the earlier of it and any outer one)."""
    with within(start_deadline(seconds)) as deadline:
        yield deadline


@contextlib.contextmanager
def cleanup_scope() -> Iterator[Deadline | None]:
    """The cleanup after a failure: the operation's deadline plus :data:`CLEANUP_GRACE`."""
    outer = _current.get()
    if outer is None:
        yield None
        return
    grace = Deadline(outer.seconds, max(outer.expires, time.monotonic()) + CLEANUP_GRACE)
    token = _current.set(grace)
    try:
        yield grace
    finally:
        _current.reset(token)


# -- requests their caller waits for, bounded ------------------------------------------------

#: True inside a request run by :func:`call_within` (its nested requests, an overlay
#: store's tiers, need no thread of their own: the outer wait bounds them).
_bounded: contextvars.ContextVar[bool] = contextvars.ContextVar("cloudckpt_bounded", default=False)

#: Seconds an idle helper thread waits for work before it ends.
_IDLE_SECONDS = 30.0


class _Helpers:
    """Daemon threads for :func:`call_within`, one per request in flight: a request
    never queues behind another (a stalled one would hold it past its deadline), and an
    abandoned one, stuck until its socket timeout, never holds up the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._idle = 0  # waiting threads no job has been promised to
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread's next job is this one
        self._jobs.put((future, fn))
        if start:
            threading.Thread(target=self._work, name="cloudckpt-request", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            try:
                future, fn = self._jobs.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody was promised this thread: it may go
                        self._idle -= 1
                        return
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            del future, fn
            with self._lock:
                self._idle += 1


_helpers = _Helpers()


def _reset_after_fork() -> None:
    global _helpers
    _helpers = _Helpers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def call_within(fn: Callable[[], T], deadline: Deadline | None, what: str) -> T:
    """``fn()`` (one request attempt, ``what``: "head s3://b/k"), not waited for past
    ``deadline``: then :class:`~cloudckpt.errors.DeadlineExceededError` naming ``what``,
    the request left to end at its own timeout in its daemon thread. Without a deadline,
    or inside a request already bounded this way, ``fn()`` in this thread."""
    if deadline is None or _bounded.get():
        return fn()
    if deadline.passed:
        raise DeadlineExceededError(
            f"{what} not sent: the operation's {deadline.seconds:g} s deadline has passed"
        )
    context = contextvars.copy_context()
    context.run(_bounded.set, True)
    future = _helpers.submit(lambda: context.run(fn))
    wait_futures([future], deadline.remaining())
    if future.done():  # also when it finished as the wait ended
        return future.result()
    raise DeadlineExceededError(
        f"{what} not answered within the operation's {deadline.seconds:g} s deadline; abandoned"
    )

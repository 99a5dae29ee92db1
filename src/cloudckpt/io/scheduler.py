"""The per-process I/O scheduler every transfer goes through.

It owns one thread pool for all requests and gives each operation a
:class:`TransferGroup`: at most ``limit`` of the group's requests run at once (the
read or write concurrency of that call), ``submit`` blocks when the group is full
(back-pressure that bounds memory), and the first failure cancels the rest.

Retries are not the scheduler's: each store call retries by its store's policy
(cloudckpt.store.retry). A group runs its requests inside a cancel scope, so that
cancelling the group also ends their backoff and rate-limit waits. A process-wide byte
budget (``max_bytes_in_flight``) caps write buffers across all concurrent saves.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ..errors import DeadlineExceededError
from ..options import IO_THREADS, TransferOptions
from ..store.deadline import Deadline, cleanup_scope, current_deadline, within
from ..store.retry import Cancelled, cancel_scope
from ..store.waits import wait_futures

__all__ = [
    "ByteBudget",
    "Cancelled",
    "IOThreads",
    "TransferGroup",
    "get_scheduler",
    "run_cleanup",
]

log = logging.getLogger("cloudckpt")
T = TypeVar("T")


class ByteBudget:
    """Bytes that may sit in write buffers at once, across the whole process."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int, cancel: threading.Event | None = None) -> None:
        if self.capacity is None:
            return
        with self._cond:
            # A request larger than the whole budget runs alone rather than never.
            while self.used and self.used + n > self.capacity:
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                self._cond.wait(0.5)
            self.used += n

    def release(self, n: int) -> None:
        if self.capacity is None:
            return
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class IOThreads:
    """A fixed pool of daemon threads running submitted calls as futures.

    Daemon threads, unlike ``ThreadPoolExecutor``'s: a request abandoned after its
    operation's deadline (stuck until its own timeout) never holds up the process's
    exit. Saves still running at exit are waited for by ``async_save``'s exit hook.
    """

    def __init__(self, count: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._count, self._name = count, name
        self._started = 0
        self._busy = 0  # submitted and not yet finished
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, fn))
        with self._lock:
            self._busy += 1
            if self._busy > self._started and self._started < self._count:
                self._started += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}_{self._started}", daemon=True
                ).start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            del item, future, fn
            with self._lock:
                self._busy -= 1


class _Scheduler:
    def __init__(self) -> None:
        self.executor = IOThreads(IO_THREADS, "cloudckpt-io")
        self._lock = threading.Lock()
        self.budget = ByteBudget(None)

    def set_budget(self, capacity: int | None) -> ByteBudget:
        """The process's budget, made ``capacity`` bytes; with None, an unbounded one of
        the caller's own, leaving the process's as it is: a transfer without
        ``max_bytes_in_flight`` (a local tier's save) never waits for the bytes another
        transfer holds, such as a drain's parts stalled on a bucket that stopped answering."""
        if capacity is None:
            return ByteBudget(None)
        with self._lock:
            if self.budget.capacity != capacity:
                self.budget = ByteBudget(capacity)
            return self.budget


_scheduler: _Scheduler | None = None
_scheduler_lock = threading.Lock()


def get_scheduler() -> _Scheduler:
    """The process's scheduler, created on first use (and again after a fork)."""
    global _scheduler
    with _scheduler_lock:
        if _scheduler is None:
            _scheduler = _Scheduler()
        return _scheduler


def _reset_after_fork() -> None:
    global _scheduler, _scheduler_lock
    _scheduler = None
    _scheduler_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


#: After a deadline passed or Ctrl-C, how long cancelling waits for requests still
#: running: a stalled one is abandoned after it, to end on its own at its request timeout
#: in its daemon thread; the caller does not wait for it.
CANCEL_GRACE = 1.0


def _stopping() -> bool:
    """Whether the exception being handled ends the operation outright (Ctrl-C, a passed
    deadline): then nobody waits on a stalled network for requests still running."""
    return isinstance(sys.exc_info()[1], (KeyboardInterrupt, DeadlineExceededError))


def _rank_prefix() -> str:
    """``"rank N: "`` in a job with an initialized process group, else nothing."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return f"rank {dist.get_rank()}: "
    except Exception:  # pragma: no cover - torch without distributed
        pass
    return ""


class TransferGroup:
    """Requests of one operation: bounded concurrency, first error wins, cancel on failure.

    The group is bounded by the operation's deadline (cloudckpt.store.deadline; or by
    ``deadline`` seconds from now, if earlier): once it passes the operation fails with
    :class:`~cloudckpt.errors.DeadlineExceededError` naming the requests still running,
    raised by :meth:`submit` or :meth:`wait`, and the group is cancelled (a stuck request
    is left to end on its own timeout; nobody waits for it).
    """

    def __init__(
        self, options: TransferOptions, limit: int, *, deadline: float | None = None
    ) -> None:
        self.options = options
        self._slots = threading.BoundedSemaphore(limit)
        self._futures: list[tuple[Future[Any], Callable[[], None] | None, str]] = []
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()
        self.error: BaseException | None = None
        bound = current_deadline()
        if deadline is not None:
            own = Deadline(deadline, time.monotonic() + deadline)
            bound = own if bound is None or own.expires < bound.expires else bound
        self._bound = bound
        self.deadline = None if bound is None else bound.seconds
        self._expires = None if bound is None else bound.expires
        self.expired = False

    def _remaining(self) -> float | None:
        return None if self._expires is None else max(0.0, self._expires - time.monotonic())

    def _check_deadline(self) -> None:
        if self._expires is not None and time.monotonic() >= self._expires:
            self._expire()

    def _expire(self) -> None:
        with self._lock:
            running = [what for f, _, what in self._futures if not f.done()]
            if self.error is None:
                shown = "; ".join(running[:4]) + (
                    f" and {len(running) - 4} more" if len(running) > 4 else ""
                )
                self.error = DeadlineExceededError(
                    f"{_rank_prefix()}not finished within its {self.deadline:g} s deadline "
                    f"(still running: {shown or 'nothing'}); cancelled, nothing committed"
                )
            self.expired = True
        self.cancel_event.set()
        raise self.error

    def submit(
        self,
        fn: Callable[[], T],
        what: str,
        *,
        on_done: Callable[[], None] | None = None,
    ) -> Future[T]:
        """Run ``fn`` on the pool; blocks while ``limit`` requests are running.

        ``what`` names the request in the debug log when it fails.
        """
        while not self._slots.acquire(timeout=0.5):
            self.raise_if_failed()
        self.raise_if_failed_releasing()

        def run() -> T:
            try:
                if self.cancel_event.is_set():
                    raise Cancelled()
                with cancel_scope(self.cancel_event), within(self._bound):
                    return fn()
            except BaseException as exc:
                log.debug("%s failed: %s", what, exc)
                with self._lock:
                    if self.error is None and not isinstance(exc, Cancelled):
                        self.error = exc
                self.cancel_event.set()
                raise
            finally:
                self._slots.release()
                if on_done is not None:
                    on_done()

        future = get_scheduler().executor.submit(run)
        with self._lock:
            self._futures.append((future, on_done, what))
        return future

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` in the group and wait for it (within the deadline): a request the
        caller needs the answer of (create an upload, complete it)."""
        future = self.submit(fn, what)
        done, _ = wait_futures([future], self._remaining())
        if not done:
            self._expire()
        return future.result()

    def raise_if_failed(self) -> None:
        """Raise the group's first failure, or its deadline's error once that passed: a
        caller waiting for room (a part buffer) stops when the group cannot go on."""
        self._raise_error()
        self._check_deadline()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def raise_if_failed_releasing(self) -> None:
        if self.error is not None:
            self._slots.release()
            raise self.error

    def wait(self) -> None:
        """Wait for every request; raise the first failure."""
        with self._lock:
            futures = [f for f, _, _ in self._futures]
        _, running = wait_futures(futures, self._remaining())
        if running and self.error is None:
            self._expire()
        with self._lock:  # done: drop them (their callbacks may point back at the caller)
            self._futures = [f for f in self._futures if not f[0].done()]
        self._raise_error()

    def cancel(self) -> None:
        """Stop queued and retrying requests, then wait for running ones to finish.

        After the deadline passed, or while handling Ctrl-C (``KeyboardInterrupt``) or a
        :class:`~cloudckpt.errors.DeadlineExceededError`, the wait lasts at most
        :data:`CANCEL_GRACE` seconds: a request stalled on the network is abandoned (its
        daemon thread ends at its request timeout, and its ``on_done`` runs then). After
        any other failure running requests are awaited, since they may be filling the
        caller's memory."""
        self.cancel_event.set()
        with self._lock:
            futures = list(self._futures)
        for f, on_done, _ in futures:
            if f.cancel():  # never started: give back what its start would have released
                self._slots.release()
                if on_done is not None:
                    on_done()
        bounded = self.expired or _stopping()
        wait_futures([f for f, _, _ in futures], CANCEL_GRACE if bounded else None)
        with self._lock:
            self._futures = [f for f in self._futures if not f[0].done()]


def run_cleanup(options: TransferOptions, fn: Callable[[], T], what: str) -> T:
    """Run a cleanup request (an abort, a delete) after a failure: within the operation's
    deadline plus its grace (cloudckpt.store.deadline), never retried past it, and not
    waited for beyond it (a stuck one is abandoned; ``cloudckpt gc`` finds what it left)."""
    with cleanup_scope():
        return TransferGroup(options, 1).call(fn, what)

"""The per-process I/O scheduler every transfer goes through.

It owns one thread pool for all requests and gives each operation a
:class:`TransferGroup`: at most ``limit`` of the group's requests run at once (the
read or write concurrency of that call), ``submit`` blocks when the group is full
(back-pressure that bounds memory), and the first failure cancels the rest.

Each request is retried on :class:`~cloudckpt.errors.TransientError` with exponential
backoff and full jitter, after waiting for a token from the per-prefix rate limiter.
A process-wide byte budget (``max_bytes_in_flight``) caps write buffers across all
concurrent saves.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

from ..errors import RetriesExhaustedError, TransientError
from ..options import TransferOptions

__all__ = [
    "ByteBudget",
    "Cancelled",
    "RateLimiter",
    "TransferGroup",
    "call_with_retries",
    "get_scheduler",
]

log = logging.getLogger("cloudckpt")
T = TypeVar("T")

#: Threads in the shared pool: enough for several concurrent operations at the
#: default concurrencies; each group still caps its own share.
_POOL_THREADS = 64


class Cancelled(Exception):
    """Raised inside a request whose group was cancelled; never reaches the user."""


class RateLimiter:
    """A token bucket: ``rate`` requests per second with a burst of ``rate`` tokens."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, cancel: threading.Event | None = None) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                wait = (1 - self._tokens) / self.rate
            if cancel is not None and cancel.wait(wait):
                raise Cancelled()
            if cancel is None:
                time.sleep(wait)


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


class _Scheduler:
    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="cloudckpt-io")
        self._limiters: dict[tuple[str, float], RateLimiter] = {}
        self._lock = threading.Lock()
        self.budget = ByteBudget(None)

    def limiter(self, prefix: str, rate: float | None) -> RateLimiter | None:
        if rate is None:
            return None
        with self._lock:
            key = (prefix, rate)
            lim = self._limiters.get(key)
            if lim is None:
                lim = self._limiters[key] = RateLimiter(rate)
            return lim

    def set_budget(self, capacity: int | None) -> ByteBudget:
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


def call_with_retries(
    fn: Callable[[], T],
    options: TransferOptions,
    what: str,
    *,
    prefix: str = "",
    cancel: threading.Event | None = None,
) -> T:
    """Run ``fn`` until it succeeds, retrying transient faults with jittered backoff."""
    limiter = get_scheduler().limiter(prefix, options.requests_per_second)
    attempt = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        if limiter is not None:
            limiter.acquire(cancel)
        try:
            return fn()
        except TransientError as exc:
            attempt += 1
            if attempt >= options.max_attempts:
                raise RetriesExhaustedError(
                    f"{what} failed after {attempt} attempts; last error: {exc}"
                ) from exc
            delay = random.uniform(0, min(options.backoff_max, options.backoff_base * 2**attempt))
            log.debug("retrying %s in %.2fs (attempt %d): %s", what, delay, attempt + 1, exc)
            if cancel is not None:
                if cancel.wait(delay):
                    raise Cancelled() from exc
            else:
                time.sleep(delay)


class TransferGroup:
    """Requests of one operation: bounded concurrency, first error wins, cancel on failure."""

    def __init__(self, options: TransferOptions, limit: int, *, prefix: str = "") -> None:
        self.options = options
        self.prefix = prefix
        self._slots = threading.BoundedSemaphore(limit)
        self._futures: list[tuple[Future[Any], Callable[[], None] | None]] = []
        self._lock = threading.Lock()
        self.cancel_event = threading.Event()
        self.error: BaseException | None = None

    def submit(
        self,
        fn: Callable[[], T],
        what: str,
        *,
        on_done: Callable[[], None] | None = None,
    ) -> Future[T]:
        """Run ``fn`` (with retries) on the pool; blocks while ``limit`` requests are running."""
        while not self._slots.acquire(timeout=0.5):
            self.raise_if_failed()
        self.raise_if_failed_releasing()

        def run() -> T:
            try:
                return call_with_retries(
                    fn, self.options, what, prefix=self.prefix, cancel=self.cancel_event
                )
            except BaseException as exc:
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
            self._futures.append((future, on_done))
        return future

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def raise_if_failed_releasing(self) -> None:
        if self.error is not None:
            self._slots.release()
            raise self.error

    def wait(self) -> None:
        """Wait for every request; raise the first failure."""
        with self._lock:
            futures = [f for f, _ in self._futures]
        futures_wait(futures)
        with self._lock:  # done: drop them (their callbacks may point back at the caller)
            self._futures = [f for f in self._futures if not f[0].done()]
        self.raise_if_failed()

    def cancel(self) -> None:
        """Stop queued and retrying requests, then wait for running ones to finish."""
        self.cancel_event.set()
        with self._lock:
            futures = list(self._futures)
        for f, on_done in futures:
            if f.cancel():  # never started: give back what its start would have released
                self._slots.release()
                if on_done is not None:
                    on_done()
        futures_wait([f for f, _ in futures])
        with self._lock:
            self._futures = [f for f in self._futures if not f[0].done()]

"""How a store retries a request: the policy, the per-prefix rate limit, cancellation.

Every public :class:`~cloudckpt.store.base.Store` method runs its backend primitive
through :meth:`RetryPolicy.run`; nothing above the store layer retries by hand. A
request is retried on :class:`~cloudckpt.errors.TransientError` (throttling, 5xx,
resets, timeouts, short answers) with exponential backoff and full jitter, after
waiting for a token from the rate limiter of its key prefix, until ``max_attempts``
attempts have been made; then :class:`~cloudckpt.errors.RetriesExhaustedError`.

A transfer group (the engine's scheduler) stops the retries of its requests by
running them inside :func:`cancel_scope`: a backoff wait or a rate-limit wait ends at
once with :class:`Cancelled` when the scope's event is set.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..errors import ConfigError, RetriesExhaustedError, TransientError

if TYPE_CHECKING:
    from ..options import TransferOptions

__all__ = [
    "Cancelled",
    "RateLimiter",
    "RetryPolicy",
    "cancel_scope",
    "current_cancel",
    "rate_limiter",
]

log = logging.getLogger("cloudckpt")
T = TypeVar("T")


class Cancelled(Exception):
    """Raised inside a request whose transfer was cancelled; never reaches the user."""


_cancel: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "cloudckpt_cancel", default=None
)


@contextlib.contextmanager
def cancel_scope(event: threading.Event) -> Iterator[None]:
    """Requests made inside stop retrying (raise :class:`Cancelled`) once ``event`` is set."""
    token = _cancel.set(event)
    try:
        yield
    finally:
        _cancel.reset(token)


def current_cancel() -> threading.Event | None:
    """The cancel event of the innermost :func:`cancel_scope`, if any."""
    return _cancel.get()


def _wait(seconds: float, cancel: threading.Event | None) -> None:
    if cancel is None:
        time.sleep(seconds)
    elif cancel.wait(seconds):
        raise Cancelled()


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
            _wait(wait, cancel)


_limiters: dict[tuple[str, float], RateLimiter] = {}
_limiters_lock = threading.Lock()


def rate_limiter(scope: str, rate: float | None) -> RateLimiter | None:
    """The process-wide limiter of ``scope`` (a store URL and key prefix) at ``rate``."""
    if rate is None:
        return None
    with _limiters_lock:
        limiter = _limiters.get((scope, rate))
        if limiter is None:
            limiter = _limiters[(scope, rate)] = RateLimiter(rate)
        return limiter


def _reset_after_fork() -> None:
    global _limiters_lock
    _limiters.clear()
    _limiters_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a store retries; built from the transfer options."""

    #: Attempts per request, the first included.
    max_attempts: int = 10
    #: First retry delay in seconds; doubles each attempt (full jitter).
    backoff_base: float = 0.2
    #: Longest delay between two attempts, in seconds.
    backoff_max: float = 20.0
    #: Requests per second per key prefix (token bucket); ``None``: no limit.
    requests_per_second: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts={self.max_attempts} must be at least 1")

    @classmethod
    def from_options(cls, options: TransferOptions) -> RetryPolicy:
        """The policy of a :class:`~cloudckpt.options.TransferOptions`."""
        return cls(
            max_attempts=options.max_attempts,
            backoff_base=options.backoff_base,
            backoff_max=options.backoff_max,
            requests_per_second=options.requests_per_second,
        )

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (full jitter, capped)."""
        return random.uniform(0, min(self.backoff_max, self.backoff_base * 2**attempt))

    def run(self, fn: Callable[[], T], what: str, *, scope: str = "") -> T:
        """Run ``fn`` until it succeeds, retrying transient faults with jittered backoff.

        ``what`` names the request in errors ("put s3://b/k"); ``scope`` selects the
        rate limiter. Non-transient errors pass through at once.
        """
        limiter = rate_limiter(scope, self.requests_per_second)
        cancel = current_cancel()
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
                if attempt >= self.max_attempts:
                    raise RetriesExhaustedError(
                        f"{what} failed after {attempt} attempts; last error: {exc}"
                    ) from exc
                delay = self.delay(attempt)
                log.debug("retrying %s in %.2fs (attempt %d): %s", what, delay, attempt + 1, exc)
                try:
                    _wait(delay, cancel)
                except Cancelled:
                    raise Cancelled() from exc

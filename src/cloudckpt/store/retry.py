"""How a store retries a request: the policy, the per-prefix rate limits, cancellation.

Every public :class:`~cloudckpt.store.base.Store` method runs its backend primitive
through :meth:`RetryPolicy.run`; nothing above the store layer retries by hand. A
request is retried on :class:`~cloudckpt.errors.TransientError` (throttling, 5xx,
resets, timeouts, short answers) with exponential backoff and full jitter, after
waiting for its key prefix's rate limiters, until ``max_attempts`` attempts have been
made; then :class:`~cloudckpt.errors.RetriesExhaustedError`. Each retry is logged at
WARNING on the ``cloudckpt`` logger with its cause and attempt number (the command line
prints these lines). A refused connection (nothing listens at the endpoint) is retried
only ``connect_attempts`` times within ``connect_budget`` seconds, then fails naming
the endpoint: a wrong endpoint or a stopped server does not come back within a backoff.

A key prefix (a "scope": the store's URL and the key's folder) has up to two limiters,
each shared by every transfer of the process (and replaced in a forked child):

- :class:`RateLimiter`, a static token bucket at ``requests_per_second``, when set;
- :class:`AdaptiveRate` (``adaptive_rate``, the default), which does nothing but count
  requests until the store throttles one (:class:`~cloudckpt.errors.ThrottledError`),
  then paces the scope by additive increase, multiplicative decrease (AIMD). The
  algorithm and its constants are explained in docs/reliability.md.

A transfer group (the engine's scheduler) stops the retries of its requests by
running them inside :func:`cancel_scope`: a backoff wait or a rate-limit wait ends at
once with :class:`Cancelled` when the scope's event is set. Inside an operation's
deadline (cloudckpt.store.deadline) no retry starts that could not begin before it, and
a request made outside a transfer group is not waited for past it
(:func:`~cloudckpt.store.deadline.call_within`: its socket timeout does not matter).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

from ..errors import (
    ConfigError,
    DeadlineExceededError,
    RetriesExhaustedError,
    ThrottledError,
    TransientError,
)
from ..redact import display_url, redact_text
from .deadline import Deadline, call_within, current_deadline

if TYPE_CHECKING:
    from ..options import TransferOptions

__all__ = [
    "AdaptiveRate",
    "Cancelled",
    "RateLimiter",
    "RetryPolicy",
    "adaptive_limiter",
    "cancel_scope",
    "current_cancel",
    "rate_limiter",
    "refused_endpoint",
    "retry_cause",
]

#: The backoff's jitter comes from a generator of its own: the module-level ``random``
#: functions share the program's stream, which a training loop seeds and checkpoints
#: (Accelerate saves it with its RNG states), and a retry must not advance it.
_JITTER = random.Random()

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


#: A throttle cuts the allowed rate to this fraction of the rate the scope was sending.
DECREASE = 0.5
#: After a cut, the allowed rate climbs back to where it was over this many seconds of
#: requests succeeding at the allowed rate (the additive step is set at each cut).
RECOVER_SECONDS = 3.0
#: A throttle cuts again only if its request was let through at least this many
#: requests after the last cut: the first one after a cut (a rank's own retry, when it
#: sends one request at a time) goes out before the other ranks sharing the prefix have
#: cut, and answers for their old rate, not for this rank's new one.
HOLD_REQUESTS = 2
#: The allowed rate never falls below this many requests per second.
FLOOR = 0.5
#: The additive step is at least this many requests per second, per second.
MIN_STEP = 1.0
#: Having climbed to this multiple of the rate that drew its first throttle without
#: drawing another, the limiter steps aside (the store's limit has moved, or the
#: throttle answered a burst).
RELEASE = 2.0
#: The window over which a scope's sending rate is measured, and the shortest span a
#: measurement divides by.
METER_SECONDS = 1.0
METER_MIN_SECONDS = 0.1


class AdaptiveRate:
    """One scope's request rate, adapted to the store's throttling (AIMD).

    Call order, per attempt: :meth:`acquire` (or :meth:`reserve` and wait) before the
    request, then :meth:`throttled` with the stamp it returned if the store answered
    :class:`~cloudckpt.errors.ThrottledError`, or :meth:`succeeded` if it answered.

    Until the first throttle it is not engaged (``rate`` is None): it only counts the
    requests it lets through, without a lock or a wait. A throttle sets the allowed rate
    to ``DECREASE`` times the rate the scope was sending (never below ``FLOOR``, never
    above ``ceiling``), unless the throttled request was let through before the last
    cut or among the ``HOLD_REQUESTS - 1`` right after it: answers to requests already
    in flight cut once, not once each. Engaged, it spaces requests ``1 / rate`` apart at
    the rate of the moment (a rise takes effect at the next request). Each success then
    adds ``step / rate`` (``step`` per second at the allowed rate), so the rate returns
    to its pre-cut value in ``RECOVER_SECONDS`` unless throttled again; at ``RELEASE``
    times the first throttled rate (or at ``ceiling``) it disengages.
    """

    def __init__(
        self, ceiling: float | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        #: A rate the limiter never allows more than (the static ``requests_per_second``).
        self.ceiling = ceiling
        #: Allowed requests per second; None: not engaged, no limit.
        self.rate: float | None = None
        #: Cuts made so far.
        self.cuts = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._step = 0.0  # additive increase, requests per second per second
        self._target = 0.0  # the end of this climb; past it without a throttle, climb faster
        self._release = math.inf  # the rate at which the limiter disengages
        self._last = -math.inf  # the start of the last request's slot (engaged)
        # Requests let through so far (a request's stamp), and the last stamp that a
        # throttle does not cut for; counted without the lock, like the meter.
        self._sent = 0
        self._cut_mark = -1
        # The sending-rate meter; updated without the lock, so a count may be lost to a
        # race: it only sets the rate of the first cut.
        self._window_start = clock()
        self._window_count = 0
        self._last_rate = 0.0

    def reserve(self) -> tuple[int, float]:
        """``(stamp, wait)``: this request's stamp for :meth:`throttled` (its number), and
        the seconds to wait before sending it."""
        now = self._clock()
        span = now - self._window_start
        if span >= METER_SECONDS:
            self._last_rate = self._window_count / span
            self._window_start = now
            self._window_count = 0
        self._window_count += 1
        self._sent += 1
        stamp = self._sent
        if self.rate is None:
            return stamp, 0.0
        with self._lock:
            if self.rate is None:
                return stamp, 0.0
            start = max(now, self._last + 1.0 / self.rate)
            self._last = start
        return stamp, start - now

    def acquire(self, cancel: threading.Event | None = None) -> int:
        """Wait for this scope's next slot; returns the stamp for :meth:`throttled`."""
        stamp, wait = self.reserve()
        if wait > 0:
            _wait(wait, cancel)
        return stamp

    def sending_rate(self) -> float:
        """Requests per second let through lately (the last full window, or this one)."""
        span = self._clock() - self._window_start
        return max(self._last_rate, self._window_count / max(span, METER_MIN_SECONDS))

    def throttled(self, stamp: int) -> None:
        """The request stamped ``stamp`` was throttled: cut the rate, once per window."""
        with self._lock:
            if stamp <= self._cut_mark:
                return  # let through before the last cut or just after: it answered for it
            base = self.sending_rate()
            if self.rate is not None:
                base = min(base, self.rate)
            if self.ceiling is not None:
                base = min(base, self.ceiling)
            rate = max(FLOOR, base * DECREASE)
            if self.ceiling is not None:
                rate = min(rate, self.ceiling)
            before = max(base, rate / DECREASE)  # what the climb returns to
            if self.rate is None:
                self._release = RELEASE * before
                if self.ceiling is not None:
                    self._release = min(self._release, self.ceiling)
                self._last = -math.inf
            self._step = max(MIN_STEP, (before - rate) / RECOVER_SECONDS)
            self._target = before
            self.rate = rate
            self._cut_mark = self._sent + HOLD_REQUESTS - 1
            self.cuts += 1
        log.debug("throttled: request rate cut to %.2f/s", rate)

    def succeeded(self) -> None:
        """A request was answered: probe upward by ``step / rate``."""
        if self.rate is None:
            return
        with self._lock:
            if self.rate is None:
                return
            rate = self.rate + min(self._step / self.rate, self.rate)
            if rate >= self._target:  # climbed back unthrottled: the next climb is steeper
                self._step *= 2
                self._target = rate + self._step * RECOVER_SECONDS
            self.rate = None if rate >= self._release else rate


#: Scopes whose adaptive limiter is kept while none is engaged; past it, idle ones go.
MAX_SCOPES = 4096

_limiters: dict[tuple[str, float], RateLimiter] = {}
_adaptive: dict[tuple[str, float | None], AdaptiveRate] = {}
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


def adaptive_limiter(scope: str, ceiling: float | None = None) -> AdaptiveRate:
    """The process-wide adaptive limiter of ``scope``, never above ``ceiling``.

    Found without a lock once it exists: this is on every request's path.
    """
    key = (scope, ceiling)
    limiter = _adaptive.get(key)
    if limiter is None:
        with _limiters_lock:
            limiter = _adaptive.get(key)
            if limiter is None:
                if len(_adaptive) >= MAX_SCOPES:
                    for idle in [k for k, v in _adaptive.items() if v.rate is None]:
                        del _adaptive[idle]
                limiter = _adaptive[key] = AdaptiveRate(ceiling)
    return limiter


def _reset_after_fork() -> None:
    global _limiters_lock
    _limiters.clear()
    _adaptive.clear()
    _limiters_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


#: A URL in an error's text (trailing punctuation left out).
_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s\"'<>]*[^\s\"'<>.,:;)]", re.IGNORECASE)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (each once)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)


def _endpoint_of(exc: BaseException) -> str | None:
    """The ``scheme://host:port`` a failed connection was made to, if the error says."""
    for e in _chain(exc):
        kwargs = getattr(e, "kwargs", None)  # botocore's errors keep their fields here
        url = kwargs.get("endpoint_url") if isinstance(kwargs, dict) else None
        if isinstance(url, str) and "://" in url:
            parts = urlsplit(url)
            return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
    for e in _chain(exc):
        for found in _URL.findall(str(e)):
            parts = urlsplit(found)
            if parts.scheme.lower() in ("http", "https") and parts.netloc:
                return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
    return None


def refused_endpoint(exc: BaseException) -> str | None:
    """For a failure to connect because nothing listens there (``ECONNREFUSED``), the
    endpoint (``scheme://host:port``; ``"the endpoint"`` when the error does not say
    which); None for any other failure."""
    if not any(isinstance(e, ConnectionRefusedError) for e in _chain(exc)):
        return None
    return _endpoint_of(exc) or "the endpoint"


def retry_cause(exc: BaseException) -> str:
    """A short, safe cause for a retry message: "connection refused", or the error's
    text with every URL shown without its query string and secrets masked."""
    if refused_endpoint(exc) is not None:
        return "connection refused"
    return _shown(str(exc).strip() or type(exc).__name__)


def _shown(text: str) -> str:
    """``text`` for a log line: URLs without query strings, secrets masked."""
    return redact_text(_URL.sub(lambda m: display_url(m.group(0)), text))


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
    #: Slow a key prefix down when the store throttles it (:class:`AdaptiveRate`), never
    #: above ``requests_per_second``.
    adaptive_rate: bool = True
    #: Attempts in all (never more than ``max_attempts``) once one finds nothing
    #: listening (a refused connection): a wrong endpoint or a stopped server rarely
    #: starts to listen within a backoff.
    connect_attempts: int = 3
    #: Seconds from the first attempt after which a refused connection is not retried.
    connect_budget: float = 5.0
    #: Seconds one attempt of a small request (a HEAD, a listing page, a delete...) may
    #: take in all, its answer's body included, before it is abandoned and retried: the
    #: socket's stall timeout restarts at each byte, so a server trickling the answer
    #: would otherwise hold it for ever. ``None``: no bound but the socket's.
    small_attempt_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts={self.max_attempts} must be at least 1")
        if self.connect_attempts < 1:
            raise ConfigError(f"connect_attempts={self.connect_attempts} must be at least 1")

    @classmethod
    def from_options(cls, options: TransferOptions) -> RetryPolicy:
        """The policy of a :class:`~cloudckpt.options.TransferOptions`."""
        return cls(
            max_attempts=options.max_attempts,
            backoff_base=options.backoff_base,
            backoff_max=options.backoff_max,
            requests_per_second=options.requests_per_second,
            adaptive_rate=options.adaptive_rate,
            # Connecting, then the stall timeout twice over for the answer to arrive whole.
            small_attempt_seconds=options.connect_timeout
            + 2 * min(options.metadata_timeout, options.request_timeout),
        )

    @staticmethod
    def _bounded(fn: Callable[[], T], what: str, seconds: float) -> T:
        """One attempt, not waited for past ``seconds`` (nor the operation's deadline):
        then a :class:`~cloudckpt.errors.TransientError`, the attempt left to end on its
        own in its daemon thread (a small answer: it writes into no caller's buffer)."""
        deadline = current_deadline()
        if deadline is not None and deadline.remaining() <= seconds:
            return call_within(fn, deadline, what)  # the operation's deadline comes first
        mine = Deadline(seconds, time.monotonic() + seconds)
        try:
            return call_within(fn, mine, what)
        except DeadlineExceededError:
            raise TransientError(
                f"{what}: not answered in full within {seconds:g} s (connect_timeout + 2 x "
                "metadata_timeout); abandoned"
            ) from None

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (full jitter, capped)."""
        # The exponent is capped first: 2**attempt alone overflows a float at 1024.
        growth = 2.0 ** min(attempt, 64)
        return _JITTER.uniform(0, min(self.backoff_max, self.backoff_base * growth))

    def run(self, fn: Callable[[], T], what: str, *, scope: str = "", small: bool = False) -> T:
        """Run ``fn`` until it succeeds, retrying transient faults with jittered backoff.

        ``what`` names the request in errors ("put s3://b/k"); ``scope`` selects the
        rate limiters; ``small``: a request with a small answer, each attempt bounded by
        ``small_attempt_seconds``. Non-transient errors pass through at once.
        """
        limiter = rate_limiter(scope, self.requests_per_second)
        adaptive = adaptive_limiter(scope, self.requests_per_second) if self.adaptive_rate else None
        cancel = current_cancel()
        attempt = 0
        started = time.monotonic()
        while True:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            if limiter is not None:
                limiter.acquire(cancel)
            stamp = adaptive.acquire(cancel) if adaptive is not None else 0
            try:
                # A transfer group's request is bounded by the group's wait; any other one
                # (a HEAD, a listing, a small read its caller waits for) by the deadline.
                if cancel is not None:
                    result = fn()
                elif small and self.small_attempt_seconds is not None:
                    result = self._bounded(fn, what, self.small_attempt_seconds)
                else:
                    result = call_within(fn, current_deadline(), what)
            except TransientError as exc:
                if adaptive is not None and isinstance(exc, ThrottledError):
                    adaptive.throttled(stamp)
                attempt += 1
                endpoint = refused_endpoint(exc)
                limit = self.max_attempts
                delay = self.delay(attempt)
                if endpoint is not None:  # nothing listens there: a short budget
                    limit = min(limit, self.connect_attempts)
                    spent = time.monotonic() - started
                    if attempt < limit and spent + delay > self.connect_budget:
                        limit = attempt
                    if attempt >= limit:
                        raise RetriesExhaustedError(
                            f"{what} failed: cannot connect to {endpoint}: connection "
                            f"refused ({attempt} attempt(s) in {spent:.1f} s; is the endpoint "
                            "right and its server running?)"
                        ) from exc
                if attempt >= limit:
                    raise RetriesExhaustedError(
                        f"{what} failed after {attempt} attempts; last error: {exc}"
                    ) from exc
                deadline = current_deadline()
                if deadline is not None and deadline.remaining() <= delay:
                    raise DeadlineExceededError(
                        f"{what} not retried: the operation's {deadline.seconds:g} s deadline "
                        f"passes first (after {attempt} attempt(s); last error: {exc})"
                    ) from exc
                log.warning(
                    "retrying %s in %.1f s (attempt %d of %d): %s",
                    _shown(what),
                    delay,
                    attempt + 1,
                    limit,
                    retry_cause(exc),
                )
                try:
                    _wait(delay, cancel)
                except Cancelled:
                    raise Cancelled() from exc
            else:
                if adaptive is not None:
                    adaptive.succeeded()
                return result

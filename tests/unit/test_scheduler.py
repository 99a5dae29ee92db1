"""The scheduler (concurrency caps, cancellation, byte budget) and the store's retry policy."""

from __future__ import annotations

import threading

import pytest

from cloudckpt.errors import AccessDeniedError, RetriesExhaustedError, TransientError
from cloudckpt.io.scheduler import ByteBudget, Cancelled, TransferGroup
from cloudckpt.options import TransferOptions
from cloudckpt.store.retry import RetryPolicy

FAST = TransferOptions(backoff_base=0.001, backoff_max=0.002, max_attempts=4)
POLICY = RetryPolicy.from_options(FAST)


def call_with_retries(fn, options, what):
    return RetryPolicy.from_options(options).run(fn, what)


def test_transient_errors_are_retried_until_success():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("503 SlowDown")
        return "ok"

    assert call_with_retries(flaky, FAST, "put x") == "ok"
    assert len(calls) == 3


def test_retries_stop_at_max_attempts_with_a_typed_error():
    calls = []

    def always():
        calls.append(1)
        raise TransientError("503 SlowDown")

    with pytest.raises(RetriesExhaustedError, match="put s3://b/k failed after 4 attempts"):
        call_with_retries(always, FAST, "put s3://b/k")
    assert len(calls) == 4


def test_permanent_errors_are_not_retried():
    calls = []

    def denied():
        calls.append(1)
        raise AccessDeniedError("access denied")

    with pytest.raises(AccessDeniedError):
        call_with_retries(denied, FAST, "get")
    assert len(calls) == 1


def test_group_never_runs_more_than_its_limit():
    limit = 3
    running = 0
    peak = 0
    lock = threading.Lock()
    release = threading.Event()
    started = threading.Semaphore(0)

    def task():
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        started.release()
        release.wait(10)
        with lock:
            running -= 1

    group = TransferGroup(FAST, limit)
    submitter = threading.Thread(target=lambda: [group.submit(task, "t") for _ in range(10)])
    submitter.start()
    for _ in range(limit):
        assert started.acquire(timeout=10)
    # The submitter is now blocked: the group is full.
    assert not started.acquire(timeout=0.2)
    release.set()
    submitter.join(10)
    group.wait()
    assert peak == limit


def test_group_reports_first_error_and_stops_submitting():
    group = TransferGroup(FAST, 2)

    def boom():
        raise AccessDeniedError("denied")

    group.submit(boom, "t").exception(timeout=10)
    with pytest.raises(AccessDeniedError):
        group.submit(lambda: None, "t2")
    with pytest.raises(AccessDeniedError):
        group.wait()


def test_byte_budget_blocks_until_released():
    budget = ByteBudget(100)
    budget.acquire(60)
    got = threading.Event()
    t = threading.Thread(target=lambda: (budget.acquire(60), got.set()))
    t.start()
    assert not got.wait(0.2)
    budget.release(60)
    assert got.wait(10)
    t.join()
    assert budget.used == 60


def test_byte_budget_lets_an_oversized_request_run_alone():
    budget = ByteBudget(10)
    budget.acquire(50)  # would deadlock if it waited for room that can never exist
    assert budget.used == 50


def test_cancelling_a_group_ends_a_retry_wait():
    slow = RetryPolicy(max_attempts=5, backoff_base=30.0, backoff_max=30.0)
    group = TransferGroup(FAST, 1)
    attempts = threading.Semaphore(0)

    def always():
        attempts.release()
        raise TransientError("503 SlowDown")

    future = group.submit(lambda: slow.run(always, "put x"), "t")
    assert attempts.acquire(timeout=10)  # now waiting up to 30 s before the next attempt
    group.cancel()  # returns once the request ended: the wait did not run its course
    assert isinstance(future.exception(timeout=0), Cancelled)

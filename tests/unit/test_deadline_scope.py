"""One deadline per operation (store/deadline.py): retries, transfer groups, the cleanup
after a failure and the I/O threads all read the operation's expiry."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from cloudckpt.errors import DeadlineExceededError, RetriesExhaustedError, TransientError
from cloudckpt.io.scheduler import TransferGroup, run_cleanup
from cloudckpt.options import TransferOptions
from cloudckpt.store import RetryPolicy
from cloudckpt.store.deadline import (
    CLEANUP_GRACE,
    cleanup_scope,
    current_deadline,
    deadline_scope,
)
from cloudckpt.store.memory import MemoryStore
from faults import FaultyStore

OPTIONS = TransferOptions()


def _failing(store: FaultyStore, name: str) -> None:
    store.faults[name] = lambda n: TransientError(f"injected {name} #{n}")


def test_scopes_nest_to_the_earlier_expiry() -> None:
    assert current_deadline() is None
    with deadline_scope(100.0) as outer:
        assert outer is not None and current_deadline() is outer
        with deadline_scope(1000.0) as inner:  # a later one does not extend the outer
            assert inner is outer
        with deadline_scope(10.0) as inner:
            assert inner is not None and inner.expires < outer.expires
        with deadline_scope(None) as same:
            assert same is outer
    assert current_deadline() is None


def test_a_retry_that_cannot_start_before_the_deadline_is_not_made() -> None:
    store = FaultyStore(MemoryStore("deadline-retry")).with_retry(
        RetryPolicy(max_attempts=50, backoff_base=30.0, backoff_max=30.0)
    )
    _failing(store, "put")
    with deadline_scope(0.5), pytest.raises(DeadlineExceededError) as info:
        store.put("k", b"x")
    assert "put" in str(info.value) and "0.5 s deadline" in str(info.value)
    # Backoff delays are drawn from [0, 30 s]; a delay that fits would have been waited
    # out, so at most a few attempts run, never the 50 the policy allows.
    assert 1 <= store.calls["put"] < 50


def test_without_a_deadline_retries_run_to_the_policys_end() -> None:
    store = FaultyStore(MemoryStore("deadline-none")).with_retry(
        RetryPolicy(max_attempts=3, backoff_base=0.001, backoff_max=0.001)
    )
    _failing(store, "put")
    with pytest.raises(RetriesExhaustedError):
        store.put("k", b"x")
    assert store.calls["put"] == 3


def test_a_group_made_inside_a_scope_takes_its_expiry_into_its_threads() -> None:
    seen: list[Any] = []
    with deadline_scope(60.0) as scope:
        group = TransferGroup(OPTIONS, 2)
        assert group.deadline == 60.0
        group.submit(lambda: seen.append(current_deadline()), "probe")
        group.wait()
    assert seen == [scope]
    assert TransferGroup(OPTIONS, 2).deadline is None
    with deadline_scope(60.0):
        assert TransferGroup(OPTIONS, 2, deadline=5.0).deadline == 5.0  # the earlier wins


def test_a_group_stops_waiting_at_the_operations_deadline() -> None:
    release = threading.Event()
    try:
        with deadline_scope(0.3):
            group = TransferGroup(OPTIONS, 2)
            group.submit(release.wait, "stuck request")
            with pytest.raises(DeadlineExceededError, match="stuck request"):
                group.wait()
        group.cancel()  # does not wait for the stuck request past the grace
    finally:
        release.set()


def test_cleanup_gets_the_grace_and_no_more() -> None:
    with deadline_scope(0.01) as scope:
        assert scope is not None
        with cleanup_scope() as grace:
            assert grace is not None
            assert grace.expires >= scope.expires + CLEANUP_GRACE - 0.05
            assert grace.remaining() <= CLEANUP_GRACE + scope.seconds
    with cleanup_scope() as none:
        assert none is None


def test_a_stuck_cleanup_is_abandoned_at_the_grace() -> None:
    release = threading.Event()
    try:
        # run_cleanup waits CLEANUP_GRACE seconds at most for a stuck request
        with deadline_scope(0.01), pytest.raises(DeadlineExceededError, match="abort upload"):
            run_cleanup(OPTIONS, release.wait, "abort upload")
    finally:
        release.set()


def test_the_process_exits_without_waiting_for_an_abandoned_request() -> None:
    """The I/O threads are daemons: a request stuck past its operation's deadline (here
    forever) does not hold up the interpreter's exit."""
    code = textwrap.dedent(
        """
        import threading
        from cloudckpt.errors import DeadlineExceededError
        from cloudckpt.io.scheduler import TransferGroup
        from cloudckpt.options import TransferOptions
        from cloudckpt.store.deadline import deadline_scope

        with deadline_scope(0.2):
            group = TransferGroup(TransferOptions(), 1)
            group.submit(threading.Event().wait, "stuck forever")
            try:
                group.wait()
            except DeadlineExceededError:
                print("deadline", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "deadline"

"""The drain thread's queue (cloudckpt.engine.drain.Drainer): a key saved again while
its drain runs is drained again; merged submits, and unmerged ones for collective work."""

from __future__ import annotations

import threading

import pytest

from cloudckpt.engine.drain import Drainer

WAIT = 30


def _drain_with_the_first_held(merge: bool) -> list[str]:
    """Submit ``last.ckpt`` three times, the second and third while its first drain
    runs (the file saved again meanwhile); what the work ran, in order."""
    ran: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def work(key: str) -> None:
        ran.append(key)
        if len(ran) == 1:
            entered.set()
            assert release.wait(WAIT)

    drainer: Drainer[str] = Drainer(work, "/local", "s3://b/run", noun="file", merge=merge)
    drainer.submit("last.ckpt")
    assert entered.wait(WAIT)
    assert drainer.unfinished() == {"last.ckpt"}
    drainer.submit("last.ckpt")  # saved again while its first drain runs
    drainer.submit("last.ckpt")
    release.set()
    assert drainer.wait(WAIT) == {}
    assert drainer.unfinished() == set()
    return ran


def test_a_key_submitted_while_it_drains_is_drained_again_once() -> None:
    # Before, a submit during the key's own drain was dropped: the newer file stayed
    # local with nothing queued to send it.
    assert _drain_with_the_first_held(merge=True) == ["last.ckpt", "last.ckpt"]


def test_unmerged_every_submit_is_drained() -> None:
    # Collective drains: every rank runs every submit, whatever its queue held.
    assert _drain_with_the_first_held(merge=False) == ["last.ckpt"] * 3


def test_a_failed_key_is_kept_until_submitted_again() -> None:
    calls: list[str] = []

    def work(key: str) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise OSError("the bucket went away")

    drainer: Drainer[str] = Drainer(work, "/local", "s3://b/run", noun="file")
    drainer.submit("a.ckpt")
    failed = drainer.wait(WAIT)
    assert list(failed) == ["a.ckpt"] and "the bucket went away" in str(failed["a.ckpt"])
    assert drainer.unfinished() == {"a.ckpt"}
    drainer.retry_failed()
    assert drainer.wait(WAIT) == {} and calls == ["a.ckpt", "a.ckpt"]
    with pytest.raises(TimeoutError, match="did not finish"):
        hold = threading.Event()
        slow: Drainer[str] = Drainer(lambda k: hold.wait(WAIT), "/l", "s3://b/r", noun="file")
        slow.submit("b.ckpt")
        try:
            slow.wait(0.05)
        finally:
            hold.set()


def test_a_key_discarded_while_it_drains_is_neither_failed_nor_drained_again() -> None:
    """A checkpoint deleted during its drain: the delete waits for that drain to end
    (else a drain past its uploads commits the step after the delete removed it), the
    drain's failure is not kept (before, every later wait() reported it and every retry
    ran it again)."""
    ran: list[int] = []
    order: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def work(step: int) -> None:
        ran.append(step)
        if step == 5:
            entered.set()
            assert release.wait(WAIT)
            order.append("drain of 5 ended")
            raise FileNotFoundError("step 5 is not committed in the local tier")

    drainer: Drainer[int] = Drainer(work, "/local", "s3://b/run")
    drainer.submit(5)
    assert entered.wait(WAIT)
    drainer.submit(6)

    def delete() -> None:
        drainer.discard(5)  # deleted meanwhile
        order.append("discard returned")

    deleting = threading.Thread(target=delete)
    deleting.start()
    deleting.join(0.5)  # before: discard had returned by now
    assert order == [] and deleting.is_alive()  # it waits for the drain under way
    release.set()
    deleting.join(WAIT)
    assert order == ["drain of 5 ended", "discard returned"]
    assert drainer.wait(WAIT) == {}
    drainer.retry_failed()
    assert drainer.wait(WAIT) == {}
    assert ran == [5, 6]
    assert drainer.unfinished() == set()

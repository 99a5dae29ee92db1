"""The collectives (cloudckpt.ranks.collectives) on real gloo ranks, and alone.

Each multi-rank test forks 2 or 3 ranks (tests/ranks.py) and checks, on every rank,
what that rank got: the first rank's result, the first rank's error, or the error
naming the rank that failed.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.distributed as dist

from cloudckpt.errors import (
    CollectiveError,
    DistributedLoadError,
    DistributedSaveError,
    NotFoundError,
    StorageError,
)
from cloudckpt.ranks.collectives import (
    agree,
    barrier,
    first_rank,
    is_distributed,
    on_first,
    rank,
    settle,
    world_size,
)
from ranks import run_ranks


class _PicklesButWontUnpickle(Exception):
    """An error whose ``__init__`` takes other arguments than its ``args``: pickling it
    works, unpickling it fails, so it cannot travel to another rank as itself."""

    def __init__(self, path: str, code: int) -> None:
        super().__init__(f"{path} failed with {code}")


# -- on_first ------------------------------------------------------------------------------
def _result_reaches_every_rank(me: int, world: int) -> None:
    ran: list[int] = []

    def fn() -> dict[str, Any]:
        ran.append(rank())
        return {"from": rank(), "items": [1, 2, 3]}

    got = on_first(fn)
    assert got == {"from": 0, "items": [1, 2, 3]}, (me, got)
    assert ran == ([0] if me == 0 else []), (me, ran)  # only the first rank ran it
    assert (is_distributed(), rank(), world_size()) == (True, me, world)

    # On a group, its first rank acts: here global rank 1 of the group {1, 2}.
    group = dist.new_group([1, 2], backend="gloo")
    if me in (1, 2):
        assert first_rank(group) == 1
        assert on_first(lambda: f"from rank {rank()}", group) == "from rank 1"
    barrier()


def _errors_reach_every_rank(me: int, world: int) -> None:
    # An error that pickles: every rank raises it as itself, its type kept.
    def missing() -> None:
        raise NotFoundError("s3://b/run/step-1 is missing")

    with pytest.raises(NotFoundError, match="step-1 is missing") as info:
        on_first(missing, what="the listing of s3://b/run")
    if me != 0:  # received: a note names where it was raised
        assert any("raised on rank 0" in n for n in getattr(info.value, "__notes__", []))

    # An error that does not survive pickling: the others get its text, naming rank 0.
    def odd() -> None:
        raise _PicklesButWontUnpickle("s3://b/x", 7)

    expected: Any = _PicklesButWontUnpickle if me == 0 else DistributedSaveError
    with pytest.raises(expected) as caught:
        on_first(odd, what="the commit of s3://b/x", error_type=DistributedSaveError)
    if me != 0:
        error = caught.value
        assert isinstance(error, CollectiveError) and error.failures.keys() == {0}
        assert "rank 0: _PicklesButWontUnpickle: s3://b/x failed with 7" in str(error)
        assert "the commit of s3://b/x failed" in str(error)

    # A result that cannot be sent fails every rank instead of leaving them waiting.
    with pytest.raises(Exception, match=r"pickle|lambda"):
        on_first(lambda: lambda: None)


def test_on_first_delivers_the_result_to_every_rank() -> None:
    run_ranks(_result_reaches_every_rank, 3, timeout=120)


def test_on_first_delivers_the_first_rank_s_error_to_every_rank() -> None:
    run_ranks(_errors_reach_every_rank, 2, timeout=120)


# -- agree, settle -------------------------------------------------------------------------
def _rank_one_fails(me: int, world: int) -> None:
    mine = StorageError(f"injected on rank {me}") if me == 1 else None

    # agree: every rank learns the same, and nothing is raised.
    agreement = agree(mine, value=("s3://b/k", me))
    assert not agreement.ok, me
    assert agreement.failures == {1: "StorageError: injected on rank 1"}, me
    assert agreement.values == (("s3://b/k", 0), ("s3://b/k", 1), ("s3://b/k", 2))
    assert not agreement.unanimous
    assert agree(value="same").unanimous and agree().ok

    # settle: every rank raises; rank 1 its own error, the others one naming rank 1.
    with pytest.raises((StorageError, DistributedLoadError)) as info:
        settle(mine, "the shared load of s3://b/k", error_type=DistributedLoadError)
    if me == 1:
        assert info.value is mine
    else:
        error = info.value
        assert isinstance(error, DistributedLoadError) and isinstance(error, CollectiveError)
        assert error.failures == {1: "StorageError: injected on rank 1"}
        assert str(error) == (
            "the shared load of s3://b/k failed (rank 1: StorageError: injected on rank 1)"
        )

    # A rank whose value does not pickle counts as failed; no rank waits for it.
    odd = agree(value=(lambda: None) if me == 2 else "fine")
    assert odd.failures.keys() == {2} and "does not pickle" in odd.failures[2]

    settle(None, "a step every rank passed")  # nobody failed: nobody raises


def _two_ranks_fail_in_a_group(me: int, world: int) -> None:
    group = dist.new_group([0, 2], backend="gloo")
    if me == 1:
        return  # not in the group: takes no part
    mine = OSError(f"disk full on rank {me}") if me == 2 else None
    agreement = agree(mine, group=group)
    assert agreement.failures == {2: "OSError: disk full on rank 2"}  # global ranks
    with pytest.raises((OSError, DistributedSaveError)) as info:
        settle(mine, "save to s3://b/c", group=group, error_type=DistributedSaveError)
    if me == 0:
        assert isinstance(info.value, DistributedSaveError)
        assert str(info.value) == (
            "save to s3://b/c failed (rank 2: OSError: disk full on rank 2); nothing committed"
        )
    else:
        assert info.value is mine

    # Two ranks fail: both named, on every rank that did not.
    both = agree(RuntimeError(f"boom {me}"), group=group)
    assert both.failures == {0: "RuntimeError: boom 0", 2: "RuntimeError: boom 2"}


def test_an_error_on_rank_1_raises_on_every_rank_naming_rank_1() -> None:
    run_ranks(_rank_one_fails, 3, timeout=120)


def test_agree_and_settle_on_a_group_name_global_ranks() -> None:
    run_ranks(_two_ranks_fail_in_a_group, 3, timeout=120)


# -- alone -------------------------------------------------------------------------------
def test_without_a_process_group_each_is_a_local_call() -> None:
    assert not dist.is_initialized()
    assert (is_distributed(), rank(), world_size(), first_rank()) == (False, 0, 1, 0)
    assert on_first(lambda: 42) == 42
    with pytest.raises(NotFoundError, match="gone"):
        on_first(lambda: (_ for _ in ()).throw(NotFoundError("gone")))
    barrier()
    assert agree(value=1).ok and agree(value=1).unanimous
    failed = agree(StorageError("bad"))
    assert not failed.ok and failed.failures == {0: "StorageError: bad"}
    error = StorageError("alone")
    with pytest.raises(StorageError) as info:
        settle(error, "a load")
    assert info.value is error
    settle(None, "a load")


def test_collective_errors_keep_their_failures_across_pickling() -> None:
    error = DistributedSaveError.of("save to s3://b/c", {3: "OSError: x", 1: "ValueError: y"})
    assert str(error) == (
        "save to s3://b/c failed (rank 1: ValueError: y; rank 3: OSError: x); nothing committed"
    )
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is DistributedSaveError and back.failures == error.failures
    assert str(back) == str(error)
    assert issubclass(DistributedLoadError, CollectiveError)
    assert issubclass(CollectiveError, RuntimeError)


# -- the groups they run on -------------------------------------------------------------------
def _runs_on_cloudckpt_s_groups(me: int, world: int) -> None:
    import threading

    from cloudckpt.ranks import groups

    used: list[Any] = []
    calls = {
        name: getattr(dist, name)
        for name in ("all_gather_object", "broadcast_object_list", "barrier")
    }

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            used.append(kwargs.get("group"))
            return calls[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(dist, name, spy(name))
    try:
        on_first(lambda: 1)
        agree(value=me)
        barrier()
        training = dist.new_group(backend="gloo")  # the program's group of every rank
        on_first(lambda: 2, training)
        drain = groups.drain_group()
        settle(None, "a drain's step", group=drain)
        pair = dist.new_group([0, 1], backend="gloo")  # the program's group of some ranks
        if me in (0, 1):
            agree(value=me, group=pair)
    finally:
        for name, fn in calls.items():
            setattr(dist, name, fn)
    caller = groups.dedicated()
    assert caller not in (None, dist.group.WORLD, training)
    expected = [caller] * 4 + [drain] + ([pair] if me in (0, 1) else [])
    assert used == expected, me  # a group cloudckpt made is used as itself

    # At exit the groups are destroyed, the program's default group left alone; while a
    # background thread that runs collectives lives, they are left as they are.
    release = threading.Event()
    busy = threading.Thread(target=release.wait)
    busy.start()
    groups.runs_collectives(busy)
    groups._destroy_at_exit()
    assert dist.get_process_group_ranks(caller) == list(range(world))
    assert on_first(lambda: "still here") == "still here"
    release.set()
    busy.join()
    groups._destroy_at_exit()
    for made in (caller, drain):
        with pytest.raises((KeyError, ValueError)):  # torch no longer knows the group
            dist.get_process_group_ranks(made)
    assert dist.is_initialized()
    assert dist.get_process_group_ranks(training) == list(range(world))
    assert on_first(lambda: "on a new group") == "on a new group"
    assert groups.dedicated() is not caller


def test_collectives_run_on_cloudckpt_s_own_groups_destroyed_at_exit() -> None:
    run_ranks(_runs_on_cloudckpt_s_groups, 3, timeout=120)


def _a_rank_dies(rank: int, world: int, results: Any, step: str) -> None:
    """After one collective together (cloudckpt's own group is made), rank 1's process
    leaves, as a killed one would (no error sent); rank 0 reaches ``step``'s collective
    and reports what it raised. Each ends with _exit: the launcher's closing barrier
    cannot run without the dead rank."""
    import os

    settle(None, "the save of step 4")
    if rank == 1:
        os._exit(0)
    try:
        if step == "settle":
            settle(None, "the upload of step 4", error_type=DistributedSaveError)
        elif step == "on_first":
            on_first(lambda: 1, what="the commit of step 4", error_type=DistributedSaveError)
        else:
            barrier(what="the barrier before the commit of step 4")
        results.put(("returned", ""))
    except BaseException as exc:
        results.put((type(exc).__name__, str(exc)))
    os._exit(0)


@pytest.mark.parametrize("step", ["settle", "on_first", "barrier"])
def test_a_rank_that_died_is_a_typed_error_naming_the_step(step: str) -> None:
    import multiprocessing

    results = multiprocessing.get_context("fork").SimpleQueue()
    run_ranks(_a_rank_dies, 2, results, step, timeout=120)
    name, text = results.get()
    assert name == ("CollectiveError" if step == "barrier" else "DistributedSaveError"), text
    assert "step 4 failed: the collective with the other ranks broke off" in text, text
    assert "may have died" in text

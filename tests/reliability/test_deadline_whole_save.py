"""``deadline=`` bounds every request of a manager's save and of a DCP save or load, not
only the payload's transfers: a manager save's check that the step is new, its commit
marker and its retention; ``async_save``'s checks on the caller's thread; a DCP save's
removal of an earlier ``.metadata`` (``prepare_global_plan``); a DCP load's two marker
reads (``.metadata``, then the per-rank one torch falls back to) under one deadline.

Against a server that accepts connections and never answers (the default 120 s
``request_timeout`` left as it is), or a store whose marker PUT never returns, each
raises ``DeadlineExceededError`` naming the request soon after the deadline; before,
a manager save against a silent endpoint took minutes (158 s with ``deadline=6``).
The style is tests/reliability/test_deadline_every_request.py's: each operation runs in
a daemon thread joined for at most ``silent.BOUND`` seconds.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cloudckpt
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import DeadlineExceededError
from cloudckpt.store import memory
from dcp_compat import SINGLE
from faults import FaultyStore
from silent import DEADLINE, SilentServer, run_bounded


def _deadline_error(error: BaseException | None, url: str) -> str:
    """The message of ``error``: a DeadlineExceededError (or DCP's wrapping of one)
    naming ``url``."""
    assert isinstance(error, (DeadlineExceededError, CheckpointException)), repr(error)
    message = str(error)
    assert url in message and "deadline" in message, message
    if isinstance(error, CheckpointException):
        assert "DeadlineExceededError" in message or "deadline" in message, message
    return message


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32)}


# -- CheckpointManager ------------------------------------------------------------------------


def test_a_manager_save_against_a_silent_store_isrun_bounded(silent: SilentServer) -> None:
    """Its first request, the read of the step's marker (is it committed already?),
    gets no answer: the save raises at the deadline."""
    manager = cloudckpt.CheckpointManager(
        "s3://silent-msave/run", storage_options=silent.storage_options(), deadline=DEADLINE
    )
    error, _ = run_bounded(lambda: manager.save(1, _state()))
    _deadline_error(error, "s3://silent-msave/run")
    assert silent.requests


def _stalled_marker_manager(bucket: str, keep_last: int | None = None) -> tuple[Any, Any]:
    """A manager on an in-memory bucket whose marker PUTs never return (the payload,
    written through its URL, gets through); the event that releases them."""
    memory.clear(bucket)
    manager = cloudckpt.CheckpointManager(f"memory://{bucket}/run", deadline=DEADLINE)
    store = FaultyStore(manager.store)
    release = threading.Event()
    store.faults["put"] = lambda n: release.wait(60) and None
    manager.store = store
    return manager, release


def test_a_manager_save_whose_commit_stalls_isrun_bounded() -> None:
    manager, release = _stalled_marker_manager("deadline-mcommit")
    try:
        error, _ = run_bounded(lambda: manager.save(1, _state()))
        message = _deadline_error(
            error, "memory://deadline-mcommit/run/step-000000001/_CHECKPOINT.json"
        )
        assert "put" in message, message
        assert manager.list() == []  # nothing committed
    finally:
        release.set()


def test_a_manager_async_save_does_not_hold_its_caller_past_the_deadline(
    silent: SilentServer,
) -> None:
    """The checks before the write run on the caller's thread: bounded by the deadline
    (the call raises), or the handle's (the call returns, its result raises)."""
    manager = cloudckpt.CheckpointManager(
        "s3://silent-masync/run", storage_options=silent.storage_options(), deadline=DEADLINE
    )
    box: dict[str, Any] = {}
    error, _ = run_bounded(lambda: box.setdefault("handle", manager.async_save(1, _state())))
    if error is None:
        error, _ = run_bounded(box["handle"].result)
    _deadline_error(error, "s3://silent-masync/run")


def test_a_manager_async_save_whose_commit_stalls_isrun_bounded() -> None:
    """The handle's commit (the marker PUT, in the save's thread) ends at the deadline
    the call started."""
    manager, release = _stalled_marker_manager("deadline-macommit")
    try:
        handle = manager.async_save(1, _state())
        error, _ = run_bounded(handle.result)
        _deadline_error(error, "memory://deadline-macommit/run/step-000000001/_CHECKPOINT.json")
    finally:
        release.set()


# -- DCP --------------------------------------------------------------------------------------


def test_a_dcp_save_s_marker_removal_isrun_bounded(silent: SilentServer) -> None:
    """``prepare_global_plan`` removes an earlier ``.metadata`` before any data is
    written: that request, with no answer, ends at the deadline the save started."""
    url = "s3://silent-dcp/run/step-1"
    writer = CloudStorageWriter(url, storage_options=silent.storage_options(), deadline=DEADLINE)
    error, _ = run_bounded(lambda: dcp.save(_state(), storage_writer=writer, **SINGLE))
    _deadline_error(error, url)


def test_a_dcp_async_save_s_marker_removal_isrun_bounded(silent: SilentServer) -> None:
    if not hasattr(dcp, "async_save"):
        pytest.skip("no dcp.async_save in this torch")
    url = "s3://silent-dcpa/run/step-1"
    writer = CloudStorageWriter(url, storage_options=silent.storage_options(), deadline=DEADLINE)
    box: dict[str, Any] = {}
    error, _ = run_bounded(
        lambda: box.setdefault("f", dcp.async_save(_state(), storage_writer=writer, **SINGLE))
    )
    if error is None:
        error, _ = run_bounded(box["f"].result)
    _deadline_error(error, url)


def test_a_dcp_load_s_metadata_reads_share_one_deadline(silent: SilentServer) -> None:
    """torch reads ``.metadata``, then (it failing) the per-rank marker: both within the
    one deadline the load started, not a fresh one each."""
    deadline = 4.0
    url = "s3://silent-dcpl/run/step-1"
    reader = CloudStorageReader(url, storage_options=silent.storage_options(), deadline=deadline)
    state = {"w": torch.zeros(1024)}
    error, seconds = run_bounded(
        lambda: dcp.load(state, storage_reader=reader, **SINGLE), 3 * deadline
    )
    assert error is not None
    assert url in str(error) and "deadline" in str(error), str(error)
    assert seconds < deadline + 2.5, seconds  # two fresh deadlines: 8 s and more


def test_a_dcp_reader_s_next_load_gets_a_deadline_of_its_own() -> None:
    """The deadline a load started ends with it: the same reader, used again (torch
    resets it only when given a checkpoint_id), starts another."""
    memory.clear("deadline-dcp-reuse")
    url = "memory://deadline-dcp-reuse/run/step-1"
    dcp.save(_state(), storage_writer=CloudStorageWriter(url), **SINGLE)
    reader = CloudStorageReader(url, deadline=1.0)
    for _ in range(2):
        state = {"w": torch.zeros(1024)}
        dcp.load(state, storage_reader=reader, **SINGLE)
        assert torch.equal(state["w"], _state()["w"])
        time.sleep(1.2)  # past the first load's deadline

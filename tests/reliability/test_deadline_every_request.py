"""``deadline=`` bounds every request of an operation, not only its data transfers: the
first HEAD of a load, its directory reads, a listing, a marker read, a copy's HEAD and
listing, a save's abort. Against a server on 127.0.0.1 that accepts connections and
never answers (the default 120 s ``request_timeout`` left as it is), each operation
raises ``DeadlineExceededError`` naming the URL soon after its deadline; before, a load
sat in its first HEAD until the socket's read timeout (120 s), whatever its deadline.

Each operation runs in a daemon thread joined for at most ``silent.BOUND`` seconds, so a test
fails there (not after minutes) when a request outlives the deadline. ``silent.BOUND`` is
generous (a busy machine); what it separates is seconds from minutes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.cli.main import main
from cloudckpt.errors import DeadlineExceededError
from cloudckpt.io.scheduler import TransferGroup
from cloudckpt.options import MiB, TransferOptions
from cloudckpt.store.deadline import CLEANUP_GRACE, Deadline, deadline_scope, within
from cloudckpt.store.memory import MemoryStore
from faults import FaultyStore
from silent import BOUND, CREDS, DEADLINE, SLACK, SilentServer, run_bounded


def _deadline_error(error: BaseException | None, url: str) -> str:
    assert isinstance(error, DeadlineExceededError), repr(error)
    message = str(error)
    assert url in message and "deadline" in message, message
    return message


#: A URL of each backend and its storage options pointing at a server's endpoint, with
#: the client library it needs.
BACKENDS = {
    "s3": ("s3://silent-load/run/c.pt", lambda ep: {"endpoint_url": ep, **CREDS}, "botocore"),
    "gs": (
        "gs://silent-load/run/c.pt",
        lambda ep: {"endpoint_url": ep, "anonymous": True},
        "google.auth",
    ),
    "az": (
        "az://silent-load/run/c.pt",
        lambda ep: {"account_url": f"{ep}/devstoreaccount1", "anonymous": True},
        "azure.storage.blob",
    ),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_load_s_first_head_isrun_bounded(silent: SilentServer, backend: str) -> None:
    url, options, module = BACKENDS[backend]
    pytest.importorskip(module)
    error, seconds = run_bounded(
        lambda: cloudckpt.load(url, storage_options=options(silent.url), deadline=DEADLINE)
    )
    message = _deadline_error(error, url)
    assert "head" in message
    assert seconds < BOUND
    assert silent.requests  # it got there, and no answer


def test_a_load_of_some_keys_isrun_bounded(silent: SilentServer) -> None:
    url = "s3://silent-keys/run/c.pt"
    error, _ = run_bounded(
        lambda: cloudckpt.load(
            url, keys=["model"], storage_options=silent.storage_options(), deadline=DEADLINE
        )
    )
    _deadline_error(error, url)


def test_a_load_s_directory_reads_arerun_bounded() -> None:
    """The HEAD is answered (a 64 MiB object); the first range read (the archive's tail,
    its directory) gets no answer."""
    server = SilentServer(answer_heads=64 * MiB)
    try:
        url = "s3://silent-tail/run/c.pt"
        error, _ = run_bounded(
            lambda: cloudckpt.load(url, storage_options=server.storage_options(), deadline=DEADLINE)
        )
        message = _deadline_error(error, url)
        assert "read" in message
        assert [line.split()[0] for line in server.requests][:2] == ["HEAD", "GET"]
    finally:
        server.close()


def test_a_copy_from_a_silent_bucket_isrun_bounded(
    silent: SilentServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "s3://silent-cp/run/c.pt"
    argv = [
        "cp", url, str(tmp_path / "c.pt"), "--deadline", f"{DEADLINE:g}s",
        "--endpoint-url", silent.url,
        "-o", f"aws_access_key_id={CREDS['aws_access_key_id']}",
        "-o", f"aws_secret_access_key={CREDS['aws_secret_access_key']}",
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    box: dict[str, int] = {}
    error, _ = run_bounded(lambda: box.setdefault("code", main(argv)))
    assert error is None
    assert box["code"] == 1
    err = capsys.readouterr().err
    assert url in err and "deadline" in err, err
    assert not (tmp_path / "c.pt").exists()


def test_a_recursive_copy_s_listing_isrun_bounded(
    silent: SilentServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "s3://silent-cpr/run/"
    argv = [
        "cp", "-r", url, str(tmp_path / "out") + "/", "--deadline", f"{DEADLINE:g}",
        "--endpoint-url", silent.url,
        "-o", f"aws_access_key_id={CREDS['aws_access_key_id']}",
        "-o", f"aws_secret_access_key={CREDS['aws_secret_access_key']}",
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    box: dict[str, int] = {}
    error, _ = run_bounded(lambda: box.setdefault("code", main(argv)))
    assert error is None
    assert box["code"] == 1
    err = capsys.readouterr().err
    assert "s3://silent-cpr/run" in err and "deadline" in err, err
    assert silent.requests and silent.requests[0].startswith("GET ")  # the listing


def test_a_manager_s_listing_and_marker_reads_arerun_bounded(silent: SilentServer) -> None:
    manager = cloudckpt.CheckpointManager(
        "s3://silent-mgr/run", storage_options=silent.storage_options(), deadline=DEADLINE
    )
    error, _ = run_bounded(manager.latest)
    _deadline_error(error, "s3://silent-mgr/run")
    error, _ = run_bounded(lambda: manager.info(7))
    _deadline_error(error, "s3://silent-mgr/run")


def test_a_save_whose_abort_meets_a_silent_store_isrun_bounded() -> None:
    """The upload starts, its parts and then its abort get no answer: the save raises
    within its deadline plus the cleanup's grace, naming the object."""
    server = SilentServer(answer_uploads=True)
    try:
        url = "s3://silent-save/run/c.pt"
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(4)}  # 12 MiB
        error, _ = run_bounded(
            lambda: cloudckpt.save(
                state,
                url,
                storage_options=server.storage_options(),
                part_size=5 * MiB,
                deadline=DEADLINE,
            ),
            BOUND + CLEANUP_GRACE,
        )
        _deadline_error(error, url)
        assert any(line.startswith("DELETE ") for line in server.requests)  # the abort
    finally:
        server.close()


# -- the store layer alone (no network) -------------------------------------------------------


def _stalling(name: str, bucket: str) -> tuple[FaultyStore, threading.Event, list[str]]:
    """A store whose ``name`` requests wait for the event (a request with no answer);
    the threads they ran in, by name."""
    store = FaultyStore(MemoryStore(bucket))
    release = threading.Event()
    threads: list[str] = []

    def stall(n: int) -> None:
        threads.append(threading.current_thread().name)
        release.wait(60)

    store.faults[name] = stall
    return store, release, threads


def test_a_request_with_no_answer_is_abandoned_at_the_deadline() -> None:
    store, release, _ = _stalling("head", "deadline-head")
    try:
        started = time.monotonic()
        with deadline_scope(0.5), pytest.raises(DeadlineExceededError) as info:
            store.head("run/c.pt")
        assert time.monotonic() - started < 0.5 + SLACK
        assert store.url("run/c.pt") in str(info.value)
        assert store.calls["head"] == 1  # abandoned, not retried
    finally:
        release.set()


def test_a_request_after_the_deadline_is_not_sent() -> None:
    store = FaultyStore(MemoryStore("deadline-passed"))
    with (
        within(Deadline(1.0, time.monotonic() - 1.0)),
        pytest.raises(DeadlineExceededError) as info,
    ):
        store.put("run/c.pt", b"x")
    assert "not sent" in str(info.value) and store.url("run/c.pt") in str(info.value)
    assert "put" not in store.calls


def test_requests_run_in_the_caller_s_thread_unless_a_deadline_needs_a_bound() -> None:
    """No deadline: the caller's thread; in a transfer group: the group's thread (the
    group bounds it); a deadline outside a group: a thread of its own."""
    store, release, threads = _stalling("get", "deadline-threads")
    release.set()
    store.inner.put("k", b"x")
    store.get("k")
    group = TransferGroup(TransferOptions(), 1)
    with deadline_scope(60.0):
        TransferGroup(TransferOptions(), 1).call(lambda: store.get("k"), "get")
        store.get("k")
    group.call(lambda: store.get("k"), "get")
    caller = threading.current_thread().name
    assert threads[0] == caller
    assert threads[1].startswith("cloudckpt-io")
    assert threads[2] == "cloudckpt-request"
    assert threads[3].startswith("cloudckpt-io")

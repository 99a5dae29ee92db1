"""``cp`` resumes after a failure: only the missing chunks or parts are transferred again.

FaultyStore puts a failure at a chosen request; the stores behind it are real (the
filesystem and moto, which enforces the 5 MiB minimum part size).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from cloudckpt.engine.copy import PARTIAL_SUFFIX, CopyState, copy_object
from cloudckpt.errors import DeadlineExceededError, StorageError
from cloudckpt.io.scheduler import TransferGroup
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import open_url
from faults import FaultyStore
from servers import S3Server


def fail_at(call: int) -> object:
    return lambda n: StorageError(f"injected failure at request {n}") if n == call else None


def test_download_resumes_from_the_partial_file(tmp_path: Path) -> None:
    opts = resolve_options(read_chunk_size=1 * MiB, read_concurrency=1, max_attempts=1)
    data = os.urandom(5 * MiB + 123)
    (tmp_path / "src.bin").write_bytes(data)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts)
    dst, dst_key = open_url(str(tmp_path / "dst.bin"), opts)
    faulty = FaultyStore(src)
    faulty.faults["read_into"] = fail_at(4)  # chunks 1-3 land, the 4th fails
    with pytest.raises(StorageError, match="injected"):
        copy_object(faulty, src_key, dst, dst_key, opts)
    assert not (tmp_path / "dst.bin").exists()  # nothing visible at the destination
    journal = json.loads((tmp_path / f"dst.bin{PARTIAL_SUFFIX}.json").read_text())
    assert journal["done"] == [0, 1, 2]

    again = FaultyStore(src)
    result = copy_object(again, src_key, dst, dst_key, opts)
    assert again.calls["read_into"] == 3  # chunks 3, 4 and 5 (the short tail) only
    assert result.resumed_bytes == 3 * MiB
    assert (tmp_path / "dst.bin").read_bytes() == data
    assert not list(tmp_path.glob(f"*{PARTIAL_SUFFIX}*"))


def test_download_starts_over_when_the_source_changed(tmp_path: Path) -> None:
    opts = resolve_options(read_chunk_size=1 * MiB, read_concurrency=1, max_attempts=1)
    (tmp_path / "src.bin").write_bytes(os.urandom(3 * MiB))
    src, src_key = open_url(str(tmp_path / "src.bin"), opts)
    dst, dst_key = open_url(str(tmp_path / "dst.bin"), opts)
    faulty = FaultyStore(src)
    faulty.faults["read_into"] = fail_at(2)
    with pytest.raises(StorageError):
        copy_object(faulty, src_key, dst, dst_key, opts)
    data = os.urandom(3 * MiB + 1)  # a new source: the journal no longer applies
    (tmp_path / "src.bin").write_bytes(data)
    result = copy_object(src, src_key, dst, dst_key, opts)
    assert result.resumed_bytes == 0
    assert (tmp_path / "dst.bin").read_bytes() == data


def test_upload_resumes_the_open_multipart_upload(moto_server: S3Server, tmp_path: Path) -> None:
    bucket = moto_server.make_bucket("cp-resume-upload")
    opts = resolve_options(
        part_size=5 * MiB,
        write_concurrency=1,
        max_attempts=1,
        storage_options=moto_server.storage_options(),
    )
    data = os.urandom(16 * MiB + 5)  # 4 parts: 5, 5, 5 MiB and the rest
    (tmp_path / "src.bin").write_bytes(data)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/copies/src.bin", opts)
    faulty = FaultyStore(dst)
    faulty.faults["upload_part"] = fail_at(3)
    state = tmp_path / "state"
    with pytest.raises(StorageError, match="injected"):
        copy_object(src, src_key, faulty, dst_key, opts, state_dir=state)
    uploads = list(dst.list_multipart("copies/"))
    assert len(uploads) == 1  # left open on purpose, to be resumed
    assert not list(dst.list("copies/"))

    again = FaultyStore(dst)
    result = copy_object(src, src_key, again, dst_key, opts, state_dir=state)
    assert again.calls["upload_part"] == 2  # parts 3 and 4 only
    assert "create_multipart" not in again.calls  # the same upload, continued
    assert result.resumed_bytes == 10 * MiB
    assert dst.get(dst_key) == data
    assert list(dst.list_multipart("copies/")) == []
    assert not list(state.iterdir())  # journal removed once complete


def test_upload_starts_over_when_the_upload_was_aborted(
    moto_server: S3Server, tmp_path: Path
) -> None:
    bucket = moto_server.make_bucket("cp-resume-aborted")
    opts = resolve_options(
        part_size=5 * MiB,
        write_concurrency=1,
        max_attempts=1,
        storage_options=moto_server.storage_options(),
    )
    data = os.urandom(11 * MiB)
    (tmp_path / "src.bin").write_bytes(data)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/src.bin", opts)
    faulty = FaultyStore(dst)
    faulty.faults["upload_part"] = fail_at(2)
    with pytest.raises(StorageError):
        copy_object(src, src_key, faulty, dst_key, opts, state_dir=tmp_path / "state")
    for upload in list(dst.list_multipart("")):  # e.g. `cloudckpt gc` or a lifecycle rule
        dst.abort_multipart(upload)
    again = FaultyStore(dst)
    result = copy_object(src, src_key, again, dst_key, opts, state_dir=tmp_path / "state")
    assert result.resumed_bytes == 0 and again.calls["upload_part"] == 3
    assert dst.get(dst_key) == data


def _stall_at(
    call: int, release: threading.Event, then: Callable[[], None] = lambda: None
) -> Callable[[int], BaseException | None]:
    """A fault rule: request ``call`` runs ``then`` and hangs until ``release`` (the
    network stopped answering), then goes on; other requests pass."""

    def rule(n: int) -> BaseException | None:
        if n == call:
            then()
            release.wait()
        return None

    return rule


#: A generous bound: the watchdog ends the stall after this long, so a copy that waits
#: for the stalled request returns only after it (and fails the test) instead of hanging.
WATCHDOG_S = 60.0


def _watchdog(release: threading.Event) -> threading.Timer:
    timer = threading.Timer(WATCHDOG_S, release.set)
    timer.daemon = True
    timer.start()
    return timer


def test_cancel_on_ctrl_c_does_not_wait_for_a_stalled_request() -> None:
    group = TransferGroup(resolve_options(), 2)
    release, entered = threading.Event(), threading.Event()
    group.submit(lambda: _stall_at(1, release, entered.set)(1), "a request the network holds")
    timer = _watchdog(release)
    try:
        entered.wait()
        try:
            raise KeyboardInterrupt  # what Ctrl-C raises while the group's caller waits
        except KeyboardInterrupt:
            group.cancel()
        assert not release.is_set(), "cancel waited for the stalled request"
    finally:
        timer.cancel()
        release.set()


def test_deadline_stops_an_upload_with_a_stalled_part(
    moto_server: S3Server, tmp_path: Path
) -> None:
    bucket = moto_server.make_bucket("cp-deadline-stalled")
    opts = resolve_options(
        part_size=5 * MiB,
        write_concurrency=1,
        max_attempts=1,
        deadline=2.0,
        storage_options=moto_server.storage_options(),
    )
    data = os.urandom(16 * MiB)  # 4 parts
    (tmp_path / "src.bin").write_bytes(data)
    src, src_key = open_url(str(tmp_path / "src.bin"), opts.replace(storage_options={}))
    dst, dst_key = open_url(f"s3://{bucket}/src.bin", opts)
    release = threading.Event()
    faulty = FaultyStore(dst)
    held = _stall_at(2, release)

    def dropped(n: int) -> BaseException | None:
        # The held part never reaches the server: when the stall ends, its connection
        # drops (else it could land beside the rerun's upload of the same part).
        held(n)
        return StorageError("the held request's connection dropped") if n == 2 else None

    faulty.faults["upload_part"] = dropped
    state_dir = tmp_path / "state"
    state = CopyState()
    timer = _watchdog(release)
    try:
        with pytest.raises(DeadlineExceededError):
            copy_object(src, src_key, faulty, dst_key, opts, state_dir=state_dir, state=state)
        assert not release.is_set(), "the copy waited for the stalled part"
    finally:
        timer.cancel()
        release.set()
    assert state.kept() == "1 of 4 parts kept"
    assert len(list(dst.list_multipart(""))) == 1  # kept open, journaled, for the rerun
    again = opts.replace(deadline=None)
    result = copy_object(src, src_key, dst, dst_key, again, state_dir=state_dir)
    assert result.resumed_bytes == 5 * MiB
    assert dst.get(dst_key) == data

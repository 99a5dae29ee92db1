"""The commit protocol (cloudckpt.format.commit) on the memory and file stores and moto.

A marker is created once, create-only; a retried write of the same bytes (the answer of
the first attempt lost after it landed) is success; another save's marker is refused,
naming its URL. The DCP writer, the manager and Megatron commit through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.dcp import location as location_module
from cloudckpt.errors import AlreadyExistsError, BucketNotFoundError, TransientError
from cloudckpt.format.commit import commit_marker, read_committed
from cloudckpt.manager.marker import (
    CheckpointInfo,
    FileEntry,
    read_marker,
    write_marker,
)
from cloudckpt.options import resolve_options
from cloudckpt.store import Store, open_url
from conftest import make_target
from faults import FaultyStore

FAST = {"backoff_base": 0.001, "backoff_max": 0.002, "max_attempts": 3}


class RecordingStore(FaultyStore):
    """A :class:`FaultyStore` that records the ``if_none_match`` flag of each put, and
    loses the answer of the first put of each key in ``lose_answer`` after it landed
    (the store then sees a reset and retries, as after a dropped connection)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.puts: list[tuple[str, bool]] = []
        self.lose_answer: set[str] = set()

    def _put(self, key: str, data: memoryview, if_none_match: bool) -> None:
        self.puts.append((key, if_none_match))
        super()._put(key, data, if_none_match)
        if key in self.lose_answer:
            self.lose_answer.discard(key)
            raise TransientError("connection reset after the write landed")


@pytest.fixture(params=["memory", "file", "moto"])
def spot(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RecordingStore, str]]:
    """A recording store over a fresh target, and a key prefix inside it."""
    targets = make_target(request, request.param, tmp_path)
    target = next(targets)
    opts = resolve_options(storage_options=target.storage_options, **FAST)
    store, key = open_url(f"{target.base_url}/run", opts)
    yield RecordingStore(store), key
    next(targets, None)  # the target's own cleanup (a bucket, the memory store)


def test_the_marker_is_created_create_only(spot: tuple[RecordingStore, str]) -> None:
    store, prefix = spot
    key = f"{prefix}/step-1/.metadata"
    commit_marker(store, key, b"marker of save 1")
    assert store.puts == [(key, True)]
    assert read_committed(store, key) == b"marker of save 1"


def test_a_retried_identical_write_succeeds(spot: tuple[RecordingStore, str]) -> None:
    store, prefix = spot
    key = f"{prefix}/step-2/.metadata"
    store.lose_answer.add(key)
    commit_marker(store, key, b"marker of save 2")
    # Two attempts, both create-only; the second found our own marker and read it back.
    assert store.puts == [(key, True), (key, True)]
    # Read back once, capped at its own size (a larger object is not read at all).
    assert store.calls["head"] == 1 and store.calls["get_range"] == 1
    assert "get" not in store.calls
    assert read_committed(store.inner, key) == b"marker of save 2"


def test_another_save_s_marker_is_refused_naming_its_url(
    spot: tuple[RecordingStore, str],
) -> None:
    store, prefix = spot
    key = f"{prefix}/step-3/.metadata"
    store.inner.put(key, b"marker of another save")
    with pytest.raises(AlreadyExistsError, match="another save committed") as info:
        commit_marker(store, key, b"marker of this save")
    assert store.url(key) in str(info.value)
    assert read_committed(store, key) == b"marker of another save"  # left as it was


def test_no_marker_reads_as_not_committed(spot: tuple[RecordingStore, str]) -> None:
    store, prefix = spot
    assert read_committed(store, f"{prefix}/step-4/.metadata") is None


def test_a_missing_bucket_is_an_error_not_an_uncommitted_checkpoint(moto_server: Any) -> None:
    opts = resolve_options(storage_options=moto_server.storage_options(), **FAST)
    store, key = open_url("s3://no-such-bucket-commit/run", opts)
    with pytest.raises(BucketNotFoundError):
        read_committed(store, f"{key}/.metadata")


# -- the callers ---------------------------------------------------------------------------
def _info(step: int, when: float) -> CheckpointInfo:
    return CheckpointInfo(step, "", when, 3, "object", (FileEntry("state.pt", 3),))


def test_the_manager_marker_is_committed_through_the_protocol(
    spot: tuple[RecordingStore, str],
) -> None:
    store, prefix = spot
    key = f"{prefix}/step-000000005/_CHECKPOINT.json"
    info = _info(5, 100.0)
    store.lose_answer.add(key)
    write_marker(store, key, info)
    assert store.puts == [(key, True), (key, True)]
    got = read_marker(store, key)
    assert got is not None and got.step == 5 and got.time == 100.0
    with pytest.raises(AlreadyExistsError, match=r"step-000000005/_CHECKPOINT\.json"):
        write_marker(store, key, _info(5, 200.0))  # another save of step 5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_whose_metadata_answer_is_lost_still_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = resolve_options(**FAST)
    real, key = open_url((tmp_path / "ckpt").as_uri(), opts)
    store = RecordingStore(real)
    marker = key.rstrip("/") + "/.metadata"
    store.lose_answer.add(marker)
    monkeypatch.setattr(location_module, "open_url", lambda url, options: (store, key))
    state = {"w": torch.arange(12.0), "step": 3}
    dcp.save(state, storage_writer=CloudStorageWriter((tmp_path / "ckpt").as_uri(), **FAST))
    assert store.puts.count((marker, True)) == 2  # retried, both create-only
    assert (marker, False) not in store.puts
    out = {"w": torch.zeros(12), "step": 0}
    dcp.load(out, storage_reader=CloudStorageReader((tmp_path / "ckpt").as_uri()))
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3

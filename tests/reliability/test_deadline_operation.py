"""``deadline`` bounds a whole operation (store/deadline.py): a save whose parts and
abort both stall, a load whose reads stall, a sharded safetensors save. Each raises
``DeadlineExceededError`` while the stalled requests are still held (the proxy's
``stall_ends`` is empty: nobody waited for them), with nothing committed."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.errors import DeadlineExceededError
from cloudckpt.manager import collect_garbage
from cloudckpt.options import MiB
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import unique_bucket_name

DEADLINE = 3.0
STALL = 60.0  # far past the deadline and its cleanup's grace


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(4)}  # 12 MiB


def _keys(server: Any, bucket: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def _open_uploads(server: Any, bucket: str) -> list[Any]:
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _part(method: str, target: str) -> bool:
    return method == "PUT" and "partNumber=" in target


def _abort(method: str, target: str) -> bool:
    return method == "DELETE" and "uploadId=" in target


class _FirstAborts:
    """Match every part upload and the first ``n`` abort requests."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0
        self._lock = threading.Lock()

    def __call__(self, method: str, target: str) -> bool:
        if _part(method, target):
            return True
        if _abort(method, target):
            with self._lock:
                self.seen += 1
                return self.seen <= self.n
        return False


def _save_stalled(server: Any, bucket: str, match: Any) -> tuple[str, list[float], str]:
    """A save through a proxy stalling what ``match`` picks; what it raised, and the
    stalls that had ended when it did."""
    with FaultProxy(
        server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=STALL, match=match
    ) as proxy:
        so = {**server.storage_options(), "endpoint_url": proxy.url}
        url = f"s3://{bucket}/run/c.pt"
        with pytest.raises(DeadlineExceededError) as info:
            cloudckpt.save(
                _state(), url, storage_options=so, part_size=5 * MiB, request_timeout=1.5,
                deadline=DEADLINE,
            )  # fmt: skip
        ended = list(proxy.stall_ends)
        assert proxy.injected["slow"] >= 2
    return url, ended, str(info.value)


def test_a_stalled_abort_is_retried_within_the_grace(rclone_server: Any) -> None:
    """Every part stalls until the deadline, then the first abort stalls too: its retry
    on a fresh connection, inside the cleanup's grace, closes the upload."""
    bucket = rclone_server.make_bucket(unique_bucket_name("deadline-abort"))
    match = _FirstAborts(1)
    url, ended, message = _save_stalled(rclone_server, bucket, match)
    assert "deadline" in message and url in message
    assert ended == []  # raised while every stalled request was still held
    assert match.seen == 2  # the stalled abort, then its retry
    assert _keys(rclone_server, bucket) == []
    assert _open_uploads(rclone_server, bucket) == []


def test_an_abort_that_never_answers_is_abandoned_and_left_for_gc(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("deadline-noabort"))
    _, ended, message = _save_stalled(rclone_server, bucket, _FirstAborts(10_000))
    assert "deadline" in message
    assert ended == []
    assert _keys(rclone_server, bucket) == []  # nothing committed
    # The upload is still open (no abort reached the server); gc removes it.
    assert len(_open_uploads(rclone_server, bucket)) == 1
    so = rclone_server.storage_options()
    report = collect_garbage(*_store_and_key(f"s3://{bucket}/run", so), grace_seconds=0.0)
    assert [u for _, u, _ in report.uploads]
    assert _open_uploads(rclone_server, bucket) == []


def _store_and_key(url: str, so: dict[str, Any]) -> tuple[Any, str, Any]:
    from cloudckpt.store import open_target

    t = open_target(url, storage_options=so)
    return t.store, t.key, t.options


def test_a_load_whose_reads_stall_fails_at_the_deadline(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("deadline-load"))
    so = rclone_server.storage_options()
    url = f"s3://{bucket}/c.pt"
    cloudckpt.save(_state(), url, storage_options=so)

    def ranged_reads(method: str, target: str) -> bool:
        return method == "GET" and "c.pt" in target

    # The directory read gets through; every read of the records stalls.
    with FaultProxy(
        rclone_server.endpoint_url, kinds=("slow",), schedule={n: "slow" for n in range(2, 500)},
        slow_seconds=STALL, match=ranged_reads,
    ) as proxy:  # fmt: skip
        with pytest.raises(DeadlineExceededError, match="deadline"):
            cloudckpt.load(
                url, storage_options={**so, "endpoint_url": proxy.url}, request_timeout=1.5,
                deadline=DEADLINE,
            )  # fmt: skip
        assert proxy.injected["slow"] >= 1
        assert proxy.stall_ends == []


def test_a_sharded_safetensors_save_is_bounded_as_a_whole(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("deadline-st"))
    so = rclone_server.storage_options()
    state = {f"w{i}": t for i, t in enumerate(_state().values())}

    def second_shard(method: str, target: str) -> bool:
        return method == "PUT" and "00002-of-" in target

    with FaultProxy(
        rclone_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=STALL,
        match=second_shard,
    ) as proxy:  # fmt: skip
        with pytest.raises(DeadlineExceededError):
            cloudckpt.save_safetensors(
                state, f"s3://{bucket}/model", storage_options={**so, "endpoint_url": proxy.url},
                max_shard_size=4 * MiB, request_timeout=1.5, deadline=DEADLINE,
            )  # fmt: skip
        assert proxy.injected["slow"] >= 1
        assert proxy.stall_ends == []
    assert not any(k.endswith(".index.json") for k in _keys(rclone_server, bucket))

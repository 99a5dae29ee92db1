"""Bounded saves: a stalled connection is retried on a fresh one (``request_timeout``, the
stall timeout); a save that cannot finish within ``deadline`` fails, on every rank of a
DCP save, naming what is stuck, with its uploads aborted and nothing committed.

No test times the save: each checks what happened instead. A save ended by its 3 s
deadline raised while the stalled requests (60 s) were still unanswered, which the
proxy's ``stall_ends`` shows, however busy the machine is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import cloudckpt
from cloudckpt.dcp import CloudStorageWriter
from cloudckpt.errors import DeadlineExceededError
from cloudckpt.options import MiB
from cloudckpt.store.deadline import start_deadline
from cloudckpt.testing.fault_proxy import FaultProxy
from ranks import run_ranks
from servers import unique_bucket_name

DEADLINE = 3.0
#: The two-rank DCP save's, from the start of its data write (_TimedWriter).
DCP_DEADLINE = 6.0


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(3 * MiB // 4, generator=g) for i in range(4)}  # 12 MiB


def _parts(method: str, target: str) -> bool:
    return method == "PUT" and "partNumber=" in target


def _open_uploads(server: Any, bucket: str) -> list[Any]:
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _keys(server: Any, bucket: str) -> list[str]:
    listed = server.client().list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def test_a_stalled_part_is_retried_on_a_fresh_connection(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("stall"))
    state = _state()
    # The first part upload gets no answer at all; the client gives up on it after the
    # stall timeout and sends it again.
    with FaultProxy(
        rclone_server.endpoint_url, schedule={2: "slow"}, slow_seconds=60.0, match=_parts
    ) as proxy:
        so = {**rclone_server.storage_options(), "endpoint_url": proxy.url}
        url = f"s3://{bucket}/c.pt"
        cloudckpt.save(state, url, storage_options=so, part_size=5 * MiB, request_timeout=1.5)
        assert proxy.injected["slow"] == 1
    got = cloudckpt.load(url, storage_options=rclone_server.storage_options())
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_save_past_its_deadline_fails_naming_the_stuck_part(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("deadline"))
    # Every part upload stalls, longer than the request timeout allows anyone to notice.
    with FaultProxy(
        rclone_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=60.0, match=_parts
    ) as proxy:
        so = {**rclone_server.storage_options(), "endpoint_url": proxy.url}
        url = f"s3://{bucket}/run/c.pt"
        with pytest.raises(DeadlineExceededError) as info:
            cloudckpt.save(
                _state(), url, storage_options=so, part_size=5 * MiB, request_timeout=60.0,
                deadline=DEADLINE,
            )  # fmt: skip
        # The deadline ended the save, not the stall: no stalled part had been answered.
        assert proxy.injected["slow"] >= 1 and proxy.stall_ends == [], proxy.stall_ends
    message = str(info.value)
    assert f"upload part 1 of {url}" in message and f"{DEADLINE:g} s deadline" in message
    assert _keys(rclone_server, bucket) == []  # nothing committed
    assert _open_uploads(rclone_server, bucket) == []  # the upload was aborted


class _TimedWriter(CloudStorageWriter):
    """The writer, noting when each step of the save began (seconds after ``start``),
    for a failure to say where the time went. Its deadline starts again when the data
    write begins: what this test stalls is rank 1's upload, and in full-suite runs the
    planning before it (collectives between two forked ranks) twice took the whole
    deadline, on rank 0, before any data was sent. That the deadline also covers the
    planning is tests/reliability/test_deadline_whole_save.py's to show."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    def _note(self, step: str) -> None:
        self.steps.append((step, round(time.monotonic() - self.start, 2)))

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        self._note("set_up")
        super().set_up_storage_writer(*args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        self._note("local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        self._note("global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._note("write_data")
        self._deadline = start_deadline(self.location.options.deadline)
        return super().write_data(plan, planner)


def _dcp_save(rank: int, world: int, url: str, so: dict[str, Any], out: Path) -> None:
    state = {"model": _state(seed=rank), "rank": torch.tensor(rank)}
    writer = _TimedWriter(
        url, storage_options=so, part_size=5 * MiB, request_timeout=60.0, deadline=DCP_DEADLINE
    )
    # Each rank's deadline starts in set_up_storage_writer: start both saves together, so
    # the time one rank spends making its state does not count against the other's.
    dist.barrier()
    writer._note("barrier passed")
    with pytest.raises((CheckpointException, DeadlineExceededError)) as info:
        dcp.save(state, storage_writer=writer)
    writer._note("raised")
    # When it raised, on the clock every process of this machine shares (CLOCK_MONOTONIC),
    # for the test to compare with the end of the stall.
    (out / f"rank-{rank}").write_text(repr(time.monotonic()))
    # Every rank learns which rank and object were stuck.
    expected = f"rank 1: not finished within its {DCP_DEADLINE:g} s deadline"
    assert expected in str(info.value), f"rank {rank}, {writer.steps}: {info.value}"
    assert "__1_0.distcp" in str(info.value)


def test_a_rank_stuck_past_the_deadline_fails_every_rank(
    rclone_server: Any, tmp_path: Path
) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("deadline-dcp"))

    def rank_1_data(method: str, target: str) -> bool:
        return _parts(method, target) and "__1_0.distcp" in target

    with FaultProxy(
        rclone_server.endpoint_url, rate=1.0, kinds=("slow",), slow_seconds=60.0,
        match=rank_1_data,
    ) as proxy:  # fmt: skip
        so = {**rclone_server.storage_options(), "endpoint_url": proxy.url}
        run_ranks(_dcp_save, 2, f"s3://{bucket}/run/step-1", so, tmp_path, timeout=120)
        assert proxy.injected["slow"] >= 1
    # Both ranks raised before any of rank 1's stalled parts was answered (leaving the
    # proxy ended the stalls): the deadline ended the save, on every rank.
    raised = [float((tmp_path / f"rank-{rank}").read_text()) for rank in range(2)]
    assert proxy.stall_ends and max(raised) < min(proxy.stall_ends), (raised, proxy.stall_ends)
    assert ".metadata" not in " ".join(_keys(rclone_server, bucket))
    assert _open_uploads(rclone_server, bucket) == []

"""A local tier's saves and the process's byte budget (``max_bytes_in_flight``).

A drain's parts count against the budget; when the bucket stops answering, the parts
in flight hold it until their requests time out. A save into the local tier takes
nothing from it, so it goes on at local speed (docs/tiers.md, "Options"). Real moto
behind the fault proxy, which first holds every request and later is replaced by one
that passes them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from cloudckpt.errors import StorageError
from cloudckpt.io.scheduler import get_scheduler
from cloudckpt.manager import CheckpointManager
from cloudckpt.options import MiB
from cloudckpt.testing.fault_proxy import FaultProxy
from servers import S3Server, free_port, unique_bucket_name

#: A local save takes well under this whatever the bucket does (generous: a busy
#: machine); before, it waited for the drain's stalled parts to time out (30 s each).
LOCAL_SAVE_S = 10.0
PART = 5 * MiB


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((3 * PART // 4,), float(step))}  # 15 MiB: three parts


def test_a_drain_stalled_on_a_silent_bucket_holds_no_budget_a_local_save_needs(
    moto_server: S3Server, tmp_path: Path
) -> None:
    bucket = moto_server.make_bucket(unique_bucket_name("budget"))
    root, port = f"s3://{bucket}/run", free_port()
    options = {**moto_server.storage_options(), "endpoint_url": f"http://127.0.0.1:{port}"}
    m = CheckpointManager(
        root,
        local_dir=tmp_path / "tier",
        storage_options=options,
        part_size=PART,
        write_concurrency=2,
        max_bytes_in_flight=2 * PART,
        max_attempts=2,
        request_timeout=30.0,
    )
    budget = get_scheduler().set_budget(2 * PART)
    # Every part upload is accepted and held without an answer, until the proxy stops;
    # the rest (the drainer's listing, the upload's creation) is answered.
    with FaultProxy(
        moto_server.endpoint_url,
        port=port,
        rate=1.0,
        kinds=("slow",),
        slow_seconds=600,
        match=lambda method, target: method == "PUT" and "partNumber=" in target,
    ):
        m.save(1, state(1))  # local; its drain starts in the background
        end = time.monotonic() + 60
        while budget.used < budget.capacity:  # the drain's parts hold the whole budget
            assert time.monotonic() < end, "the drain never filled the budget"
            time.sleep(0.05)  # polling for the drain's progress, not waiting for a time
        started = time.monotonic()
        info = m.save(2, state(2))
        took = time.monotonic() - started
        assert info.tiers == ("local",)
        assert took < LOCAL_SAVE_S, took  # before: blocked until the stalled parts timed out
    # The held requests end with the proxy; one that passes takes its place.
    with FaultProxy(moto_server.endpoint_url, port=port):
        try:
            m.drain()  # may report the drain whose requests the first proxy cut off ...
        except StorageError:
            m.drain()  # ... which is then sent again, whole
        plain = CheckpointManager(root, storage_options=options)  # the bucket alone
        assert [c.step for c in plain.list()] == [1, 2]
        assert torch.equal(plain.restore(step=2)["w"], state(2)["w"])

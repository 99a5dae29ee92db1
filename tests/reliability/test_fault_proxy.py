"""Saves and loads through a proxy that breaks requests on purpose."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.options import MiB
from cloudckpt.testing.fault_proxy import FaultProxy

# Enough attempts for 10% faults. The timeout stays well above a normal request's
# latency: a request abandoned by the client may still reach the server, and rclone
# rejects a completion (InvalidPart) when two uploads of one part overlap.
RETRYING = {"max_attempts": 12, "backoff_base": 0.01, "backoff_max": 0.2, "request_timeout": 4.0}


def _state(mib: int) -> dict:
    g = torch.Generator().manual_seed(mib)
    return {f"t{i}": torch.randn(mib * MiB // 4 // 8, generator=g) for i in range(8)}


def _opts(server, proxy) -> dict:
    return {**server.storage_options(), "endpoint_url": proxy.url}


@pytest.mark.parametrize(
    "kind", ["slowdown", "internal", "reset", "reset_after", "truncate", "short", "slow"]
)
def test_each_fault_kind_is_survived(rclone_server, kind):
    bucket = rclone_server.make_bucket(f"fault-{kind.replace('_', '-')}")
    state = _state(12)
    # Every third request fails; a slow answer costs a whole timeout, so only two of those.
    numbers = (3, 8) if kind == "slow" else range(2, 40, 3)
    with FaultProxy(
        rclone_server.endpoint_url, schedule=dict.fromkeys(numbers, kind), slow_seconds=5.0
    ) as proxy:
        opts = {"storage_options": _opts(rclone_server, proxy), **RETRYING}
        cloudckpt.save(state, f"s3://{bucket}/c.pt", part_size=5 * MiB, write_concurrency=2, **opts)
        out = cloudckpt.load(f"s3://{bucket}/c.pt", read_chunk_size=2 * MiB, **opts)
        assert proxy.injected[kind] > 0
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.slow
def test_ten_percent_mixed_faults_256_mib(rclone_server):
    bucket = rclone_server.make_bucket("fault-mixed")
    state = _state(256)
    with FaultProxy(rclone_server.endpoint_url, rate=0.10, seed=7, slow_seconds=5.0) as proxy:
        opts = {"storage_options": _opts(rclone_server, proxy), **RETRYING}
        cloudckpt.save(state, f"s3://{bucket}/sync.pt", part_size=8 * MiB, **opts)
        handle = cloudckpt.async_save(state, f"s3://{bucket}/async.pt", part_size=8 * MiB, **opts)
        handle.result(600)
        for name in ("sync", "async"):
            out = cloudckpt.load(f"s3://{bucket}/{name}.pt", read_chunk_size=8 * MiB, **opts)
            assert all(torch.equal(out[k], state[k]) for k in state), name
        assert sum(proxy.injected.values()) >= 5, proxy.injected


def test_faults_beyond_the_retry_budget_leave_nothing_committed(moto_server):
    bucket = moto_server.make_bucket("fault-exhausted")
    client = moto_server.client()

    def part_uploads(method: str, target: str) -> bool:
        return method == "PUT" and "partNumber=" in target

    # The first part goes through; every later part upload fails with SlowDown.
    with FaultProxy(
        moto_server.endpoint_url,
        match=part_uploads,
        schedule={n: "slowdown" for n in range(3, 200)},
    ) as proxy:
        opts = {
            "storage_options": _opts(moto_server, proxy),
            "max_attempts": 3,
            "backoff_base": 0.01,
            "backoff_max": 0.02,
        }
        with pytest.raises(errors.RetriesExhaustedError, match="SlowDown"):
            cloudckpt.save(
                _state(12), f"s3://{bucket}/x.pt", part_size=5 * MiB, write_concurrency=1, **opts
            )
        assert proxy.injected["slowdown"] >= 3
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

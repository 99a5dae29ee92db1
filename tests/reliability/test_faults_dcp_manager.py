"""DCP and the manager through the fault proxy: identical data, or nothing committed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import errors
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.options import MiB
from cloudckpt.testing.fault_proxy import FaultProxy
from dcp_compat import SINGLE

RETRYING = {"max_attempts": 12, "backoff_base": 0.01, "backoff_max": 0.2, "request_timeout": 4.0}


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {f"layer{i}.weight": torch.randn(1 << 19, generator=g) for i in range(8)}  # 16 MiB


def _opts(server, proxy) -> dict:
    return {"storage_options": {**server.storage_options(), "endpoint_url": proxy.url}, **RETRYING}


def test_dcp_save_and_load_survive_ten_percent_faults(rclone_server):
    bucket = rclone_server.make_bucket("fault-dcp")
    state = _state()
    with FaultProxy(rclone_server.endpoint_url, rate=0.10, seed=3, slow_seconds=5.0) as proxy:
        opts = _opts(rclone_server, proxy)
        url = f"s3://{bucket}/step-1"
        dcp.save(state, storage_writer=CloudStorageWriter(url, part_size=5 * MiB, **opts), **SINGLE)
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(
            out,
            storage_reader=CloudStorageReader(url, read_chunk_size=2 * MiB, **opts),
            **SINGLE,
        )
        assert sum(proxy.injected.values()) > 0
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_manager_survives_ten_percent_faults(rclone_server):
    bucket = rclone_server.make_bucket("fault-manager")
    with FaultProxy(rclone_server.endpoint_url, rate=0.10, seed=5, slow_seconds=5.0) as proxy:
        manager = cloudckpt.CheckpointManager(
            f"s3://{bucket}/run", keep_last=2, part_size=5 * MiB, **_opts(rclone_server, proxy)
        )
        states = {}
        for step in (10, 20, 30):
            states[step] = {"w": torch.full((1 << 20,), float(step)), "step": step}
            manager.save(step, states[step], metrics={"loss": 1.0 / step})
        assert [c.step for c in manager.list()] == [20, 30]
        restored = manager.restore()
        assert sum(proxy.injected.values()) > 0
    assert restored["step"] == 30 and torch.equal(restored["w"], states[30]["w"])


def test_manager_save_failing_past_retries_leaves_latest_on_the_previous_step(moto_server):
    bucket = moto_server.make_bucket("fault-manager-fail")
    client = moto_server.client()
    with FaultProxy(moto_server.endpoint_url) as proxy:
        opts = _opts(moto_server, proxy) | {"max_attempts": 2, "backoff_base": 0.01}
        manager = cloudckpt.CheckpointManager(f"s3://{bucket}/run", keep_last=1, **opts)
        manager.save(1, {"w": torch.ones(4)})
        proxy.schedule = {n: "internal" for n in range(proxy.requests + 1, proxy.requests + 500)}
        with pytest.raises(errors.RetriesExhaustedError):
            manager.save(2, {"w": torch.zeros(4)})
        proxy.enabled = False
        assert manager.latest().step == 1
        assert torch.equal(manager.restore()["w"], torch.ones(4))
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

"""A replicated DCP state (a DDP resume) loaded on 4 gloo ranks reads its bytes once.

Every rank's plan names the same items, so each rank reads a share of the data objects'
tensors, checks them, and the ranks exchange them; a proxy in front of the server counts
the bytes the store sent. A sharded (DTensor) load, whose plans differ, reads as before.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.testing.fault_proxy import FaultProxy
from ranks import run_ranks
from servers import unique_bucket_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORLD = 4


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    model = {f"layer{i}.weight": torch.randn(256, 512, generator=g) for i in range(12)}  # 6 MiB
    model.update({f"layer{i}.bias": torch.randn(512, generator=g) for i in range(12)})
    model["step_t"] = torch.tensor(7)
    return {"model": model, "epoch": 3, "note": "ddp"}


def _empty() -> dict[str, Any]:
    s = _state()
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "epoch": 0,
        "note": "",
    }


def _load(rank: int, world: int, url: str, so: dict[str, Any], share: bool) -> None:
    got = _empty()
    dcp.load(got, storage_reader=CloudStorageReader(url, storage_options=so, share_reads=share))
    want = _state()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["epoch"] == 3 and got["note"] == "ddp"


def test_a_replicated_dcp_resume_reads_each_byte_once(rclone_server: Any) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("dcp-shared"))
    direct = rclone_server.storage_options()
    url = f"s3://{bucket}/run/step-1"
    dcp.save(_state(), storage_writer=CloudStorageWriter(url, storage_options=direct), no_dist=True)
    client = rclone_server.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix="run/step-1/")["Contents"]
    data = sum(o["Size"] for o in listed if o["Key"].endswith(".distcp"))
    with FaultProxy(rclone_server.endpoint_url) as proxy:
        so = {**direct, "endpoint_url": proxy.url}
        run_ranks(_load, WORLD, url, so, True)
        shared = proxy.body_bytes["GET"]
        proxy.body_bytes.clear()
        run_ranks(_load, WORLD, url, so, False)
        alone = proxy.body_bytes["GET"]
    # Shared: the data once, plus each rank's .metadata and layout index (a few KiB).
    assert shared <= 1.1 * data, (shared, data)
    assert alone >= WORLD * 0.95 * data, (alone, data)


def _load_full(rank: int, world: int, url: str) -> None:
    import dcp_workers as w

    state = {"model": {k: torch.zeros_like(v) for k, v in w.global_tensors().items()}}
    dcp.load(state, storage_reader=CloudStorageReader(url))
    for k, v in w.global_tensors().items():  # "col" lands in column slices: not contiguous
        assert torch.equal(state["model"][k], v), (rank, k)


def test_ranks_loading_a_sharded_checkpoint_whole_share_it(tmp_path: Any) -> None:
    import dcp_workers as w

    url = (tmp_path / "ck").as_uri()
    run_ranks(w.save_only, 2, url, {}, {})  # rows and columns sharded over 2 ranks
    run_ranks(_load_full, 2, url)  # both ranks load every tensor whole: the same plan

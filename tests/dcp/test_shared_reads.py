"""A replicated DCP state (a DDP resume) loaded on 4 gloo ranks reads its bytes once.

Every rank's plan names the same items, so each rank reads a share of the data objects'
tensors, checks them, and the ranks exchange them; a proxy in front of the server counts
the bytes the store sent. A sharded (DTensor) load, whose plans differ, reads as before.

Model parallel x data parallel: the ranks whose plans match (the replicas of one shard)
share among themselves, each group apart, and a rank whose plan no other has reads
alone; a failure in one group fails its ranks by name and the whole ``dcp.load``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import cloudckpt.dcp.reader as reader_module
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.dcp.reader import SharedRead
from cloudckpt.errors import CorruptCheckpointError, DistributedLoadError
from cloudckpt.ranks import groups
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


# -- model parallel x data parallel: sharing within the groups whose plans match ---------


def _shard(s: int) -> dict[str, torch.Tensor]:
    """Model-parallel shard ``s``: 3 MiB in 6 weights of 512 KiB and 6 biases."""
    g = torch.Generator().manual_seed(10 + s)
    shard = {f"mp{s}.layer{i}.weight": torch.randn(256, 512, generator=g) for i in range(6)}
    shard.update({f"mp{s}.layer{i}.bias": torch.randn(512, generator=g) for i in range(6)})
    return shard


def _save_shards(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """Model-parallel rank ``rank`` saves its shard (its own data objects)."""
    state = {"model": _shard(rank), "epoch": 3}
    dcp.save(state, storage_writer=CloudStorageWriter(url, storage_options=so))


def _load_shard(rank: int, url: str, so: dict[str, Any], share: bool, shard: int) -> Any:
    got = {"model": {k: torch.zeros_like(v) for k, v in _shard(shard).items()}, "epoch": 0}
    reader = CloudStorageReader(url, storage_options=so, share_reads=share)
    dcp.load(got, storage_reader=reader)
    for k, v in _shard(shard).items():
        assert torch.equal(got["model"][k], v), (rank, k)
    assert got["epoch"] == 3
    return reader


def _record(out: str, rank: int, reader: Any) -> None:
    seen = {
        "requests": reader.last_read_requests,
        "bytes": reader.last_read_bytes,
        "shared_with": list(reader.last_shared_with),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


def _recorded(out: Path, world: int) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def _load_shards(
    rank: int, world: int, url: str, so: dict[str, Any], share: bool, shard_of: list[int], out: str
) -> None:
    _record(out, rank, _load_shard(rank, url, so, share, shard_of[rank]))


def _sharded_checkpoint(rclone_server: Any, name: str) -> tuple[str, str, dict[str, Any], int]:
    """Two model-parallel shards saved by 2 ranks: (bucket, url, storage options, data
    bytes)."""
    bucket = rclone_server.make_bucket(unique_bucket_name(name))
    direct = rclone_server.storage_options()
    url = f"s3://{bucket}/run/step-1"
    run_ranks(_save_shards, 2, url, direct)
    listed = rclone_server.client().list_objects_v2(Bucket=bucket, Prefix="run/step-1/")
    data = sum(o["Size"] for o in listed["Contents"] if o["Key"].endswith(".distcp"))
    return bucket, url, direct, data


def test_data_parallel_replicas_of_each_shard_read_it_once(
    rclone_server: Any, tmp_path: Path
) -> None:
    # 2 model-parallel shards x 2 data-parallel replicas: ranks 0 and 2 load shard 0,
    # ranks 1 and 3 shard 1 (Megatron's order: model-parallel ranks next to each other).
    _, url, direct, data = _sharded_checkpoint(rclone_server, "dcp-mpdp")
    shard_of = [0, 1, 0, 1]
    shared_out, alone_out = tmp_path / "shared", tmp_path / "alone"
    shared_out.mkdir()
    alone_out.mkdir()
    with FaultProxy(rclone_server.endpoint_url) as proxy:
        so = {**direct, "endpoint_url": proxy.url}
        run_ranks(_load_shards, WORLD, url, so, True, shard_of, str(shared_out), timeout=120)
        shared, shared_requests = proxy.body_bytes["GET"], proxy.requests
        proxy.body_bytes.clear()
        run_ranks(_load_shards, WORLD, url, so, False, shard_of, str(alone_out), timeout=120)
        alone, alone_requests = proxy.body_bytes["GET"], proxy.requests - shared_requests
    ranks = _recorded(shared_out, WORLD)
    by_rank = _recorded(alone_out, WORLD)
    print(
        f"data {data} B; shared: {shared} B, {shared_requests} requests; "
        f"alone: {alone} B, {alone_requests} requests"
    )
    for r in range(WORLD):
        print(f"rank {r} (shard {shard_of[r]}): shared {ranks[r]}, alone {by_rank[r]}")
    assert [ranks[r]["shared_with"] for r in range(WORLD)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(not by_rank[r]["shared_with"] for r in range(WORLD))
    # Each shard once (plus every rank's .metadata and layout index), against 2x.
    assert shared <= 1.1 * data, (shared, data)
    assert alone >= 2 * 0.95 * data, (alone, data)
    # Every rank read its share: about half of what it reads alone.
    for r in range(WORLD):
        assert 0 < ranks[r]["bytes"] <= 0.75 * by_rank[r]["bytes"], (r, ranks[r], by_rank[r])


def _one_group_fails(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    with pytest.raises(CheckpointException) as info:
        _load_shard(rank, url, so, True, rank % 2)
    # DCP gathers every rank's outcome of read_data: every rank raises, naming both
    # ranks of the failed group, and only them.
    failures = {r: exc for r, (exc, _) in info.value.failures.items()}
    assert set(failures) == {1, 3}, failures
    (bad,) = [r for r, e in failures.items() if isinstance(e, CorruptCheckpointError)]
    (other,) = {1, 3} - {bad}
    named = failures[other]
    assert isinstance(named, DistributedLoadError), named
    assert set(named.failures) == {bad} and f"rank {bad}: ChecksumError" in str(named)


def test_a_failure_in_one_group_fails_that_group_by_name_and_the_whole_load(
    rclone_server: Any,
) -> None:
    bucket, url, direct, _ = _sharded_checkpoint(rclone_server, "dcp-mpdp-bad")
    # Flip a byte in the middle of a tensor of shard 1: only ranks 1 and 3 read it.
    metadata = CloudStorageReader(url, storage_options=direct).read_metadata()
    assert metadata.storage_data is not None
    info = metadata.storage_data[MetadataIndex("model.mp1.layer2.weight", [0, 0])]
    client = rclone_server.client()
    key = f"run/step-1/{info.relative_path}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[info.offset + info.length // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    run_ranks(_one_group_fails, WORLD, url, direct, timeout=120)


def _alone_and_three(rank: int, world: int, url: str, so: dict[str, Any], out: str) -> None:
    shard = 1 if rank == 3 else 0
    _record(out, rank, _load_shard(rank, url, so, True, shard))
    made = dict(groups._parts)
    _load_shard(rank, url, so, True, shard)  # a second load reuses the groups
    assert groups._parts == made


def test_a_rank_alone_and_a_group_of_three(rclone_server: Any, tmp_path: Path) -> None:
    _, url, direct, data = _sharded_checkpoint(rclone_server, "dcp-mpdp-mixed")
    with FaultProxy(rclone_server.endpoint_url) as proxy:
        so = {**direct, "endpoint_url": proxy.url}
        run_ranks(_alone_and_three, WORLD, url, so, str(tmp_path), timeout=120)
        read = proxy.body_bytes["GET"]
    ranks = _recorded(tmp_path, WORLD)
    print(f"data {data} B; two loads read {read} B; first load per rank: {ranks}")
    assert [ranks[r]["shared_with"] for r in range(WORLD)] == [[0, 1, 2]] * 3 + [[]]
    assert read <= 2 * 1.1 * data, (read, data)


def _item(fqn: str, kind: LoadItemType = LoadItemType.TENSOR) -> ReadItem:
    at = torch.Size([0])
    index = MetadataIndex(fqn, at)
    return ReadItem(kind, index, at, index, at, torch.Size([4]))


def test_the_coordinator_groups_ranks_by_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reader = CloudStorageReader(tmp_path.as_uri())
    a, b, c = (LoadPlan([_item(f"{n}.w"), _item("step", LoadItemType.BYTE_IO)]) for n in "abc")
    only_bytes = LoadPlan([_item("step", LoadItemType.BYTE_IO)])
    plans = [a, b, a, b, c, only_bytes, only_bytes]
    monkeypatch.setattr(reader_module, "share_group_size", lambda: len(plans))
    marked = reader.prepare_global_plan(plans)
    want = SharedRead(((0, 2), (1, 3), (4,), (5,), (6,)))
    assert [p.storage_data for p in marked] == [want] * len(plans)
    assert [p.items for p in marked] == [p.items for p in plans]
    # A load on fewer ranks than the world, nobody to share with, sharing off: as is.
    assert reader.prepare_global_plan(plans[:4]) == plans[:4]
    monkeypatch.setattr(reader_module, "share_group_size", lambda: 3)
    assert reader.prepare_global_plan([a, b, c]) == [a, b, c]
    monkeypatch.setattr(reader_module, "share_group_size", lambda: len(plans))
    assert (
        CloudStorageReader(tmp_path.as_uri(), share_reads=False).prepare_global_plan(plans) == plans
    )


def _hsdp(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5 keeps DTensor private
        from torch.distributed._tensor import (  # type: ignore[no-redef]
            Replicate,
            Shard,
            distribute_tensor,
        )

    # HSDP: replicated over "dp", sharded over "tp"; ranks 0, 2 hold rows 0-255 of each.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _shard(0)

    def state(empty: bool) -> dict[str, Any]:
        return {
            k: distribute_tensor(torch.zeros_like(v) if empty else v, mesh, [Replicate(), Shard(0)])
            for k, v in full.items()
        }

    dcp.save(state(False), storage_writer=CloudStorageWriter(url))
    got = state(True)
    reader = CloudStorageReader(url)
    dcp.load(got, storage_reader=reader)
    for k, want in state(False).items():
        assert torch.equal(got[k].to_local(), want.to_local()), (rank, k)
    assert reader.last_shared_with == ((0, 2) if rank % 2 == 0 else (1, 3)), reader.last_shared_with


def test_an_hsdp_load_shares_within_each_shards_replicas(tmp_path: Path) -> None:
    run_ranks(_hsdp, WORLD, (tmp_path / "ck").as_uri(), timeout=120)

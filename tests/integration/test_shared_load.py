"""Read once, share: a DDP-style resume on 4 gloo ranks reads the checkpoint's bytes once.

A fault proxy in front of ``rclone serve s3`` counts the bytes the store sent; each
rank loads through it and checks every tensor it got against the state it saved.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import cloudckpt
import cloudckpt.engine.records as records_module
from cloudckpt.errors import DistributedLoadError, StorageError
from cloudckpt.lightning import CloudCheckpointIO
from cloudckpt.testing.fault_proxy import FaultProxy
from ranks import run_ranks
from servers import unique_bucket_name

WORLD = 4


def _state(seed: int = 0) -> dict[str, Any]:
    """16 MiB in 60 tensors of 256 B to 8 MiB, a view sharing a storage, and extras."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(2048, 1024, generator=g)  # 8 MiB
    state: dict[str, Any] = {
        "big": big,
        "big_rows": big[100:300],  # shares big's storage
        "mid": torch.randn(768, 1024, generator=g),  # 3 MiB
        "ints": torch.arange(1000, dtype=torch.int64),
        "step": 1234,
        "name": "run-1",
    }
    for i in range(56):
        n = 64 * (1 + (i * 37) % 800)  # 256 B to 200 KiB
        state[f"layers.{i}.weight"] = torch.randn(n, generator=g)
    return state


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k
    # Views keep sharing their storage, as torch.load gives them.
    assert got["big_rows"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()


def _resume(rank: int, world: int, url: str, so: dict[str, Any], share: bool) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("cloudckpt")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        got = cloudckpt.load(url, share=share, storage_options=so)
    finally:
        logger.removeHandler(handler)
    _same(got, _state())
    reports = [r for r in records if r.getMessage().startswith("shared load of")]
    if not share:
        assert reports == []
        return
    # Each rank reports its share; together they read the records' bytes once.
    (report,) = reports
    _url, me, ranks, nbytes, total, requests = report.args  # type: ignore[misc]
    assert (me, ranks) == (rank, world)
    shares: list[Any] = [None] * world
    torch.distributed.all_gather_object(shares, (nbytes, requests, total))
    assert total <= sum(n for n, _, _ in shares) <= 1.1 * total, shares
    assert sum(r for _, r, _ in shares) <= 3 * world, shares


def _per_rank(rank: int, world: int, base: str, so: dict[str, Any]) -> None:
    got = cloudckpt.load(f"{base}/rank{rank}.pt", share=True, storage_options=so)
    _same(got, _state(seed=rank))


def _one_rank_fails(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    if rank == 2:
        real = records_module.read_record

        def broken(reader: Any, key: Any, url: Any, entry: Any, dest: Any, owner: Any) -> None:
            raise StorageError(f"injected on rank 2 reading {entry.name}")

        records_module.read_record = broken  # type: ignore[assignment]
    with pytest.raises((DistributedLoadError, StorageError)) as info:
        cloudckpt.load(url, share=True, storage_options=so)
    if rank == 2:
        records_module.read_record = real
        assert isinstance(info.value, StorageError) and "injected on rank 2" in str(info.value)
    else:
        assert isinstance(info.value, DistributedLoadError)
        assert set(info.value.failures) == {2} and "rank 2: StorageError" in str(info.value)


def _lightning_resume(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    got = CloudCheckpointIO(storage_options=so).load_checkpoint(url)
    _same(got, _state())


@pytest.fixture
def proxied(rclone_server: Any) -> Any:
    bucket = rclone_server.make_bucket(unique_bucket_name("shared-load"))
    so = rclone_server.storage_options()
    url = f"s3://{bucket}/run/state.pt"
    size = cloudckpt.save(_state(), url, storage_options=so).size
    with FaultProxy(rclone_server.endpoint_url) as proxy:
        yield proxy, url, size, {**so, "endpoint_url": proxy.url}, bucket


def test_a_ddp_resume_reads_each_byte_once(proxied: Any) -> None:
    proxy, url, size, so, _ = proxied
    run_ranks(_resume, WORLD, url, so, True)
    shared = proxy.body_bytes["GET"]
    # Every record once, plus each rank's directory read (the tail) and data.pkl.
    assert shared <= 1.1 * size, (shared, size)
    proxy.body_bytes.clear()
    run_ranks(_resume, WORLD, url, so, False)
    alone = proxy.body_bytes["GET"]
    assert alone >= WORLD * 0.95 * size, (alone, size)  # each rank read it all


def test_lightning_checkpoint_io_shares_by_default(proxied: Any) -> None:
    proxy, url, size, so, _ = proxied
    run_ranks(_lightning_resume, 2, url, so)
    assert proxy.body_bytes["GET"] <= 1.1 * size


def test_a_rank_failing_its_share_fails_every_rank(proxied: Any) -> None:
    _, url, _, so, _ = proxied
    run_ranks(_one_rank_fails, WORLD, url, so)  # each rank checks its own error


def test_ranks_loading_different_objects_each_load_their_own(
    proxied: Any, rclone_server: Any
) -> None:
    proxy, _, _, so, bucket = proxied
    direct = rclone_server.storage_options()
    sizes = [
        cloudckpt.save(_state(seed=r), f"s3://{bucket}/per/rank{r}.pt", storage_options=direct).size
        for r in range(WORLD)
    ]
    proxy.body_bytes.clear()
    run_ranks(_per_rank, WORLD, f"s3://{bucket}/per", so)
    assert proxy.body_bytes["GET"] >= 0.95 * sum(sizes)

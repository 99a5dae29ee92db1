"""dcp.save / dcp.load / dcp.async_save across spawned gloo ranks, on every store.

Each test spawns its ranks (see dcp_workers.run_ranks); they build DTensor state
dicts sharded on dim 0 and dim 1 and check every shard they load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dcp_workers as w
import pytest
import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.dcp import CloudStorageReader
from cloudckpt.errors import NotFoundError
from cloudckpt.options import TransferOptions
from cloudckpt.store import open_url
from conftest import unique_bucket_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _names(url: str, storage_options: dict[str, Any]) -> list[str]:
    """Relative names of the objects under a checkpoint URL."""
    store, key = open_url(url, TransferOptions(storage_options=storage_options))
    return sorted(o.key[len(key) + 1 :] for o in store.list(key + "/"))


def _open_uploads(url: str, storage_options: dict[str, Any]) -> list[Any]:
    store, key = open_url(url, TransferOptions(storage_options=storage_options))
    try:
        return list(store.list_multipart(key + "/"))
    except NotFoundError:  # rclone: a bucket that never had an upload
        return []


def _full(name: str) -> torch.Tensor:
    return w.global_tensors()[name]


def test_two_ranks_save_and_load(store_url: Any) -> None:
    url = f"{store_url.base_url}/run/step-1"
    w.run_ranks(w.save_and_load, 2, url, store_url.storage_options, {})
    assert _names(url, store_url.storage_options) == [
        ".cloudckpt-layout.json",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert _open_uploads(url, store_url.storage_options) == []


def _target(
    name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, dict[str, Any]]:
    """A fresh checkpoint root on the filesystem or on one of the S3 servers."""
    if name == "file":
        return (tmp_path / "store").as_uri(), {}
    server = request.getfixturevalue(f"{name}_server")
    return f"s3://{server.make_bucket(unique_bucket_name('dcp'))}", server.storage_options()


@pytest.mark.parametrize("target", ["file", "moto", "rclone"])
def test_reshard_4_to_2_and_2_to_3_and_1(
    target: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    root, so = _target(target, request, tmp_path)
    four, two = f"{root}/four", f"{root}/two"
    # 4 ranks, 2 objects each, spread over 2 sub-prefixes.
    w.run_ranks(w.save_only, 4, four, so, {"files_per_rank": 2, "prefix_fanout": 2})
    names = _names(four, so)
    assert ".metadata" in names
    assert {n.split("/")[0] for n in names if n.endswith(".distcp")} == {"d00", "d01"}
    assert sum(n.endswith(".distcp") for n in names) == 8
    w.run_ranks(w.load_only, 2, four, so)  # 4 -> 2
    w.run_ranks(w.save_only, 2, two, so, {})
    w.run_ranks(w.load_only, 3, two, so)  # 2 -> 3 (uneven shards)
    # 2 -> 1: a single process without a process group loads full tensors.
    state = {"model": {k: torch.zeros_like(v) for k, v in w.global_tensors().items()}}
    dcp.load(state, storage_reader=CloudStorageReader(two, storage_options=so))
    for name in ("row", "col", "small", "rep"):
        assert torch.equal(state["model"][name], _full(name)), name


def test_filesystem_writer_and_reader_interoperate(moto_server: Any, tmp_path: Path) -> None:
    so = moto_server.storage_options()
    bucket = moto_server.make_bucket("dcp-compat")
    fs_dir, cloud = tmp_path / "fs", f"s3://{bucket}/cloud"
    w.run_ranks(w.save_both_writers, 2, str(fs_dir), cloud, so)
    client = moto_server.client()

    # torch's FileSystemWriter directory, uploaded as is, loads with CloudStorageReader.
    for path in fs_dir.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"uploaded/{path.relative_to(fs_dir)}")
    state = {"model": {k: torch.zeros_like(v) for k, v in w.global_tensors().items()}}
    reader = CloudStorageReader(f"s3://{bucket}/uploaded", storage_options=so)
    dcp.load(state, storage_reader=reader)
    for name in ("row", "col", "small", "rep"):
        assert torch.equal(state["model"][name], _full(name)), name

    # CloudStorageWriter's checkpoint, downloaded as is, loads with FileSystemReader.
    down = tmp_path / "down"
    for name in _names(cloud, so):
        (down / name).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, f"cloud/{name}", str(down / name))
    state = {"model": {k: torch.zeros_like(v) for k, v in w.global_tensors().items()}, "step": 0}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(down)))
    for name in ("row", "col", "small", "rep"):
        assert torch.equal(state["model"][name], _full(name)), name
    assert state["step"] == 41


@pytest.mark.parametrize("target", ["file", "moto"])
def test_rank_failing_mid_save_leaves_no_metadata(
    target: str, moto_server: Any, tmp_path: Path
) -> None:
    if target == "file":
        url, so = (tmp_path / "ckpt").as_uri(), {}
    else:
        so = moto_server.storage_options()
        url = f"s3://{moto_server.make_bucket('dcp-fail')}/ckpt"
    w.run_ranks(w.save_only, 2, url, so, {})  # a committed checkpoint first ...
    assert ".metadata" in _names(url, so)
    w.run_ranks(w.save_failing, 2, url, so)  # ... then a save of it that fails
    names = _names(url, so)
    assert ".metadata" not in names
    assert _open_uploads(url, so) == []
    with pytest.raises(NotFoundError, match="no committed checkpoint"):
        CloudStorageReader(url, storage_options=so).read_metadata()


def test_async_save_thread_and_process_modes(rclone_server: Any) -> None:
    from torch.distributed.checkpoint import state_dict_saver

    if not hasattr(state_dict_saver, "AsyncCheckpointerType"):
        pytest.skip("this torch has no process-mode dcp.async_save (AsyncCheckpointerType)")
    so = rclone_server.storage_options()
    url = f"s3://{rclone_server.make_bucket('dcp-async')}/ckpt"
    w.run_ranks(w.async_save_modes, 2, url, so)
    for mode in ("thread", "process"):
        assert ".metadata" in _names(f"{url}/{mode}", so)


def test_megatron_sharded_state_dict_with_factories(moto_server: Any) -> None:
    pytest.importorskip("megatron.core.dist_checkpointing")
    so = moto_server.storage_options()
    url = f"s3://{moto_server.make_bucket('dcp-megatron')}/ckpt"
    w.run_ranks(w.megatron_save_and_load, 2, url, so)
    assert ".metadata" in _names(url, so)

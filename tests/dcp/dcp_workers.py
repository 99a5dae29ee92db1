"""Code that runs inside the ranks spawned by the DCP tests (gloo on 127.0.0.1).

The tests run them with :func:`ranks.run_ranks`. Worker functions live here (not in
test modules) so spawned processes can import them by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
except ImportError:  # torch < 2.5 keeps DTensor private
    from torch.distributed._tensor import DTensor, Shard, distribute_tensor  # type: ignore[no-redef]

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from ranks import run_ranks

__all__ = ["run_ranks"]  # re-exported: the tests call w.run_ranks


# Global tensors: large enough that 2-4 way shards exceed the reader's whole-archive
# limit (256 KiB), so sliced reads go straight into the destination.
ROW_SHAPE = (512, 1024)  # float32, 2 MiB, sharded on dim 0
COL_SHAPE = (512, 640)  # float32, 1.25 MiB, sharded on dim 1 (non-contiguous slices)
SMALL_SHAPE = (6, 10)  # a tiny sharded tensor (read whole, coalesced)


# ----------------------------------------------------------------------------- state


def global_tensors() -> dict[str, torch.Tensor]:
    """The full tensors every test state is cut from (same values in every process)."""
    return {
        "row": torch.arange(ROW_SHAPE[0] * ROW_SHAPE[1], dtype=torch.float32).reshape(ROW_SHAPE),
        "col": -torch.arange(COL_SHAPE[0] * COL_SHAPE[1], dtype=torch.float32).reshape(COL_SHAPE),
        "small": torch.arange(60, dtype=torch.int64).reshape(SMALL_SHAPE) * 3,
        "rep": torch.linspace(0, 1, 64),
    }


def sharded_state(world_size: int, empty: bool = False) -> dict[str, Any]:
    """An FSDP/TP-style state dict: DTensors sharded on dim 0 and dim 1, plus extras."""
    mesh = init_device_mesh("cpu", (world_size,))
    full = global_tensors()
    if empty:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "row": distribute_tensor(full["row"], mesh, [Shard(0)]),
            "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
            "small": distribute_tensor(full["small"], mesh, [Shard(0)]),
            "rep": full["rep"],
        },
        "step": 0 if empty else 41,
        "extra": {"name": "" if empty else "run-1"},
    }


def check_state(state: dict[str, Any], world_size: int) -> None:
    """``state`` (loaded into ``sharded_state(world_size, empty=True)``) holds the data."""
    expected = sharded_state(world_size)
    for name in ("row", "col", "small"):
        got, want = state["model"][name], expected["model"][name]
        assert isinstance(got, DTensor)
        assert torch.equal(got.to_local(), want.to_local()), name
    assert torch.equal(state["model"]["rep"], expected["model"]["rep"])
    assert state["step"] == 41
    assert state["extra"]["name"] == "run-1"


def _writer(url: str, storage_options: dict[str, Any], **kw: Any) -> CloudStorageWriter:
    return CloudStorageWriter(url, storage_options=storage_options, **kw)


def _reader(url: str, storage_options: dict[str, Any]) -> CloudStorageReader:
    return CloudStorageReader(url, storage_options=storage_options)


# --------------------------------------------------------------------------- workers


def save_and_load(rank: int, world: int, url: str, so: dict[str, Any], kw: dict[str, Any]) -> None:
    """Save with CloudStorageWriter, then load back in the same world."""
    dcp.save(sharded_state(world), storage_writer=_writer(url, so, **kw))
    state = sharded_state(world, empty=True)
    dcp.load(state, storage_reader=_reader(url, so))
    check_state(state, world)


def save_only(rank: int, world: int, url: str, so: dict[str, Any], kw: dict[str, Any]) -> None:
    dcp.save(sharded_state(world), storage_writer=_writer(url, so, **kw))


def load_only(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """Load into this world size (resharding when it differs from the saving one)."""
    state = sharded_state(world, empty=True)
    dcp.load(state, storage_reader=_reader(url, so))
    check_state(state, world)


def save_both_writers(rank: int, world: int, fs_dir: str, url: str, so: dict[str, Any]) -> None:
    """The same state with torch's FileSystemWriter and with CloudStorageWriter."""
    dcp.save(sharded_state(world), storage_writer=dcp.FileSystemWriter(fs_dir))
    dcp.save(sharded_state(world), storage_writer=_writer(url, so))


class FailingPlanner(DefaultSavePlanner):
    """Fails on ``fail_rank`` when asked for ``fail_fqn``'s data, i.e. mid-write."""

    def __init__(self, fail_rank: int, fail_fqn: str) -> None:
        super().__init__()
        self.fail_rank = fail_rank
        self.fail_fqn = fail_fqn

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == self.fail_fqn and dist.get_rank() == self.fail_rank:
            raise OSError("injected failure on rank 1 while writing its data")
        return super().resolve_data(write_item)


def save_failing(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """Rank 1 fails after streaming ~12 MiB: dcp.save must fail on every rank."""
    mesh = init_device_mesh("cpu", (world,))
    state = {
        "big": distribute_tensor(torch.ones(world * 3 << 20), mesh, [Shard(0)]),
        "zzz": distribute_tensor(torch.ones(world * 4), mesh, [Shard(0)]),
    }
    try:
        dcp.save(
            state,
            storage_writer=_writer(url, so, part_size=5 << 20),
            planner=FailingPlanner(1, "zzz"),
        )
    except CheckpointException as exc:  # a BaseException: per-rank failures
        assert "injected failure" in repr(exc.failures), repr(exc)
    else:
        raise AssertionError("dcp.save succeeded although rank 1 failed")


def async_save_modes(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """dcp.async_save in thread mode, then in process mode; each loads back."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    for mode in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        target = f"{url}/{mode.value}"
        pending = dcp.async_save(
            sharded_state(world),
            storage_writer=_writer(target, so),
            async_checkpointer_type=mode,
        )
        result = getattr(pending, "upload_completion", pending)
        result.result(timeout=120)
        dist.barrier()
        state = sharded_state(world, empty=True)
        dcp.load(state, storage_reader=_reader(target, so))
        check_state(state, world)


# --------------------------------------------------------------------------- megatron

MEGATRON_ROWS, MEGATRON_COLS = 64, 96


def _megatron_state(rank: int, world: int, empty: bool) -> dict[str, Any]:
    """A Megatron sharded state dict: a TP-sharded weight, a factory with local
    closures (a fused gate/up projection stored as two tensors, as Megatron's GLU
    layers do), and a common object."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    rows = MEGATRON_ROWS // world
    full = torch.arange(MEGATRON_ROWS * MEGATRON_COLS, dtype=torch.float32).reshape(
        MEGATRON_ROWS, MEGATRON_COLS
    )
    local = full[rank * rows : (rank + 1) * rows].clone()
    fused = torch.cat([local * 2, local * 3])  # this rank's [gate; up] rows
    if empty:
        local, fused = torch.zeros_like(local), torch.zeros_like(fused)

    def sh_ten_build_fn(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
        gate, up = torch.chunk(t, 2)
        return {
            "gate": ShardedTensor.from_rank_offsets(f"{key}.gate", gate, (0, rank, world)),
            "up": ShardedTensor.from_rank_offsets(f"{key}.up", up, (0, rank, world)),
        }

    def sh_ten_merge_fn(sub_state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([sub_state_dict["gate"], sub_state_dict["up"]])

    return {
        "decoder.weight": ShardedTensor.from_rank_offsets(
            "decoder.weight", local, (0, rank, world)
        ),
        "decoder.fc1": ShardedTensorFactory(
            "decoder.fc1", fused, sh_ten_build_fn, sh_ten_merge_fn, replica_id=0
        ),
        "common": ShardedObject(
            "common.args", {"lr": 0.0 if empty else 0.1}, (1,), (0,), replica_id=rank
        ),
    }


def megatron_save_and_load(rank: int, world: int, url: str, so: dict[str, Any]) -> None:
    """Megatron's sharded state dict (with factories) through cloudckpt's DCP writer/reader."""
    import io as _io

    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )

    import cloudckpt
    from cloudckpt.errors import UnpicklableError

    # The seed issue: a plain checkpoint of this state cannot be pickled.
    try:
        cloudckpt.save(
            _megatron_state(rank, world, False), f"{url}-plain-{rank}.pt", **{"storage_options": so}
        )
    except UnpicklableError as exc:
        assert "sh_ten_build_fn" in str(exc) or "build_fn" in str(exc), str(exc)
        assert "torch.distributed.checkpoint" in str(exc), str(exc)
    else:
        raise AssertionError("saving a Megatron factory with cloudckpt.save should fail")

    # Save: resolve factories, translate to torch sharded tensors, save with DCP.
    state = _megatron_state(rank, world, False)
    apply_factories(state)
    flat_sd, _, _ = _replace_state_dict_keys_with_sharded_keys(state, False)
    pyt = mcore_to_pyt_state_dict(flat_sd, False)
    dcp.save(
        pyt,
        storage_writer=_writer(url, so),
        planner=MCoreSavePlanner(flatten_state_dict=False),
    )

    # Load, as Megatron's TorchDistLoadShardedStrategy does, with CloudStorageReader.
    target = _megatron_state(rank, world, True)
    factories, _ = extract_matching_values(target, lambda x: isinstance(x, ShardedTensorFactory))
    apply_factories(target)
    checks = [s for s in nested_values(target) if isinstance(s, ShardedTensor)]
    flat_sd, flat_map, rename = _replace_state_dict_keys_with_sharded_keys(target)
    pyt = mcore_to_pyt_state_dict(flat_sd, True)
    dcp.load(
        pyt,
        storage_reader=_reader(url, so),
        planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=checks),
    )
    loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
    loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_map, rename)
    _restore_dict_types(loaded, target)
    loaded = apply_factory_merges(loaded, factories)

    expected = _megatron_state(rank, world, False)
    assert torch.equal(loaded["decoder.weight"], expected["decoder.weight"].data)
    assert torch.equal(loaded["decoder.fc1"], expected["decoder.fc1"].data)
    common = loaded["common"]
    if isinstance(common, list):  # ShardedObjects come back as their byte streams
        common = common[0]
    if isinstance(common, _io.BytesIO):
        common = torch.load(common, weights_only=False)
    assert common == {"lr": 0.1}, common

"""DCP through cloudckpt's writer and reader across world sizes: save on 2 ranks, load on 3.

What an FSDP run resumed on a different number of hosts does. Each rank holds a
``Shard(0)`` DTensor of every tensor of the state (a view of the parent's copy, shared by
fork); the load gives each of the 3 ranks a different slice of every saved shard, so
the reader fetches byte spans of data objects, not whole objects. Ranks run through
:mod:`.ranks`: the store's client is built before the clock starts (as every system's
warm-up does), and every loading rank checks its slices against the state afterwards.
Compare with ``ceiling-2to3``, the same bytes moved by the same process layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx
from .ranks import Step, run_ranks

SAVE_RANKS = 2
LOAD_RANKS = 3
#: The load checks itself (each rank against its slice): there is no whole state to return.
SELF_CHECKED = True


def _local(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full`` under ``Shard(0)``: torch.chunk's split, with
    empty shards for the ranks left over when there are fewer rows than ranks."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[full.shape[0] :]


def _sharded(state: dict[str, torch.Tensor], world: int, rank: int, empty: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for name, full in state.items():
        local = _local(full, world, rank)
        if empty:
            local = torch.empty_like(local)
        out[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    return out


def _run(op: str, world: int, state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, Any]:
    """``dcp.save`` of ``state`` or ``dcp.load`` checked against it, on ``world`` ranks."""
    url, so = f"{ctx.url}/dcp", ctx.storage_options()

    def setup(rank: int, world: int) -> tuple[Step, Step]:
        target = _sharded(state, world, rank, empty=op == "load")
        open_url(url, resolve_options(storage_options=so))  # the client, before the clock

        def step() -> None:
            if op == "save":
                dcp.save(target, storage_writer=CloudStorageWriter(url, storage_options=so))
            else:
                dcp.load(target, storage_reader=CloudStorageReader(url, storage_options=so))

        def check() -> None:
            for name, full in state.items() if op == "load" else ():
                want = _local(full, world, rank)
                if not torch.equal(target[name].to_local(), want):
                    raise AssertionError(f"rank {rank}: loaded slice of {name} differs")

        return step, check

    return run_ranks(world, setup)


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, Any]:
    return _run("save", SAVE_RANKS, state, ctx)


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``template`` is the saved state: each rank checks its slices against it."""
    return _run("load", LOAD_RANKS, template, ctx)

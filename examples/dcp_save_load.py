"""Sharded checkpoints with torch.distributed.checkpoint and cloudckpt, on 2 CPU processes.

    python examples/dcp_save_load.py                       # a local temp directory
    python examples/dcp_save_load.py --url s3://bucket/dcp # any store (AWS_* env vars)

Two gloo ranks shard a small model's weights (DTensor, dim 0), save them with
``CloudStorageWriter``, then the checkpoint is loaded back three ways: by the same
2 ranks, by 1 process into full tensors (resharding), and after ``dcp.async_save``.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

SHAPES = {"embed": (4096, 256), "proj": (1024, 1024), "head": (256, 4096)}


def full_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def sharded(world: int, empty: bool = False) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,))
    weights = full_weights()
    if empty:
        weights = {k: torch.zeros_like(v) for k, v in weights.items()}
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in weights.items()}
    return {"model": model, "step": 0 if empty else 100}


def rank_main(rank: int, world: int, port: int, url: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        started = time.perf_counter()
        dcp.save(sharded(world), storage_writer=CloudStorageWriter(f"{url}/step-100"))
        if rank == 0:
            print(f"saved {url}/step-100 in {time.perf_counter() - started:.2f}s")

        state = sharded(world, empty=True)
        dcp.load(state, storage_reader=CloudStorageReader(f"{url}/step-100"))
        expected = sharded(world)
        for name, tensor in state["model"].items():  # type: ignore[attr-defined]
            assert torch.equal(tensor.to_local(), expected["model"][name].to_local())  # type: ignore[index]
        if rank == 0:
            print(f"loaded it back on {world} ranks: every shard matches")

        # async_save: returns once the state is staged in host memory.
        pending = dcp.async_save(
            sharded(world), storage_writer=CloudStorageWriter(f"{url}/step-200")
        )
        pending.result()  # (DCP's future) the checkpoint is committed
        if rank == 0:
            print(f"async_save committed {url}/step-200")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="where to checkpoint (default: a temp dir)")
    args = parser.parse_args()
    url = args.url or tempfile.mkdtemp(prefix="cloudckpt-dcp-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, url), nprocs=2)

    # Resharding 2 -> 1: one process (no process group) loads full tensors.
    state = {"model": {k: torch.zeros(shape) for k, shape in SHAPES.items()}, "step": 0}
    dcp.load(state, storage_reader=CloudStorageReader(f"{url}/step-100"))
    for name, tensor in full_weights().items():
        assert torch.equal(state["model"][name], tensor), name  # type: ignore[index]
    print(f"loaded {url}/step-100 into 1 process (resharded from 2), step {state['step']}")


if __name__ == "__main__":
    main()

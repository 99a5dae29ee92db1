"""DCP through cloudckpt's writer and reader across world sizes: save on 2 ranks, load on 3.

What an FSDP run resumed on a different number of hosts does. Each rank holds a
``Shard(0)`` DTensor of every tensor of the state (a view of the parent's copy, shared by
fork); the load gives each of the 3 ranks a different slice of every saved shard, so
the reader fetches byte spans of data objects, not whole objects. Ranks are forked
gloo processes on 127.0.0.1; the time is the slowest rank's, from the barrier before
``dcp.save``/``dcp.load`` to the barrier after, so process start-up and creating the
store's client (done before the barrier, as every system's warm-up does) are not counted;
the CPU time is the ranks' own between those barriers, summed; the peak extra RSS is
the largest rank's.
Every loading rank checks its slices against the state it was cut from.
"""

from __future__ import annotations

import gc
import json
import resource
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx

SAVE_RANKS = 2
LOAD_RANKS = 3
#: The load checks itself (each rank against its slice): there is no whole state to return.
SELF_CHECKED = True
HOST = "127.0.0.1"


def _sharded(state: dict[str, torch.Tensor], world: int, rank: int, empty: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for name, full in state.items():
        local = torch.chunk(full, world, dim=0)[rank]
        if empty:
            local = torch.empty_like(local)
        out[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rss_after_reset() -> int:
    """VmRSS, after resetting VmHWM to it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _rank(
    rank: int, world: int, port: int, op: str, state: Any, url: str, so: Any, out: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world)
    try:
        target = _sharded(state, world, rank, empty=op == "load")
        # The store's client exists before the clock starts, as in every system's warm-up.
        open_url(url, resolve_options(storage_options=so))
        gc.collect()
        rss0 = _rss_after_reset()
        dist.barrier()
        t0, cpu0 = time.perf_counter(), _cpu()
        if op == "save":
            dcp.save(target, storage_writer=CloudStorageWriter(url, storage_options=so))
        else:
            reader = CloudStorageReader(url, storage_options=so)
            dcp.load(target, storage_reader=reader)
        cpu = _cpu() - cpu0
        peak = _status_bytes("VmHWM") - rss0
        dist.barrier()
        seconds = time.perf_counter() - t0
        if op == "load":
            for name, full in state.items():
                want = torch.chunk(full, world, dim=0)[rank]
                if not torch.equal(target[name].to_local(), want):
                    raise AssertionError(f"rank {rank}: loaded slice of {name} differs")
        Path(out, f"{rank}.json").write_text(
            json.dumps({"seconds": seconds, "cpu_s": cpu, "peak": peak})
        )
    finally:
        dist.destroy_process_group()


def _run(op: str, world: int, state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="cloudckpt-bench-reshard-") as out:
        args = (world, port, op, state, f"{ctx.url}/dcp", ctx.storage_options(), out)
        # Forked ranks share the parent's heap copy-on-write; the first garbage collection
        # in a rank would copy all of it (0.2 s, inside the timed region). torchrun's fresh
        # processes have no such heap: freeze it, so collections leave it alone.
        gc.freeze()
        try:
            torch.multiprocessing.start_processes(
                _rank, args=args, nprocs=world, join=True, start_method="fork"
            )
        finally:
            gc.unfreeze()
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
    return {
        "seconds": max(r["seconds"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks),
        "peak_extra_rss": max(r["peak"] for r in ranks),
        "ranks": world,
    }


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, Any]:
    return _run("save", SAVE_RANKS, state, ctx)


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``template`` is the saved state: each rank checks its slices against it."""
    return _run("load", LOAD_RANKS, template, ctx)

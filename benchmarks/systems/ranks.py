"""Run one timed step on several forked ranks (gloo on 127.0.0.1), as a multi-host job would.

``run_ranks(world, setup)`` forks ``world`` processes; each joins a gloo group and calls
``setup(rank, world)``, which prepares its part untimed and returns ``(step, check)``.
Between a barrier before ``step()`` and one after it the rank measures wall time, its
own CPU time (with its waited-for children's) and its peak extra RSS; ``check()`` then
runs untimed. The result is the slowest rank's time, the ranks' CPU summed and the
largest rank's peak. With ``CLOUDCKPT_BENCH_PROFILE=DIR`` each rank's step runs under
cProfile, saved to DIR.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import resource
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"

Step = Callable[[], Any]
Setup = Callable[[int, int], tuple[Step, Step]]


def _cpu() -> float:
    """This rank's CPU, with that of the children it has waited for (megatron-core's
    writer processes)."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


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


def _rank(rank: int, world: int, port: int, setup: Setup, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world)
    try:
        step, check = setup(rank, world)
        gc.collect()
        rss0 = _rss_after_reset()
        dist.barrier()
        profile_dir = os.environ.get("CLOUDCKPT_BENCH_PROFILE")
        profiler = cProfile.Profile() if profile_dir else None
        t0, cpu0 = time.perf_counter(), _cpu()
        if profiler is not None:
            profiler.runcall(step)
        else:
            step()
        cpu = _cpu() - cpu0
        if profiler is not None:
            profiler.dump_stats(str(Path(profile_dir or ".", f"rank{rank}-of-{world}.prof")))
        peak = _status_bytes("VmHWM") - rss0
        dist.barrier()
        seconds = time.perf_counter() - t0
        check()
        Path(out, f"{rank}.json").write_text(
            json.dumps({"seconds": seconds, "cpu_s": cpu, "peak": peak})
        )
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, setup: Setup) -> dict[str, Any]:
    """Run ``setup``'s step on ``world`` forked ranks; the figures for the worker."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="cloudckpt-bench-ranks-") as out:
        # Forked ranks share the parent's heap copy-on-write; the first garbage collection
        # in a rank would copy all of it (0.2 s, inside the timed region). torchrun's fresh
        # processes have no such heap: freeze it, so collections leave it alone.
        gc.freeze()
        try:
            torch.multiprocessing.start_processes(
                _rank, args=(world, port, setup, out), nprocs=world, join=True, start_method="fork"
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

"""Run a function on several gloo ranks on 127.0.0.1 (the multi-process tests' launcher).

:func:`run_ranks` forks ``world_size`` processes, each joining a gloo process group on
a free 127.0.0.1 port, runs ``fn(rank, world_size, *args)`` in each, and fails if any
rank fails or the group outlives ``timeout`` seconds.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


_GLOO_TEARDOWN_HANGS = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5)


def _entry(rank: int, fn: Any, world_size: int, port: int, args: tuple[Any, ...]) -> None:
    # A forked child must not use the parent's OpenMP pool (GNU OpenMP hangs there).
    torch.set_num_threads(1)
    # Its collections leave the heap it inherited alone: by the middle of a session that
    # is gigabytes, and each full collection in a rank would touch (and copy) all of it.
    gc.freeze()
    os.environ["MASTER_ADDR"] = HOST
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
        if _GLOO_TEARDOWN_HANGS:
            # torch 2.4's ProcessGroupGloo destructor can hang joining its threads in a
            # forked rank (seen with py-spy); the rank's work is done and checked.
            os._exit(0)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Any, world_size: int, *args: Any, timeout: float = 180) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Ranks are forked (torch is already imported, so each starts in well under a
    second on a busy 2-core machine); ``dcp.async_save`` in process mode still
    starts its own checkpoint processes with ``spawn``, which is what tests pickling.
    """
    ctx = torch.multiprocessing.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args),
        nprocs=world_size,
        join=False,
        start_method="fork",
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout}s")

"""Write a checkpoint with megatron-core's own ``dist_checkpointing.save`` (torch_dist).

``python megatron_writer.py DIR`` saves :func:`state` in one process (a gloo group of
one) on the CPU, patching only what megatron-core's saver assumes of a GPU: the
results queue of its writer processes (a spawn-context manager, replaced by a fork
queue that waits for a result still in its pipe) and ``torch.cuda`` calls.
``tests/dcp/data/megatron-0.15.3`` was written by this script with megatron-core 0.15.3
on ``PYTHONPATH`` (its unpacked wheel, not installed).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

#: The values each saved item holds.
WEIGHT = torch.arange(12, dtype=torch.float32).reshape(4, 3)
OBJECT = {"lr": 0.1}


def state() -> dict[str, Any]:
    """A sharded state dict of one rank: a tensor and a sharded object."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    return {
        "w": ShardedTensor.from_rank_offsets("w", WEIGHT.clone(), (0, 0, 1)),
        "obj": ShardedObject("obj", dict(OBJECT), (1,), (0,), replica_id=0),
    }


class _PatientQueue(multiprocessing.queues.Queue):  # type: ignore[type-arg]
    """A fork queue whose ``get_nowait`` waits for an item still in its pipe.

    megatron-core reads its writer processes' results with ``get_nowait()`` once they
    have exited. Through its own manager queue the item is there by then; through a
    plain queue it may still be on its way from the exited writer's feeder thread, and
    under load megatron-core then fails the save ("results_queue should not be empty").
    """

    def __init__(self) -> None:
        super().__init__(ctx=multiprocessing.get_context("fork"))

    def get_nowait(self) -> Any:
        return self.get(timeout=120)


def _cpu_only() -> None:
    """Let megatron-core's saver run without a GPU, in this process only."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = _PatientQueue
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def main(out: str) -> None:
    """Save :func:`state` to ``out`` with megatron-core's torch_dist backend."""
    from megatron.core import dist_checkpointing

    _cpu_only()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        os.makedirs(out, exist_ok=True)
        dist_checkpointing.save(state(), out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""Train a tiny FSDP2 model with torchtitan's checkpoint code on gloo CPU ranks.

    python titan_run.py URL STORAGE_OPTIONS_JSON REPORT_DIR [--world N] [--steps S]
        [--interval I] [--keep K] [--async] [--hang-after N] [--initial URL]

torchtitan's Trainer needs CUDA; its ``CheckpointManager`` does not. The checkpointer is
built the way the Trainer builds it (``config.checkpoint.build(...)``) over stand-ins for
the Trainer's parts: the model parts (FSDP2-sharded across the ranks), an optimizers
container and an lr schedulers container that use torch's distributed state-dict API as
torchtitan's do, a stateful dataloader position and the train state. Each rank
``load``s, then trains and calls ``save`` every step as the Trainer does. Rank 0 writes
what every state holds (whole tensors) to REPORT_DIR: ``loaded.pt`` after the load,
``state-N.pt`` after step N. ``--hang-after N`` blocks after step N's save (the test
kills the run there). ``--initial URL``: torchtitan's ``initial_load_path`` (model only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cloudckpt.torchtitan import CloudCheckpointManager
from ranks import run_ranks

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Optimizers(Stateful):
    """One AdamW, saved and loaded by parameter name (torchtitan's container does too)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=0.05)

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim, options=FLAT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state_dict, options=FLAT)


class Schedulers(Stateful):
    def __init__(self, optimizers: Optimizers) -> None:
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizers.optim, 2, gamma=0.5)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class Position(Stateful):
    """The dataloader: where each rank is in its data."""

    def __init__(self) -> None:
        self.batches = 0

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = int(state_dict["batches"])


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def whole(value: Any) -> Any:
    """``value`` with every DTensor gathered (a collective: every rank calls it)."""
    if isinstance(value, DTensor):
        return value.full_tensor().clone()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: whole(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [whole(v) for v in value]
    return value


def snapshot(model, optimizers, schedulers, position, train_state) -> dict[str, Any]:
    return {
        "model": whole(model.state_dict()),
        "optimizer": whole(optimizers.state_dict()),
        "lr_scheduler": whole(schedulers.state_dict()),
        "dataloader": position.state_dict(),
        "step": train_state.step,
    }


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = Optimizers(model)
    schedulers = Schedulers(optimizers)
    position = Position()
    train_state = TrainState()
    config = CloudCheckpointManager.Config(
        enable=True,
        folder=args.url,
        interval=args.interval,
        keep_latest_k=args.keep,
        async_mode="async" if args.async_save else "disabled",
        last_save_model_only=False,
        initial_load_path=args.initial or None,
        initial_load_model_only=bool(args.initial),
        cloud_options={"storage_options": json.loads(args.storage_options)},
    )
    checkpointer = config.build(
        dataloader=position,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=args.report,
    )

    def report(name: str) -> None:
        state = snapshot(model, optimizers, schedulers, position, train_state)
        if rank == 0:
            torch.save(state, os.path.join(args.report, name))

    if checkpointer.load(step=-1):
        report("loaded.pt")
    while train_state.step < args.steps:
        train_state.step += 1
        gen = torch.Generator().manual_seed(1000 * position.batches + rank)
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
        loss.backward()
        optimizers.optim.step()
        optimizers.optim.zero_grad()
        schedulers.scheduler.step()
        position.batches += 1
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        report(f"state-{train_state.step}.pt")
        if train_state.step == args.hang_after:
            checkpointer.maybe_wait_for_saving()
            dist.barrier()
            threading.Event().wait()  # the test kills the run here
    checkpointer.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("storage_options")
    p.add_argument("report")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--keep", type=int, default=0)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--hang-after", type=int, default=0)
    p.add_argument("--initial", default="")
    args = p.parse_args()
    run_ranks(train, args.world, args, timeout=240)


if __name__ == "__main__":
    main()

"""Train a tiny GPT-2 with the Hugging Face Trainer and ``CloudCheckpointCallback``,
in a process of its own, or as one of several DDP processes on gloo when the launcher's
variables are set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...; the tests also
import its builders).

    python run_train.py URL OUTPUT_DIR STORAGE_OPTIONS_JSON --max-steps N
        [--resume] [--block-at N] [--kill-in-upload RANK:STEP]
        [--fail-upload RANK:STEP] [--output-per-rank] [--zero STAGE] [--report FILE]

``--resume`` fetches the newest committed checkpoint and resumes from it;
``--block-at N`` stops the training thread forever at the end of step N (the uploads
go on), for the test to kill the process; ``--kill-in-upload`` SIGKILLs rank RANK once
its files of step STEP are uploaded (before the commit); ``--fail-upload`` makes that
rank's upload of that step fail; ``--output-per-rank`` gives each rank an
``OUTPUT_DIR/rank-R`` of its own (as one node each); ``--zero STAGE`` trains under the
Trainer's DeepSpeed integration (``TrainingArguments(deepspeed=...)``, ZeRO stage STAGE,
torch Adam, fp32, gloo; see :func:`deepspeed_arguments`); ``--report`` writes the
logged losses (with several processes to FILE.RANK), or the error ``train()`` raised
(exit code 3).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

import cloudckpt.manager.tiers
from cloudckpt.errors import CloudCkptError, StorageError
from cloudckpt.hf import CloudCheckpointCallback, fetch_latest

SEED = 7


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (the same for every seed-7 run), labels = inputs."""

    def __init__(self, n: int = 64, length: int = 8, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model() -> GPT2LMHeadModel:
    """A one-layer GPT-2 built from a config (nothing downloaded), no dropout."""
    set_seed(SEED)
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def arguments(output_dir: str, max_steps: int, **changes: Any) -> TrainingArguments:
    """Deterministic CPU training: a loss logged every step, a save every 4 steps."""
    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": max_steps,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_steps": 4,
        "save_total_limit": 2,
        "report_to": [],
        "use_cpu": True,
        "seed": SEED,
        "data_seed": SEED,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "remove_unused_columns": False,
    }
    settings.update(changes)
    return TrainingArguments(**settings)


def tiny_trainer(
    output_dir: str, max_steps: int, callbacks: Sequence[Any] = (), **changes: Any
) -> Trainer:
    """A Trainer of :func:`tiny_model` on :class:`Tokens` with :func:`arguments`."""
    return Trainer(
        model=tiny_model(),
        args=arguments(output_dir, max_steps, **changes),
        train_dataset=Tokens(),
        callbacks=list(callbacks),
    )


def losses(trainer: Trainer) -> list[list[float]]:
    """The logged training losses: [step, loss] per logged step."""
    return [[e["step"], e["loss"]] for e in trainer.state.log_history if "loss" in e]


def deepspeed_arguments(stage: int) -> dict[str, Any]:
    """TrainingArguments changes for the Trainer's DeepSpeed integration on CPU: ZeRO
    ``stage``, fp32, torch's Adam (no DeepSpeed op built), the Trainer's own schedule.

    Accelerate (1.16) takes the DeepSpeed path only on a device with a distributed
    backend of its own (CUDA's nccl, ...): on a CPU-only host it would count one process
    while DeepSpeed runs two. So accelerate is told here that the device is the CPU with
    gloo, as DeepSpeed's CPU accelerator has it; the Trainer, accelerate's DeepSpeed
    preparation and the DeepSpeed engine are otherwise untouched."""
    import accelerate.state
    import deepspeed.ops

    # The CPU accelerator compiles its shared-memory collectives with g++ on the first
    # init_distributed (about 100 s); gloo alone does here.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    def cpu_device(check_available: bool = True) -> tuple[str, Any]:
        return "cpu", torch.cpu

    accelerate.state.get_torch_accelerator_backend = cpu_device
    accelerate.state.get_distributed_backend = lambda device_type: "gloo"
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
    }
    return {"deepspeed": config, "ddp_backend": "gloo", "use_cpu": False}


class BlockAt(TrainerCallback):
    """Stop the training thread for good at the end of step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            threading.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("output_dir")
    p.add_argument("storage_options")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--block-at", type=int, default=0)
    p.add_argument("--kill-in-upload", default="")
    p.add_argument("--fail-upload", default="")
    p.add_argument("--output-per-rank", action="store_true")
    p.add_argument("--zero", type=int, default=None)
    p.add_argument("--report", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    me = int(os.environ.get("RANK", "0"))
    report = args.report if world == 1 else f"{args.report}.{me}"
    if args.output_per_rank:
        args.output_dir = f"{args.output_dir}/rank-{me}"
    if args.kill_in_upload or args.fail_upload:
        bad_rank, bad_step = (int(v) for v in (args.kill_in_upload or args.fail_upload).split(":"))
        real_copy = cloudckpt.manager.tiers.copy_tree  # what a drain sends files with

        def copy_then_die(src, src_prefix, dst, dst_prefix, *rest, **kw):  # type: ignore[no-untyped-def]
            mine = me == bad_rank and f"step-{bad_step:09d}/" in dst_prefix
            if mine and args.fail_upload:
                raise StorageError(f"refused upload to {dst_prefix}")
            copied = real_copy(src, src_prefix, dst, dst_prefix, *rest, **kw)
            if mine:
                os.kill(os.getpid(), signal.SIGKILL)  # kill -9 mid-save: no commit yet
            return copied

        cloudckpt.manager.tiers.copy_tree = copy_then_die  # type: ignore[assignment]
    opts = json.loads(args.storage_options)
    callbacks: list[Any] = [CloudCheckpointCallback(args.url, storage_options=opts)]
    if args.block_at:
        callbacks.append(BlockAt(args.block_at))
    changes: dict[str, Any] = {"ddp_backend": "gloo"} if world > 1 else {}
    if args.zero is not None:
        changes.update(deepspeed_arguments(args.zero))
    trainer = tiny_trainer(args.output_dir, args.max_steps, callbacks, **changes)
    # After the Trainer is made: with several processes, fetch_latest is a collective.
    resume = fetch_latest(args.url, args.output_dir, storage_options=opts) if args.resume else None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except CloudCkptError as exc:  # the report says which error each rank raised
        if not args.report:
            raise
        cause = exc.__cause__
        with open(report, "w") as f:
            json.dump(
                {
                    "error": type(exc).__name__,
                    "message": str(exc),
                    "cause": type(cause).__name__ if cause else None,
                },
                f,
            )
        raise SystemExit(3) from exc
    if args.report:
        with open(report, "w") as f:
            json.dump({"resumed_from": resume, "losses": losses(trainer)}, f)


if __name__ == "__main__":
    main()

"""Train a tiny GPT-2 with the Hugging Face Trainer and ``CloudCheckpointCallback``,
in a process of its own (the tests also import its builders).

    python run_train.py URL OUTPUT_DIR STORAGE_OPTIONS_JSON --max-steps N
        [--resume] [--block-at N] [--report FILE]

``--resume`` fetches the newest committed checkpoint and resumes from it;
``--block-at N`` stops the training thread forever at the end of step N (the uploads
go on), for the test to kill the process; ``--report`` writes the logged losses.
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--report", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    opts = json.loads(args.storage_options)
    callbacks: list[Any] = [CloudCheckpointCallback(args.url, storage_options=opts)]
    if args.block_at:
        callbacks.append(BlockAt(args.block_at))
    trainer = tiny_trainer(args.output_dir, args.max_steps, callbacks)
    resume = fetch_latest(args.url, args.output_dir, storage_options=opts) if args.resume else None
    trainer.train(resume_from_checkpoint=resume)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"resumed_from": resume, "losses": losses(trainer)}, f)


if __name__ == "__main__":
    main()

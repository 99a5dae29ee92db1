"""s3torchconnector's ``S3Checkpoint`` (AWS CRT client): torch.save into its writer,
torch.load from its reader. Path-style addressing, as the local server needs."""

from __future__ import annotations

import torch
from s3torchconnector import S3Checkpoint, S3ClientConfig

from .common import Ctx

_CHECKPOINT: list[S3Checkpoint] = []


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create the client, as a process that checkpoints already has."""
    _checkpoint(ctx)


def _checkpoint(ctx: Ctx) -> S3Checkpoint:
    if not _CHECKPOINT:
        _CHECKPOINT.append(
            S3Checkpoint(
                region=ctx.region,
                endpoint=ctx.endpoint,
                s3client_config=S3ClientConfig(force_path_style=True),
            )
        )
    return _CHECKPOINT[0]


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    with _checkpoint(ctx).writer(f"{ctx.url}/ckpt.pt") as writer:
        torch.save(state, writer)


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with _checkpoint(ctx).reader(f"{ctx.url}/ckpt.pt") as reader:
        return torch.load(reader, weights_only=True)

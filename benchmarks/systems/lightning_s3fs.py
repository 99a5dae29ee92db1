"""Lightning's ``TorchCheckpointIO`` on an ``s3://`` path: fsspec + s3fs underneath.

s3fs finds the server through the standard ``AWS_ENDPOINT_URL`` / ``AWS_*`` environment
variables, which the benchmark sets for every worker process.
"""

from __future__ import annotations

import fsspec
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .common import Ctx


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create s3fs's (cached) filesystem and its client with one listing."""
    fsspec.filesystem("s3").ls(ctx.bucket)


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    TorchCheckpointIO().save_checkpoint(state, f"{ctx.url}/ckpt.pt")


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return TorchCheckpointIO().load_checkpoint(f"{ctx.url}/ckpt.pt", weights_only=True)

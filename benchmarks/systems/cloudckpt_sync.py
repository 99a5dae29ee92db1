"""cloudckpt.save / cloudckpt.load with default options."""

from __future__ import annotations

import torch

import cloudckpt
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create the store's client, as a process that checkpoints already has."""
    open_url(ctx.url, resolve_options(storage_options=ctx.storage_options()))


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    cloudckpt.save(state, f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return cloudckpt.load(f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())

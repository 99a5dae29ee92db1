"""cloudckpt.save / cloudckpt.load with default options."""

from __future__ import annotations

import torch

import cloudckpt

from .common import Ctx


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    cloudckpt.save(state, f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return cloudckpt.load(f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())

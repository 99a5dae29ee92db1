"""cloudckpt.save / cloudckpt.load with ``CLOUDCKPT_UNPICKLER=torch``: every unpickle
through torch's own weights-only unpickler (docs/security.md, "The switch"). The row
beside ``cloudckpt`` is what the switch costs."""

from __future__ import annotations

import torch

import cloudckpt

from .cloudckpt_sync import save, warm
from .common import Ctx

__all__ = ["load", "save", "warm"]


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cloudckpt.set_unpickler("torch")
    try:
        return cloudckpt.load(f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())
    finally:
        cloudckpt.set_unpickler(None)

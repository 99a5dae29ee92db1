"""The Megatron scenario's ceiling: 2 ranks PUT, then the same 2 GET, the checkpoint's bytes.

``ceiling-2to3``'s transfer (:mod:`.ceiling_ranks`: botocore, zero-copy parts, ranged
GETs into anonymous memory, cloudckpt's default sizes and concurrencies) run by the
Megatron systems' process layout, for exactly the bytes of their checkpoint's tensors
(``GptShape.nbytes``), pre-built: the raw-transfer bound of that job on this machine.
"""

from __future__ import annotations

from typing import Any

import torch

from . import ceiling_ranks
from .common import Ctx

__all__ = ["SELF_CHECKED", "load", "own_state", "save", "warm"]

RANKS = 2
SELF_CHECKED = True
warm = ceiling_ranks.warm  # the clients, built before the ranks fork


def own_state(spec: dict[str, Any]) -> tuple[bytearray, int]:
    """``spec['bytes']`` random bytes (the worker's matrices would round the size)."""
    data = bytearray(spec["bytes"])
    gen = torch.Generator().manual_seed(spec["seed"])
    torch.frombuffer(data, dtype=torch.uint8).random_(0, 256, generator=gen)
    return data, len(data)


def save(data: bytearray, ctx: Ctx) -> dict[str, Any]:
    return ceiling_ranks.put_on(RANKS, data, ctx)


def load(ctx: Ctx, template: Any) -> dict[str, Any]:
    return ceiling_ranks.get_on(RANKS, ctx)

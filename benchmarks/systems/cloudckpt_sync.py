"""cloudckpt.save / cloudckpt.load with default options.

Its warm-up also times ``torch.load(weights_only=True)`` of the same state's archive
already in memory, the reference of issue 15's "x torch.load from memory" target (for
states of at most ``TORCH_LOAD_MAX`` bytes: it holds two more copies of the state).
"""

from __future__ import annotations

import io
import time

import torch

import cloudckpt
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx

TORCH_LOAD_MAX = 1536 * 1024 * 1024


def torch_load_from_memory_seconds(state: object) -> float | None:
    """One ``torch.load(weights_only=True)`` of ``torch.save(state)``'s bytes in memory
    (None for an archive over ``TORCH_LOAD_MAX`` bytes)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    if buf.tell() > TORCH_LOAD_MAX:
        return None
    t0 = time.perf_counter()
    loaded = torch.load(io.BytesIO(buf.getbuffer()), weights_only=True)
    seconds = time.perf_counter() - t0
    del loaded
    return seconds


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, float]:
    """Untimed: create the store's client, as a process that checkpoints already has;
    and the torch.load reference (see the module's docstring)."""
    open_url(ctx.url, resolve_options(storage_options=ctx.storage_options()))
    seconds = torch_load_from_memory_seconds(state)
    return {} if seconds is None else {"torch_load_memory_s": seconds}


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    cloudckpt.save(state, f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return cloudckpt.load(f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options())

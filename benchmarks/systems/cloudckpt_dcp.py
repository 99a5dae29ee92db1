"""torch.distributed.checkpoint save/load through cloudckpt.dcp's writer and reader."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx, empty_like


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create the store's client, as a process that checkpoints already has."""
    open_url(ctx.url, resolve_options(storage_options=ctx.storage_options()))


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    writer = CloudStorageWriter(f"{ctx.url}/dcp", storage_options=ctx.storage_options())
    dcp.save(state, storage_writer=writer)


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = empty_like(template)
    reader = CloudStorageReader(f"{ctx.url}/dcp", storage_options=ctx.storage_options())
    dcp.load(out, storage_reader=reader)
    return out

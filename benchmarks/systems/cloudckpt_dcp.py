"""torch.distributed.checkpoint save/load through cloudckpt.dcp's writer and reader."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

from .common import Ctx, empty_like


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    writer = CloudStorageWriter(f"{ctx.url}/dcp", storage_options=ctx.storage_options())
    dcp.save(state, storage_writer=writer)


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = empty_like(template)
    reader = CloudStorageReader(f"{ctx.url}/dcp", storage_options=ctx.storage_options())
    dcp.load(out, storage_reader=reader)
    return out

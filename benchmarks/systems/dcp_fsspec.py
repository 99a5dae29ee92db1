"""torch.distributed.checkpoint with its own ``FsspecWriter`` / ``FsspecReader`` over s3fs
(the server is found through the ``AWS_*`` environment variables)."""

from __future__ import annotations

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from .common import Ctx, empty_like


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create s3fs's (cached) filesystem and its client with one listing."""
    fsspec.filesystem("s3").ls(ctx.bucket)


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    dcp.save(state, storage_writer=FsspecWriter(f"{ctx.url}/dcp"))


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = empty_like(template)
    dcp.load(out, storage_reader=FsspecReader(f"{ctx.url}/dcp"))
    return out

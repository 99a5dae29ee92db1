"""``cloudckpt export``: the model saved as a DCP checkpoint (``CloudStorageWriter``, the
save column), then exported to safetensors on the same store (``export_safetensors`` with
its defaults: 5GB shards, so one ``model.safetensors``; the load column). The export is
checked after the clock: the file, read by ``load_safetensors``, equals the state.

Its target is against the ceiling's GET plus PUT of the same bytes (an export reads
every byte once and writes it once): ``export_vs_get_put`` is the export's time over
that sum."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt.dcp import CloudStorageWriter
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx
from .st_model import own_state

__all__ = ["load", "own_state", "save", "verify", "warm"]

SELF_CHECKED = True


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    open_url(f"{ctx.url}/dcp", resolve_options(storage_options=ctx.storage_options()))


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    writer = CloudStorageWriter(f"{ctx.url}/dcp", storage_options=ctx.storage_options())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)


def load(ctx: Ctx, template: Any) -> dict[str, Any]:
    result = cloudckpt.export_safetensors(
        f"{ctx.url}/dcp", f"{ctx.url}/export/", storage_options=ctx.storage_options()
    )
    return {"written_bytes": result.size, "files": len(result.files)}


def verify(ctx: Ctx, state: dict[str, torch.Tensor]) -> None:
    got = cloudckpt.load_safetensors(f"{ctx.url}/export/", storage_options=ctx.storage_options())
    if set(got) != set(state) or not all(torch.equal(got[k], v) for k, v in state.items()):
        raise AssertionError("the exported safetensors differ from the saved state")

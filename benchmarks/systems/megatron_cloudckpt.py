"""The Megatron checkpoint through ``cloudckpt.megatron.save`` / ``load`` to ``s3://``.

megatron-core's ``torch_dist`` layout written by cloudckpt's DCP writer, read by its
reader; 2 tensor-parallel ranks (:mod:`.megatron_gpt`). Each rank builds its store's
client before the clock starts. Compare with ``megatron-msc`` (megatron-core's own
writer with multi-storage-client) and ``ceiling-2to2`` (the same bytes, raw).
"""

from __future__ import annotations

from typing import Any

import cloudckpt.megatron as cm
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx
from .megatron_gpt import own_state, run_load, run_save

__all__ = ["SELF_CHECKED", "load", "own_state", "save"]

SELF_CHECKED = True


def _url(ctx: Ctx) -> str:
    return f"{ctx.url}/megatron"


def _prepare(ctx: Ctx) -> None:
    open_url(_url(ctx), resolve_options(storage_options=ctx.storage_options()))


def save(model: Any, ctx: Ctx) -> dict[str, Any]:
    so = ctx.storage_options()
    return run_save(model, _url(ctx), lambda: _prepare(ctx),
                    lambda sharded, url: cm.save(sharded, url, storage_options=so))  # fmt: skip


def load(ctx: Ctx, model: Any) -> dict[str, Any]:
    so = ctx.storage_options()
    return run_load(model, _url(ctx), lambda: _prepare(ctx),
                    lambda sharded, url: cm.load(sharded, url, storage_options=so))  # fmt: skip

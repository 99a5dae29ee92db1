"""The Megatron checkpoint through megatron-core's own ``dist_checkpointing.save`` / ``load``
with multi-storage-client, on ``msc://``: what Megatron-LM does with ``--ckpt-format
torch_dist`` and an object-store path.

The same model and ranks as ``megatron-cloudckpt`` (:mod:`.megatron_gpt`), megatron's
default strategies (``torch_dist``: its ``FileSystemWriterAsync`` writes each rank's
files from forked writer processes, through ``msc.open``; the load reads through
``msc.torch.MultiStorageFileSystemReader``). The profile is ``msc``'s
(:func:`.msc_torch.configure`); its client is built before the ranks fork. On CPU,
megatron's CUDA synchronization calls are made no-ops in each rank.
"""

from __future__ import annotations

from typing import Any

from . import msc_torch
from .common import Ctx
from .megatron_gpt import cpu_friendly_megatron, own_state, run_load, run_save

__all__ = ["SELF_CHECKED", "configure", "load", "own_state", "save", "warm"]

SELF_CHECKED = True
configure = msc_torch.configure
warm = msc_torch.warm


def _url(ctx: Ctx) -> str:
    return f"msc://{msc_torch.PROFILE}/{ctx.prefix}/megatron"


def _prepare() -> None:
    from megatron.core.msc_utils import MultiStorageClientFeature

    cpu_friendly_megatron()
    MultiStorageClientFeature.enable()


def _save(sharded: dict[str, Any], url: str) -> None:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded, url)


def _load(sharded: dict[str, Any], url: str) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    loaded: dict[str, Any] = dist_checkpointing.load(sharded, url)
    return loaded


def save(model: Any, ctx: Ctx) -> dict[str, Any]:
    return run_save(model, _url(ctx), _prepare, _save)


def load(ctx: Ctx, model: Any) -> dict[str, Any]:
    return run_load(model, _url(ctx), _prepare, _load)

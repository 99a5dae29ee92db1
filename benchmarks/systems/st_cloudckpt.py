"""cloudckpt's safetensors: ``save_safetensors`` of the model as one ``model.safetensors``
(a 1 GiB model is one file under transformers' 5GB shards), ``load_safetensors`` back."""

from __future__ import annotations

from typing import Any

import torch

import cloudckpt
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url

from .common import Ctx
from .st_model import own_state

__all__ = ["load", "own_state", "save", "warm"]


def _url(ctx: Ctx) -> str:
    return f"{ctx.url}/hf/model.safetensors"


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: the store's client (as a process that loads a model already has one)."""
    open_url(_url(ctx), resolve_options(storage_options=ctx.storage_options()))


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    cloudckpt.save_safetensors(state, _url(ctx), storage_options=ctx.storage_options())


def load(ctx: Ctx, template: Any) -> dict[str, torch.Tensor]:
    return cloudckpt.load_safetensors(_url(ctx), storage_options=ctx.storage_options())

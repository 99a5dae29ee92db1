"""The usual way today: ``safetensors.torch.save`` to bytes and boto3's ``upload_fileobj``;
``download_fileobj`` into memory and ``safetensors.torch.load`` (boto3's default transfer
settings: 8 MiB parts, 10 threads)."""

from __future__ import annotations

import io
from typing import Any

import boto3
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .common import Ctx
from .st_model import own_state

__all__ = ["load", "own_state", "save", "warm"]

_CLIENT: list[Any] = []


def _client(ctx: Ctx) -> Any:
    if not _CLIENT:
        _CLIENT.append(
            boto3.client(
                "s3",
                endpoint_url=ctx.endpoint,
                aws_access_key_id=ctx.access_key,
                aws_secret_access_key=ctx.secret_key,
                region_name=ctx.region,
            )
        )
    return _CLIENT[0]


def _key(ctx: Ctx) -> str:
    return f"{ctx.prefix}/hf/model.safetensors"


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    _client(ctx)


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    data = st_save(state, metadata={"format": "pt"})
    _client(ctx).upload_fileobj(io.BytesIO(data), ctx.bucket, _key(ctx))


def load(ctx: Ctx, template: Any) -> dict[str, torch.Tensor]:
    buf = io.BytesIO()
    _client(ctx).download_fileobj(ctx.bucket, _key(ctx), buf)
    return st_load(buf.getvalue())

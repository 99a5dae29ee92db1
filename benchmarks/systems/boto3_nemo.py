"""What NeMo's S3 CheckpointIO does: torch.save into memory, then boto3 ``upload_fileobj``
with TransferConfig(64 MiB chunks, 10 threads); load is ``download_fileobj`` into memory,
then torch.load. A default boto3 client (as users get it) pointed at the server."""

from __future__ import annotations

import io
from typing import Any

import boto3
import torch
from boto3.s3.transfer import TransferConfig

from .common import Ctx

MiB = 1024 * 1024
CONFIG = TransferConfig(
    multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB, max_concurrency=10
)


_CLIENT: list[Any] = []


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed: create the client, as a process that checkpoints already has."""
    _client(ctx)


def _client(ctx: Ctx) -> Any:
    if _CLIENT:
        return _CLIENT[0]
    _CLIENT.append(_new_client(ctx))
    return _CLIENT[0]


def _new_client(ctx: Ctx) -> Any:
    return boto3.session.Session().client(
        "s3",
        endpoint_url=ctx.endpoint,
        aws_access_key_id=ctx.access_key,
        aws_secret_access_key=ctx.secret_key,
        region_name=ctx.region,
    )


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    _client(ctx).upload_fileobj(buf, ctx.bucket, f"{ctx.prefix}/ckpt.pt", Config=CONFIG)


def load(ctx: Ctx, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buf = io.BytesIO()
    _client(ctx).download_fileobj(ctx.bucket, f"{ctx.prefix}/ckpt.pt", buf, Config=CONFIG)
    buf.seek(0)
    return torch.load(buf, weights_only=True)

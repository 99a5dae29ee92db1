"""The Run:ai model streamer (``runai-model-streamer`` with its S3 backend, a C++ reader):
``SafetensorsStreamer.stream_file`` of ``s3://`` with the server's credentials and path
addressing, every tensor collected into a dict (``owned=True``: tensors the caller keeps,
its default). It only reads: the file is written untimed, by ``safetensors.torch.save``
and boto3 (``setup``), so this system has no save figures."""

from __future__ import annotations

import os
from typing import Any

import torch

from .common import Ctx
from .st_boto3 import save as boto3_save
from .st_model import own_state

__all__ = ["load", "own_state", "setup"]


def configure(ctx: Ctx) -> None:
    os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


def setup(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    boto3_save(state, ctx)


def load(ctx: Ctx, template: Any) -> dict[str, torch.Tensor]:
    from runai_model_streamer import SafetensorsStreamer
    from runai_model_streamer.s3_utils.s3_utils import S3Credentials

    creds = S3Credentials(
        access_key_id=ctx.access_key,
        secret_access_key=ctx.secret_key,
        region_name=ctx.region,
        endpoint=ctx.endpoint,
    )
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(f"s3://{ctx.bucket}/{ctx.prefix}/hf/model.safetensors", creds)
        return dict(streamer.get_tensors())

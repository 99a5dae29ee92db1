"""What every system module gets: where to write, and small shared helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Ctx:
    """One repetition's target: ``s3://{bucket}/{prefix}`` on the benchmark server."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    prefix: str
    part_size: int = 64 * 1024 * 1024
    concurrency: int = 10

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def storage_options(self) -> dict[str, Any]:
        """cloudckpt's ``storage_options`` for the server."""
        return {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
        }


def empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destination tensors of the same shapes (what a model already holds before a load)."""
    return {k: torch.empty_like(v) for k, v in state.items()}

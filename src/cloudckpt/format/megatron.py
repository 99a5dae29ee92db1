"""A Megatron ``torch_dist`` checkpoint's files, as megatron-core lays them out.

::

    <url>/
      __0_0.distcp ...   DCP data objects (cloudckpt's writer: one or more per rank)
      .metadata          DCP's metadata, written by the coordinator when every rank's
                         data is durable
      common.pt          the common (non-sharded) state, torch.save format, rank 0
      metadata.json      the backend record: written last, so it is the commit marker
                         megatron-core itself checks (``check_is_distributed_checkpoint``)

The same names megatron-core's ``dist_checkpointing.save`` writes, so either tool
reads the other's checkpoints after a plain copy. Here, in ``format/``, because the
integration (``cloudckpt.megatron``) and the engine's ``inspect``/``verify`` both read
them; nothing here needs megatron-core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .commit import MEGATRON_MARKER

__all__ = [
    "COMMON_BACKEND",
    "COMMON_NAME",
    "CONFIG_NAME",
    "SHARDED_BACKEND",
    "BackendRecord",
    "decode_config",
    "encode_config",
]

CONFIG_NAME = MEGATRON_MARKER
COMMON_NAME = "common.pt"

SHARDED_BACKEND = "torch_dist"
COMMON_BACKEND = "torch"


@dataclass(frozen=True)
class BackendRecord:
    """``metadata.json``: which megatron backends wrote the sharded and common parts."""

    sharded_backend: str = SHARDED_BACKEND
    sharded_backend_version: int = 1
    common_backend: str = COMMON_BACKEND
    common_backend_version: int = 1


def encode_config(record: BackendRecord | None = None) -> bytes:
    """The ``metadata.json`` megatron-core writes (same keys, same JSON)."""
    record = record or BackendRecord()
    return json.dumps(
        {
            "sharded_backend": record.sharded_backend,
            "sharded_backend_version": record.sharded_backend_version,
            "common_backend": record.common_backend,
            "common_backend_version": record.common_backend_version,
        }
    ).encode()


def decode_config(payload: bytes, url: str) -> BackendRecord:
    """Parse ``metadata.json``; refuse a backend cloudckpt can't read, naming it."""
    try:
        raw: Any = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{url} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{url} holds {type(raw).__name__}, not a JSON object")
    try:
        record = BackendRecord(
            sharded_backend=str(raw["sharded_backend"]),
            sharded_backend_version=int(raw["sharded_backend_version"]),
            common_backend=str(raw.get("common_backend", COMMON_BACKEND)),
            common_backend_version=int(raw.get("common_backend_version", 1)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{url} lacks a valid {exc} entry") from None
    if record.sharded_backend != SHARDED_BACKEND or record.common_backend != COMMON_BACKEND:
        raise UnsupportedFormatError(
            f"{url} records sharded backend {record.sharded_backend!r} and common backend "
            f"{record.common_backend!r}; cloudckpt.megatron reads {SHARDED_BACKEND!r} + "
            f"{COMMON_BACKEND!r} checkpoints (megatron-core's default since 0.7); convert "
            "others with megatron-core's own tools first"
        )
    return record

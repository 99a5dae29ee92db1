"""A Megatron ``torch_dist`` checkpoint's files and ``metadata.json`` record: defined in
``cloudckpt.format.megatron`` (the engine's ``inspect`` reads them too), named here for
the integration's modules and users' code."""

from __future__ import annotations

from ..format.megatron import (
    COMMON_NAME,
    CONFIG_NAME,
    BackendRecord,
    decode_config,
    encode_config,
)

__all__ = ["COMMON_NAME", "CONFIG_NAME", "BackendRecord", "decode_config", "encode_config"]

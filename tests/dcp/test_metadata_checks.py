"""``check_metadata`` (format/dcp/metadata.py) works each shared shape out once and
still refuses the one damaged item among many that share their objects."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from cloudckpt.errors import CorruptCheckpointError
from cloudckpt.format.dcp.metadata import check_metadata

_SIZE = torch.Size([6, 4])
_ZEROS = torch.Size([0, 0])
_PROPS = TensorProperties(dtype=torch.float32)


def _md(chunks: list[ChunkStorageMetadata], size: torch.Size = _SIZE) -> TensorStorageMetadata:
    return TensorStorageMetadata(properties=_PROPS, size=size, chunks=chunks)


def _shared(n: int) -> dict[str, TensorStorageMetadata]:
    """``n`` items sharing one size, one offsets, one sizes and one properties object,
    as cloudckpt's writer leaves them."""
    whole = ChunkStorageMetadata(offsets=_ZEROS, sizes=_SIZE)
    return {f"t{i}": _md([whole]) for i in range(n)}


def test_items_sharing_their_objects_pass() -> None:
    check_metadata(Metadata(state_dict_metadata=_shared(50)), "mem://x")


def test_a_chunk_outside_its_size_is_refused_among_shared_ones() -> None:
    state = _shared(50)
    state["t7"] = _md([ChunkStorageMetadata(offsets=_ZEROS, sizes=torch.Size([7, 4]))])
    with pytest.raises(CorruptCheckpointError, match="t7 has a chunk outside its size"):
        check_metadata(Metadata(state_dict_metadata=state), "mem://x")


def test_a_chunk_listed_twice_does_not_cover_the_size() -> None:
    state = _shared(50)
    whole = state["t0"].chunks[0]
    state["t9"] = _md([whole, whole])  # the same shared objects, twice the elements
    with pytest.raises(CorruptCheckpointError, match="the chunks of t9 do not cover"):
        check_metadata(Metadata(state_dict_metadata=state), "mem://x")


def test_a_missing_chunk_does_not_cover_the_size() -> None:
    state = _shared(50)
    half = torch.Size([3, 4])
    state["t3"] = _md([ChunkStorageMetadata(offsets=_ZEROS, sizes=half)])
    with pytest.raises(CorruptCheckpointError, match="the chunks of t3 do not cover"):
        check_metadata(Metadata(state_dict_metadata=state), "mem://x")


def test_one_item_without_a_dtype_is_refused() -> None:
    state = _shared(50)
    bad = TensorProperties(dtype=torch.float32)
    bad.dtype = "float32"  # type: ignore[assignment]
    state["t5"] = TensorStorageMetadata(properties=bad, size=_SIZE, chunks=state["t0"].chunks)
    with pytest.raises(CorruptCheckpointError, match="t5 has no dtype"):
        check_metadata(Metadata(state_dict_metadata=state), "mem://x")


def test_a_shape_that_is_not_counts_is_refused() -> None:
    state = _shared(50)
    state["t2"] = _md([ChunkStorageMetadata(offsets=(0, -1), sizes=_SIZE)])
    with pytest.raises(CorruptCheckpointError, match="t2 has a chunk outside"):
        check_metadata(Metadata(state_dict_metadata=state), "mem://x")

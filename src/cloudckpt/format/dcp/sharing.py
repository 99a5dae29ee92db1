"""Equal shapes and tensor properties made one object each, before DCP pickles them.

DCP pickles what it sends between ranks and what it stores: every rank's plan (gathered
by the coordinator, which scatters the global plans back) and ``.metadata``. Each item
carries a few ``torch.Size`` objects and, on a save, a ``TensorProperties``, nearly all
equal to the other items' (the same dtype; a layer's shape repeated by every layer).
``pickle`` writes an object it has met before as a reference to it, so once equal values
are one object, each is pickled and unpickled once: for 10,000 items, a save plan
unpickles in 0.07 s instead of 0.73 (``TensorProperties.__setstate__`` runs in Python
once per object) and is a third smaller; ``.metadata`` pickles in half the time.

Only equal values are shared: ``torch.Size`` (immutable) and ``TensorProperties``
compared by every field. The values, and what the pickles mean, are unchanged; nothing
in DCP tells the objects apart. Plan items are frozen dataclasses, set the way their own
constructors set them (``object.__setattr__``); they are the plan's own, made for this
save or load by the planner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData

__all__ = ["share_in_load_plan", "share_in_metadata", "share_in_save_plan"]

_Size = torch.Size
_set = object.__setattr__


class _Equal:
    """One object per distinct shape and per distinct set of tensor properties."""

    def __init__(self) -> None:
        self._shapes: dict[tuple[int, ...], torch.Size] = {}
        self._properties: dict[tuple[Any, ...], TensorProperties] = {}

    def shape(self, value: Any) -> Any:
        if type(value) is not _Size:
            return value
        return self._shapes.setdefault(tuple(value), value)

    def properties(self, value: Any) -> Any:
        if type(value) is not TensorProperties:
            return value
        return self._properties.setdefault(tuple(vars(value).items()), value)

    def chunk(self, chunk: Any) -> None:
        if type(chunk) is ChunkStorageMetadata:
            chunk.offsets = self.shape(chunk.offsets)
            chunk.sizes = self.shape(chunk.sizes)

    def index(self, index: Any) -> None:
        if type(index) is MetadataIndex and index.offset is not None:
            _set(index, "offset", self.shape(index.offset))


def share_in_metadata(metadata: Metadata) -> None:
    """``.metadata``'s equal tensor properties and shapes, one object each."""
    equal = _Equal()
    for md in metadata.state_dict_metadata.values():
        if type(md) is not TensorStorageMetadata:
            continue
        md.properties = equal.properties(md.properties)
        md.size = equal.shape(md.size)
        for chunk in md.chunks:
            equal.chunk(chunk)


def share_in_save_plan(plan: SavePlan) -> SavePlan:
    """A save plan's items with equal tensor properties and shapes one object each."""
    equal = _Equal()
    for item in plan.items:
        equal.index(item.index)
        data = item.tensor_data
        if type(data) is TensorWriteData:
            _set(data, "properties", equal.properties(data.properties))
            _set(data, "size", equal.shape(data.size))
            equal.chunk(data.chunk)
    return plan


def share_in_load_plan(plan: LoadPlan) -> LoadPlan:
    """A load plan's items with equal shapes one object each."""
    equal = _Equal()
    shape = equal.shape
    for item in plan.items:
        equal.index(item.dest_index)
        equal.index(item.storage_index)
        _set(item, "dest_offsets", shape(item.dest_offsets))
        _set(item, "storage_offsets", shape(item.storage_offsets))
        _set(item, "lengths", shape(item.lengths))
    return plan

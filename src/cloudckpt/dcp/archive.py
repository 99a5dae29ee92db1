"""Where a tensor's bytes sit inside one ``torch.save`` archive of a DCP data object.

DCP stores each tensor chunk as a small ``torch.save`` archive inside a data object.
To read part of a large chunk straight into its destination we need the record that
holds the tensor's storage and the tensor's dtype, storage offset, size and stride.
:func:`parse_archive` finds them from two small reads: the archive's head (where
``data.pkl`` sits) and its tail (the zip directory). Anything unusual (compressed
records, another rebuild function, big-endian data) returns ``None`` and the caller
reads the archive whole and hands it to ``torch.load``.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..format.unpickle import StorageRef, parse_persistent_id
from ..format.zipdir import _NeedMore, check_local_header, parse_directory

__all__ = ["SavedTensor", "parse_archive", "saved_from_json"]


@dataclass(frozen=True)
class SavedTensor:
    """A tensor inside an archive: its storage record and the view over it."""

    dtype: torch.dtype
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    data_offset: int  # of the storage record's bytes, from the archive's start
    record_size: int  # bytes in the storage record

    def to_json(self) -> list[Any]:
        """A JSON-able form for the layout index."""
        return [
            str(self.dtype).removeprefix("torch."),
            list(self.size),
            list(self.stride),
            self.storage_offset,
            self.data_offset,
            self.record_size,
        ]


def saved_from_json(value: Any) -> SavedTensor | None:
    """Inverse of :meth:`SavedTensor.to_json`; ``None`` for anything malformed."""
    try:
        name, size, stride, storage_offset, data_offset, record_size = value
        dtype = getattr(torch, str(name))
        if not isinstance(dtype, torch.dtype):
            return None
        saved = SavedTensor(
            dtype=dtype,
            storage_offset=int(storage_offset),
            size=tuple(int(v) for v in size),
            stride=tuple(int(v) for v in stride),
            data_offset=int(data_offset),
            record_size=int(record_size),
        )
    except (TypeError, ValueError, AttributeError):
        return None
    if len(saved.size) != len(saved.stride) or min(saved.data_offset, saved.record_size) < 0:
        return None
    return saved


class _Unsupported(Exception):
    """The pickle builds something other than one plain tensor."""


class _TensorArgs:
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: keeps its arguments."""

    def __init__(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any):
        self.storage = storage
        self.storage_offset = storage_offset
        self.size = size
        self.stride = stride


class _LayoutUnpickler(pickle.Unpickler):
    """Builds nothing: records the arguments of the single tensor rebuild."""

    def __init__(self, data: bytes, url: str) -> None:
        super().__init__(io.BytesIO(data))
        self.url = url

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _TensorArgs
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
            return getattr(torch, name)
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> StorageRef:
        return parse_persistent_id(pid, self.url)


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list, torch.Size)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


def parse_archive(head: bytes, tail: bytes, length: int, url: str) -> SavedTensor | None:
    """The tensor in an archive of ``length`` bytes, from its first and last bytes."""
    try:
        directory = parse_directory(tail, length - len(tail), length, url)
    except _NeedMore:
        return None
    entries = directory.entries
    pkl = next((e for n, e in entries.items() if n.rpartition("/")[2] == "data.pkl"), None)
    if pkl is None or pkl.method != 0 or pkl.local_header_size < 0 or pkl.end > len(head):
        return None
    order = next((e for n, e in entries.items() if n.rpartition("/")[2] == "byteorder"), None)
    if order is not None and (
        order.local_header_size < 0
        or order.end > len(head)
        or head[order.data_offset : order.end] != b"little"
    ):
        return None
    try:
        args = _LayoutUnpickler(head[pkl.data_offset : pkl.end], url).load()
    except (_Unsupported, pickle.UnpicklingError, EOFError, ValueError, struct.error):
        return None
    if not isinstance(args, _TensorArgs) or not isinstance(args.storage, StorageRef):
        return None
    size, stride = _ints(args.size), _ints(args.stride)
    dtype = args.storage.dtype
    if (
        size is None
        or stride is None
        or len(size) != len(stride)
        or not isinstance(args.storage_offset, int)
        or dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2)
    ):
        return None
    record = entries.get(pkl.name[: -len("data.pkl")] + "data/" + args.storage.key)
    if record is None or record.method != 0 or record.local_header_size < 0:
        return None
    if record.size != args.storage.nbytes:
        raise CorruptCheckpointError(
            f"{url}: storage record {record.name!r} holds {record.size} bytes, "
            f"its tensor needs {args.storage.nbytes}"
        )
    if record.data_offset <= len(head):
        check_local_header(head[record.header_offset : record.data_offset], record, url)
    return SavedTensor(
        dtype=dtype,
        storage_offset=args.storage_offset,
        size=size,
        stride=stride,
        data_offset=record.data_offset,
        record_size=record.size,
    )

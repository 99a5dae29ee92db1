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

import base64
import binascii
import collections
import io
import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ChecksumError, CorruptCheckpointError
from ..checksum import crc32
from ..unpickle import StorageRef, parse_persistent_id
from ..zipdir import NeedMoreBytes, check_local_header, parse_directory
from .checks import block_count, valid_block_size

__all__ = ["SavedTensor", "parse_archive", "saved_from_json"]


@dataclass(frozen=True)
class SavedTensor:
    """A tensor inside an archive: its storage record, the view over it, its checksums."""

    dtype: torch.dtype
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]
    data_offset: int  # of the storage record's bytes, from the archive's start
    record_size: int  # bytes in the storage record
    #: CRC-32 of each ``block_size`` bytes of the record (4 bytes little-endian each),
    #: from the layout index; ``block_size`` 0 when there are none.
    block_size: int = 0
    block_crcs: bytes = b""
    #: The record's zip CRC-32, when it came from the archive's directory.
    record_crc: int | None = None

    @property
    def dense(self) -> bool:
        """Whether the view covers the whole record in row-major order (as written by us)."""
        numel = math.prod(self.size)
        return (
            self.storage_offset == 0
            and self.record_size == numel * self.dtype.itemsize
            and all(
                n == 1 or st == math.prod(self.size[d + 1 :])
                for d, (n, st) in enumerate(zip(self.size, self.stride, strict=True))
            )
        )

    def to_json(self) -> list[Any]:
        """A JSON-able form for the layout index (6 fields, 8 with block checksums)."""
        value: list[Any] = [
            str(self.dtype).removeprefix("torch."),
            list(self.size),
            list(self.stride),
            self.storage_offset,
            self.data_offset,
            self.record_size,
        ]
        if self.block_size:
            value += [self.block_size, base64.b64encode(self.block_crcs).decode("ascii")]
        return value


#: Most dimensions a layout index entry may describe (torch allows 64... in practice).
_MAX_DIMS = 64
#: Offsets and sizes beyond this cannot describe bytes in any object.
_MAX_INT = 1 << 62


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INT


def saved_from_json(value: Any) -> SavedTensor | None:
    """Inverse of :meth:`SavedTensor.to_json`; ``None`` for anything malformed.

    Accepts the 6-field form of indexes written before block checksums, and the 8-field
    form with them (a block size the writer could have used, and exactly one CRC-32 per
    block of the record).
    """
    if not isinstance(value, list) or len(value) not in (6, 8):
        return None
    name, size, stride, storage_offset, data_offset, record_size = value[:6]
    if not isinstance(name, str) or not name.isidentifier():
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        return None
    if not isinstance(size, list) or not isinstance(stride, list):
        return None
    if len(size) != len(stride) or len(size) > _MAX_DIMS:
        return None
    if not all(map(_int, [*size, *stride, storage_offset, data_offset, record_size])):
        return None
    block_size, crcs = 0, b""
    if len(value) == 8:
        block_size, text = value[6:]
        if not valid_block_size(block_size) or not isinstance(text, str):
            return None
        try:
            crcs = base64.b64decode(text.encode("ascii"), validate=True)
        except (ValueError, binascii.Error):  # UnicodeEncodeError is a ValueError
            return None
        if len(crcs) != 4 * block_count(record_size, block_size):
            return None
    return SavedTensor(
        dtype=dtype,
        storage_offset=storage_offset,
        size=tuple(size),
        stride=tuple(stride),
        data_offset=data_offset,
        record_size=record_size,
        block_size=block_size,
        block_crcs=crcs,
    )


class _Unsupported(Exception):
    """The pickle builds something other than one plain tensor."""


class _TensorArgs:
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: keeps its arguments."""

    def __init__(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any):
        self.storage = storage
        self.storage_offset = storage_offset
        self.size = size
        self.stride = stride


class _LayoutUnpickler(pickle._Unpickler):
    """Builds nothing: records the arguments of the single tensor rebuild.

    The pure-Python unpickler (``data.pkl`` is small): its memo is a dict, so a damaged
    memo index cannot make it allocate an array of that size.
    """

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
    except NeedMoreBytes:
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
    check_local_header(head[pkl.header_offset : pkl.data_offset], pkl, url)
    pickled = head[pkl.data_offset : pkl.end]
    if crc32(pickled) != pkl.crc32:  # it says which bytes make the tensor: check it first
        raise ChecksumError(
            f"{url}: record {pkl.name!r} fails its CRC-32 check (stored {pkl.crc32:08x}, "
            f"read {crc32(pickled):08x}): the object is corrupted"
        )
    try:
        args = _LayoutUnpickler(pickled, url).load()
    except Exception:  # anything but one plain tensor: torch.load reads it whole
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
        record_crc=record.crc32,
    )

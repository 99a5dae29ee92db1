"""Where a tensor's bytes sit inside one ``torch.save`` archive of a DCP data object.

DCP stores each tensor chunk as a small ``torch.save`` archive inside a data object.
To read part of a large chunk straight into its destination we need the record that
holds the tensor's storage and the tensor's dtype, storage offset, size and stride.
:func:`parse_archive` finds them from two small reads: the archive's head (where
``data.pkl`` sits) and its tail (the zip directory). ``data.pkl`` is checked by its
CRC-32, then read through the trust boundary (format/torch/unpickle.py) under an allow-list
that builds nothing (recorders of ``_rebuild_tensor_v2``/``_v3``'s arguments, stand-ins
for storage classes); a parse
is kept by the pickle's bytes, and an archive laid out like one parsed before (a tensor
of the same dtype and shape: the same bytes but for its directory's CRC-32s) is
recognised without parsing its directory again. Anything unusual (compressed records,
another rebuild function, conjugate or negative views, big-endian data) returns
``None`` and the caller loads the archive whole, through the boundary.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import CorruptCheckpointError
from ..checksum import crc32
from ..dtype_names import dtype_named
from ..torch.restricted_pickle import Policy, run_restricted
from ..torch.unpickle import StorageRef, StorageStandIn, parse_persistent_id
from ..torch.zipdir import (
    Entry,
    NeedMoreBytes,
    check_local_header,
    check_record_crc,
    parse_directory,
)
from .checks import block_count, valid_block_size
from .layout import MAX_DIMS, is_count

__all__ = ["ArchiveParses", "SavedTensor", "parse_archive", "saved_from_json"]


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


def saved_from_json(value: Any) -> SavedTensor | None:
    """Inverse of :meth:`SavedTensor.to_json`; ``None`` for anything malformed.

    Accepts the 6-field form of indexes written before block checksums, and the 8-field
    form with them (a block size the writer could have used, and exactly one CRC-32 per
    block of the record).
    """
    if not isinstance(value, list) or len(value) not in (6, 8):
        return None
    name, size, stride, storage_offset, data_offset, record_size = value[:6]
    dtype = dtype_named(name) if isinstance(name, str) and "." not in name else None
    if dtype is None:
        return None
    if not isinstance(size, list) or not isinstance(stride, list):
        return None
    if len(size) != len(stride) or len(size) > MAX_DIMS:
        return None
    if not all(map(is_count, [*size, *stride, storage_offset, data_offset, record_size])):
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


class _TensorArgs:
    """Stand-in for ``torch._utils._rebuild_tensor_v2``: keeps its arguments. ``plain``:
    no more than ``requires_grad`` and the hooks follow the view (torch appends the
    conjugate and negative bits after them, which this parse does not apply)."""

    dtype: torch.dtype | None = None

    def __init__(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any):
        self.storage = storage
        self.storage_offset = storage_offset
        self.size = size
        self.stride = stride
        self.plain = len(rest) <= 2


class _TensorArgsV3(_TensorArgs):
    """Stand-in for ``torch._utils._rebuild_tensor_v3`` (the dtypes torch pickles over an
    untyped storage: float8, uint16..64...): its seventh argument is the dtype."""

    def __init__(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any):
        super().__init__(storage, storage_offset, size, stride)
        found = rest[2] if len(rest) == 3 else None
        self.dtype = found if isinstance(found, torch.dtype) else None
        self.plain = self.dtype is not None


def _storage_types() -> dict[str, StorageStandIn]:
    found = {
        name: StorageStandIn(dtype)
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    }
    found["UntypedStorage"] = StorageStandIn(torch.uint8)
    return found


_STORAGE_TYPES = _storage_types()
#: The globals a tensor's ``data.pkl`` names, and what each decodes to: recorders of
#: the rebuild's arguments, stand-ins for storage classes, dtypes (``_v3``).
_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _TensorArgs,
    ("torch._utils", "_rebuild_tensor_v3"): _TensorArgsV3,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", name): stand_in for name, stand_in in _STORAGE_TYPES.items()},
    ("torch.storage", "UntypedStorage"): _STORAGE_TYPES["UntypedStorage"],
    **{
        ("torch", str(dtype).removeprefix("torch.")): dtype
        for dtype in vars(torch).values()
        if isinstance(dtype, torch.dtype)
    },
}


#: The layout parse's policy: the recorders and stand-ins of ``_GLOBALS``, nothing that
#: runs code; anything else ends the parse and the caller loads the archive whole,
#: through the boundary (format/torch/unpickle.load_torch_bytes).
_POLICY = Policy(globals={f"{m}.{n}": o for (m, n), o in _GLOBALS.items()}, advice="")


@dataclass(frozen=True)
class _Layout:
    """What a ``data.pkl`` says: the storage record's key and size, the view over it."""

    key: str
    nbytes: int
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


_MAX_LAYOUTS = 4096
_QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2)


def _layout(pickled: bytes, url: str, parses: ArchiveParses) -> _Layout | None:
    """The tensor ``pickled`` rebuilds, or None for anything but one plain tensor."""
    layouts = parses.layouts
    try:
        return layouts[pickled]
    except KeyError:
        pass
    try:
        args = run_restricted(pickled, _POLICY, lambda pid: parse_persistent_id(pid, url), url)
    except Exception:  # anything but one plain tensor: loaded whole
        return None  # not kept: the error may name this archive
    found: _Layout | None = None
    if isinstance(args, _TensorArgs) and isinstance(args.storage, StorageRef):
        size, stride = _ints(args.size), _ints(args.stride)
        dtype = args.storage.dtype if type(args) is _TensorArgs else args.dtype
        if (
            args.plain
            and size is not None
            and stride is not None
            and len(size) == len(stride)
            and isinstance(args.storage_offset, int)
            and not isinstance(args.storage_offset, bool)
            and dtype is not None
            and dtype not in _QUANTIZED
            and (type(args) is _TensorArgs or args.storage.dtype == torch.uint8)
        ):
            storage = args.storage
            found = _Layout(storage.key, storage.nbytes, dtype, args.storage_offset, size, stride)
    if len(layouts) >= _MAX_LAYOUTS:
        layouts.clear()
    layouts[pickled] = found
    return found


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list, torch.Size)) and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None


class ArchiveParses:
    """What one load has parsed, to recognise archives laid out alike: by ``data.pkl``
    bytes (a model's tensors share a few dtypes and shapes, and the pickle holds no
    data) and by layout (:class:`_Known`). One per load, never process-wide: nothing
    read from one checkpoint's files is kept after its load."""

    def __init__(self) -> None:
        self.layouts: dict[bytes, _Layout | None] = {}
        self.known: dict[tuple[int, ...], list[_Known]] = {}


def parse_archive(
    head: bytes, tail: bytes, length: int, url: str, parses: ArchiveParses
) -> SavedTensor | None:
    """The tensor in an archive of ``length`` bytes, from its first and last bytes.

    An archive laid out like one parsed before in the same load (``parses``: the same
    bytes but for the CRC-32s in its directory, another tensor of the same dtype and
    shape) is recognised from those bytes (:class:`_Known`), its ``data.pkl`` still
    checked by its CRC-32.
    """
    known = _recognised(head, tail, length, url, parses)
    if known is not None:
        return known
    parsed = _parse(head, tail, length, url, parses)
    if parsed is None:
        return None
    saved, pkl, record, looked = parsed
    _remember(head, tail, length, saved, pkl, record, looked, parses)
    return saved


def _parse(
    head: bytes, tail: bytes, length: int, url: str, parses: ArchiveParses
) -> tuple[SavedTensor, Entry, Entry, int] | None:
    """:func:`parse_archive`'s work: the tensor, the entries of ``data.pkl`` and of the
    storage record, and how many bytes of ``head`` it read."""
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
    # It says which bytes make the tensor: check it first.
    check_record_crc(url, pkl.name, pkl.crc32, crc32(pickled))
    layout = _layout(pickled, url, parses)
    if layout is None:
        return None
    record = entries.get(pkl.name[: -len("data.pkl")] + "data/" + layout.key)
    if record is None or record.method != 0 or record.local_header_size < 0:
        return None
    if record.size != layout.nbytes:
        raise CorruptCheckpointError(
            f"{url}: storage record {record.name!r} holds {record.size} bytes, "
            f"its tensor needs {layout.nbytes}"
        )
    looked = max(pkl.end, order.end if order is not None else 0)
    if record.data_offset <= len(head):
        check_local_header(head[record.header_offset : record.data_offset], record, url)
        looked = max(looked, record.data_offset)
    saved = SavedTensor(
        dtype=layout.dtype,
        storage_offset=layout.storage_offset,
        size=layout.size,
        stride=layout.stride,
        data_offset=record.data_offset,
        record_size=record.size,
        record_crc=record.crc32,
    )
    return saved, pkl, record, looked


@dataclass(frozen=True)
class _Known:
    """An archive parsed before, to recognise others laid out alike.

    Two archives whose first ``looked`` bytes are the same and whose directories (from
    the central directory to the end) are the same but for the CRC-32 fields give the
    same parse: those bytes are all the parse reads, the CRC-32s only go into the
    result (the storage record's) or are checked (``data.pkl``'s, against its bytes).
    """

    head: bytes  # the first ``looked`` bytes
    directory: bytes  # the central directory to the end, CRC-32 fields zeroed
    crc_fields: tuple[int, ...]  # offsets of the CRC-32 fields in ``directory``
    pkl_crc_at: int
    record_crc_at: int
    pkl: tuple[int, int]  # where data.pkl's bytes are
    pkl_name: str
    saved: SavedTensor


_EOCD = struct.Struct("<4sHHHHIIH")
_U32 = struct.Struct("<I")
#: Archives recognised by their layout are kept by (length, head and tail sizes,
#: directory offset and size), a few each (tensors of other dtypes may share all those).
_MAX_KNOWN = 1024
_PER_KEY = 4


def _directory_at(tail: bytes, length: int) -> tuple[int, int, int] | None:
    """(key, directory start in ``tail``, its size) from the plain end record last in
    ``tail`` (no comment, no zip64 values), or None."""
    if len(tail) < _EOCD.size:
        return None
    sig, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment = _EOCD.unpack_from(
        tail, len(tail) - _EOCD.size
    )
    if sig != b"PK\x05\x06" or comment or disk or cd_disk or on_disk != count:
        return None
    if count == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        return None
    start = cd_offset - (length - len(tail))
    if start < 0 or cd_offset + cd_size > length:
        return None
    return count, start, cd_size


def _masked(region: bytes, fields: tuple[int, ...]) -> bytes:
    out = bytearray(region)
    for at in fields:
        out[at : at + 4] = b"\0\0\0\0"
    return bytes(out)


def _remember(
    head: bytes,
    tail: bytes,
    length: int,
    saved: SavedTensor,
    pkl: Entry,
    record: Entry,
    looked: int,
    parses: ArchiveParses,
) -> None:
    """Keep a parsed archive's layout (:class:`_Known`) when its directory is plain."""
    found = _directory_at(tail, length)
    if found is None:
        return
    count, start, cd_size = found
    region = tail[start:]
    fields: list[int] = []
    by_name: dict[str, int] = {}
    at = 0
    for _ in range(count):  # parse_directory read these entries: they are whole
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", region, at + 28)
        by_name[region[at + 46 : at + 46 + name_len].decode("utf-8", "replace")] = at + 16
        fields.append(at + 16)
        at += 46 + name_len + extra_len + comment_len
    if len(by_name) != count or pkl.name not in by_name or record.name not in by_name:
        return
    crc_fields = tuple(fields)
    known = _Known(
        head=head[:looked],
        directory=_masked(region, crc_fields),
        crc_fields=crc_fields,
        pkl_crc_at=by_name[pkl.name],
        record_crc_at=by_name[record.name],
        pkl=(pkl.data_offset, pkl.end),
        pkl_name=pkl.name,
        saved=saved,
    )
    key = (length, len(head), len(tail), start, cd_size)
    if len(parses.known) >= _MAX_KNOWN:
        parses.known.clear()
    kept = parses.known.setdefault(key, [])
    if len(kept) >= _PER_KEY:
        kept.pop(0)
    kept.append(known)


def _recognised(
    head: bytes, tail: bytes, length: int, url: str, parses: ArchiveParses
) -> SavedTensor | None:
    """The parse of an archive laid out like one parsed before, or None."""
    found = _directory_at(tail, length)
    if found is None:
        return None
    _, start, cd_size = found
    candidates = parses.known.get((length, len(head), len(tail), start, cd_size))
    if not candidates:
        return None
    region = tail[start:]
    for known in candidates:
        if head.startswith(known.head) and _masked(region, known.crc_fields) == known.directory:
            break
    else:
        return None
    (stored,) = _U32.unpack_from(region, known.pkl_crc_at)
    pickled = head[known.pkl[0] : known.pkl[1]]
    check_record_crc(url, known.pkl_name, stored, crc32(pickled))
    (record_crc,) = _U32.unpack_from(region, known.record_crc_at)
    return dataclasses.replace(known.saved, record_crc=record_crc)

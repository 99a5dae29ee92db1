"""One tensor's ``torch.save`` archive, built without ``torch.save``: the bytes it writes.

A DCP save of many small tensors spent most of its CPU in ``torch.save``: its zip writer
makes dozens of small writes per tensor, each through Python. :func:`tensor_archive`
builds the same archive from three buffers: the header (the records before the storage
bytes, and the storage record's local header), the tensor's storage as it lies in
memory (so a large tensor is still sent from its own memory), and the trailer (the
storage record's data descriptor, the records after it, the central directory and the
end records). The bytes are those ``torch.save(tensor, buffer)`` writes, record for
record: the same names in the same order, the same 64-byte alignment padding, the same
``data.pkl`` (pickled by the C pickler from the same objects), CRC-32s and
serialization id. It also returns what a DCP writer records about the archive: where
the storage record's bytes start, their CRC-32, and the checksums a reader checks
(:mod:`cloudckpt.format.dcp.checks`).

It takes only plain CPU tensors of the dtypes ``torch.save`` writes with
``_rebuild_tensor_v2`` or ``_rebuild_tensor_v3``, whose archive fits a zip without
zip64 fields (under 4 GiB), on a little-endian host, with torch's serialization options
at their defaults. Anything else (a tensor subclass, a quantized, sparse, nested,
conjugate or negative-bit tensor, one that requires grad, ``skip_data``...) gives
``None`` and the caller uses ``torch.save``. The first call checks the builder against
the running torch (the ``tensor_archive`` check, _runtime/probes.py): one that writes
other bytes (a torch release with another layout) turns the builder off for the
process, so the archive is always what that torch would write. With the fast paths off
the builder is not used at all.
"""

from __future__ import annotations

import collections
import ctypes
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..._runtime import probes
from ..checksum import crc32
from ..torch.ziprecords import (
    AFTER,
    BEFORE,
    DESCRIPTOR,
    PREFIX,
    U32,
    ZIP64_FROM,
    Constants,
    central,
    defaults,
    descriptor,
    end_records,
    hash_combine,
    local_header,
    storage_types,
    torch_save,
    v3_dtypes,
)
from ..torch.ziprecords import (
    constants as shared_constants,
)
from .checks import block_crcs, block_size_for
from .layout import WHOLE_LIMIT

__all__ = ["TensorArchive", "archive_builder_on", "tensor_archive"]

#: The records ``torch.save`` writes for one tensor, in order; ``data/0`` is the storage.
_STORAGE = "data/0"
_RECORDS = (*BEFORE, _STORAGE, *AFTER)


@dataclass(frozen=True)
class TensorArchive:
    """A tensor's archive as three buffers, and what a DCP writer records about it."""

    header: bytes  # records before the storage bytes, and the storage's local header
    storage: memoryview  # the storage's bytes (the caller's view of its memory)
    trailer: bytes  # the storage's data descriptor, later records, directory, end
    data_offset: int  # where the storage record's bytes start in the archive
    record_crc: int  # zip CRC-32 of the storage record
    #: CRC-32 of the whole archive when it is at most ``whole_limit`` bytes (read whole).
    crc: int | None = None
    #: For a larger archive (read by slice): the CRC-32 of each ``block_size`` bytes of
    #: the storage record, 4 bytes little-endian each.
    block_size: int = 0
    block_crcs: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.storage.nbytes + len(self.trailer)

    def tobytes(self) -> bytes:
        """The archive in one piece (a copy; tests and small archives)."""
        return b"".join((self.header, self.storage, self.trailer))


@dataclass(frozen=True)
class _Head:
    """What an archive's tensor dtype, shape, strides and storage size fix: the header
    (everything before the storage bytes) and the trailer but for the four fields that
    the storage's CRC-32 sets (at ``*_at``: offsets into ``trailer``)."""

    header: bytes
    header_crc: int  # CRC-32 of ``header``
    trailer: bytes
    #: ``c10::hash_combine`` of the CRC-32s of the records before the storage.
    combined: int
    record_crc_at: tuple[int, ...]  # the storage's descriptor and directory entry
    id_at: int  # the serialization id's 40 digits
    id_crc_at: tuple[int, ...]  # the serialization id record's descriptor and entry

    @property
    def data_offset(self) -> int:
        return len(self.header)


class _Reduce:
    """Pickles as ``func(*args)``, as a tensor's ``__reduce_ex__`` makes torch pickle it."""

    __slots__ = ("args", "func")

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


class _StoragePickler(pickle.Pickler):
    """The C pickler with torch's persistent id for the one storage (``_STORAGE_REF``)."""

    def __init__(self, file: io.BytesIO, pid: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=2)
        self.pid = pid

    def persistent_id(self, obj: Any) -> Any:
        return self.pid if obj is _STORAGE_REF else None


_STORAGE_REF = object()


def _data_pkl(tensor: torch.Tensor, storage_nbytes: int) -> bytes | None:
    """``data.pkl`` as ``torch.save`` pickles ``tensor``, or None for a dtype it does not
    rebuild with ``_rebuild_tensor_v2``/``_v3``."""
    dtype = tensor.dtype
    backward_hooks: dict[Any, Any] = collections.OrderedDict()
    # Distinct tuples, as torch passes them: pickle's memo must see the same objects.
    size, stride = tuple(tensor.size()), tensor.stride()
    args: tuple[Any, ...] = (_STORAGE_REF, tensor.storage_offset(), size, stride, False)
    func: Any
    if dtype in v3_dtypes():
        pid = ("storage", torch.UntypedStorage, "0", "cpu", storage_nbytes)
        func = torch._utils._rebuild_tensor_v3
        args = (*args, backward_hooks, dtype)
    else:
        name = storage_types().get(dtype)
        storage_type = getattr(torch, name, None) if name else None
        if storage_type is None or storage_nbytes % dtype.itemsize:
            return None
        pid = ("storage", storage_type, "0", "cpu", storage_nbytes // dtype.itemsize)
        func = torch._utils._rebuild_tensor_v2
        args = (*args, backward_hooks)
    buffer = io.BytesIO()
    _StoragePickler(buffer, pid).dump(_Reduce(func, args))
    return buffer.getvalue()


#: Heads built so far, by (dtype, shape, strides, storage offset, storage bytes): a
#: model's tensors share a few shapes. Bounded: cleared when it grows past this.
_HEADS: dict[tuple[Any, ...], _Head] = {}
_MAX_HEADS = 1024


def _head(tensor: torch.Tensor, nbytes: int, constants: Constants) -> _Head | None:
    key = (tensor.dtype, tuple(tensor.size()), tensor.stride(), tensor.storage_offset(), nbytes)
    found = _HEADS.get(key)
    if found is None:
        pickled = _data_pkl(tensor, nbytes)
        if pickled is None:
            return None
        found = _new_head(pickled, nbytes, constants)
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[key] = found
    return found


def _new_head(pickled: bytes, nbytes: int, constants: Constants) -> _Head:
    """Lay out the archive's records: the local headers, small records and descriptors
    before the storage bytes; after them the storage's descriptor, the ``version`` and
    serialization id records, the central directory, and torch's end records (zip64
    end record and locator, then the classic one)."""
    offsets, crcs, sizes = [], [], []
    parts: list[bytes] = []
    pos = 0
    combined = 0

    def record(name: str, data: bytes, crc: int) -> int:
        """Add a record; where its bytes start in ``parts``."""
        nonlocal pos, combined
        header = local_header(pos, (PREFIX + name).encode(), len(data))
        offsets.append(pos)
        crcs.append(crc)
        sizes.append(len(data))
        if data:  # torch folds in the CRC-32 of every non-empty record
            combined = hash_combine(combined, crc)
        parts.extend((header, data, descriptor(crc, len(data))))
        at = pos + len(header)
        pos = at + len(data) + DESCRIPTOR.size
        return at

    for name in BEFORE:
        data = pickled if name == "data.pkl" else constants.contents[name]
        record(name, data, crc32(data))
    before = combined
    # The storage: its local header ends the header; its bytes and CRC-32 vary.
    offsets.append(pos)
    crcs.append(0)
    sizes.append(nbytes)
    storage_header = local_header(pos, (PREFIX + _STORAGE).encode(), nbytes)
    header = b"".join((*parts, storage_header))
    parts = [descriptor(0, nbytes)]
    pos = len(header) + nbytes + len(parts[0])
    version = constants.contents["version"]
    record("version", version, crc32(version))
    id_at = record(".data/serialization_id", b"0" * 40, 0)
    cd_offset = pos
    entries = [
        central((PREFIX + name).encode(), offset, crc, size)
        for name, offset, crc, size in zip(_RECORDS, offsets, crcs, sizes, strict=True)
    ]
    directory = b"".join(entries)
    count = len(_RECORDS)
    parts += (directory, end_records(count, len(directory), pos))
    trailer = b"".join(parts)
    start = len(header) + nbytes  # where the trailer starts in the archive

    def entry_crc(index: int) -> int:  # the CRC-32 field of a directory entry
        return cd_offset - start + sum(map(len, entries[:index])) + 16

    storage = _RECORDS.index(_STORAGE)
    serial = len(_RECORDS) - 1
    return _Head(
        header=header,
        header_crc=crc32(header),
        trailer=trailer,
        combined=before,
        record_crc_at=(4, entry_crc(storage)) if nbytes else (entry_crc(storage),),
        id_at=id_at - start,
        id_crc_at=(id_at - start + 40 + 4, entry_crc(serial)),
    )


def _trailer(head: _Head, record_crc: int, nbytes: int, constants: Constants) -> bytes:
    """The head's trailer with the fields the storage's CRC-32 sets: its own, and the
    serialization id (and its CRC-32) that torch derives from every record's."""
    out = bytearray(head.trailer)
    combined = head.combined
    if nbytes:
        combined = hash_combine(combined, record_crc)
    for at in head.record_crc_at:
        U32.pack_into(out, at, record_crc)
    combined = hash_combine(combined, constants.version_crc)
    serialization_id = b"%020d%020d" % (constants.name_hash, combined)
    out[head.id_at : head.id_at + 40] = serialization_id
    id_crc = crc32(serialization_id)
    for at in head.id_crc_at:
        U32.pack_into(out, at, id_crc)
    return bytes(out)


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``torch.save`` pickles ``tensor`` as a plain rebuild of one CPU storage."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not torch._utils._get_obj_state(tensor)
        and not torch._utils.get_tensor_metadata(tensor)
    )


def _build(
    tensor: torch.Tensor, storage: memoryview, constants: Constants, whole_limit: int
) -> TensorArchive | None:
    nbytes = storage.nbytes
    if nbytes >= ZIP64_FROM:
        return None
    head = _head(tensor, nbytes, constants)
    if head is None:
        return None
    record_crc = crc32(storage)
    trailer = _trailer(head, record_crc, nbytes, constants)
    total = len(head.header) + nbytes + len(trailer)
    crc: int | None = None
    block_size, blocks = 0, b""
    if total <= whole_limit:  # read whole: one CRC-32 of the archive
        crc = crc32(trailer, crc32(storage, head.header_crc))
    elif nbytes > whole_limit // 2:  # read by slice: the CRC-32 of each block
        block_size = block_size_for(nbytes)
        blocks = block_crcs(storage, block_size)
    return TensorArchive(
        header=head.header,
        storage=storage,
        trailer=trailer,
        data_offset=head.data_offset,
        record_crc=record_crc,
        crc=crc,
        block_size=block_size,
        block_crcs=blocks,
    )


def tensor_archive(
    tensor: torch.Tensor, storage: memoryview, *, whole_limit: int = WHOLE_LIMIT
) -> TensorArchive | None:
    """``torch.save(tensor)``'s archive as buffers, or None where ``torch.save`` must
    write it (see the module's docstring).

    ``storage`` is a byte view of ``tensor.untyped_storage()``'s memory (the whole
    storage, as ``torch.save`` writes it); the archive's ``storage`` is that view, so the
    caller keeps the tensor alive and unchanged until the bytes are sent.
    caller keeps the tensor alive and unchanged until the bytes are sent. torch's
    serialization options are not read here (they cost more than the rest of the
    call): the caller asks :func:`archive_builder_on` once for a batch of tensors.
    """
    constants = _constants()
    if constants is None or not _plain(tensor):
        return None
    if storage.nbytes != tensor.untyped_storage().nbytes():
        raise ValueError(f"a view of {storage.nbytes} bytes is not the tensor's storage")
    return _build(tensor, storage, constants, whole_limit)


def _probe_tensors() -> list[torch.Tensor]:
    """Tensors whose archives exercise every path of the builder."""
    return [
        torch.arange(5, dtype=torch.float32),
        torch.ones((), dtype=torch.float8_e4m3fn),  # a _rebuild_tensor_v3 dtype
        torch.empty(0, dtype=torch.int64),
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t(),
    ]


def _constants() -> Constants | None:
    """The running torch's constants, once the builder has been shown to write exactly
    what ``torch.save`` writes for the probe tensors; None (builder off) otherwise.
    Checked the first time torch's serialization options are the defaults (they are
    read only until then: per tensor they cost more than the rest of the call)."""
    if probes.outcome("tensor_archive") is None and not defaults():
        return None
    return shared_constants() if probes.on("tensor_archive") else None


def _check() -> None:
    """The builder's archive of each probe tensor is ``torch.save``'s, byte for byte."""
    constants = shared_constants()
    if constants is None:
        raise ValueError("torch.save writes other records")
    for t in _probe_tensors():
        storage = t.untyped_storage()
        view = memoryview(ctypes.string_at(storage.data_ptr(), storage.nbytes()))
        built = _build(t, view, constants, WHOLE_LIMIT)
        if built is None or built.tobytes() != torch_save(t):
            raise ValueError(f"the archive of a {t.dtype} tensor differs from torch.save's")


probes.register("tensor_archive", _check)


def archive_builder_on() -> bool:
    """Whether :func:`tensor_archive` writes what ``torch.save`` would write now: the
    builder matched this torch's ``torch.save`` on the probe tensors (checked once per
    process), and torch's serialization options are the defaults it copies."""
    return defaults() and _constants() is not None

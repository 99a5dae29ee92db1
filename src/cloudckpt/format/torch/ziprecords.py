"""The zip records of torch's archive writer (``PyTorchStreamWriter``), byte for byte.

``torch.save`` writes its archive through miniz with torch's own choices: every record
named under ``archive/``, its bytes starting on a 64-byte boundary (an ``FB`` extra field
of ``Z`` padding), sizes and CRC-32 in a data descriptor after the bytes (none for an
empty record), a zip64 end record and locator before the classic end record, and a
``.data/serialization_id`` that folds every record's name and CRC-32 together.
:class:`Layout` is the one place the records are sequenced (``data.pkl`` and the small
records, one ``data/N`` per storage, ``version``, the serialization id, the directory,
the end records); :class:`SingleStorage` is that layout for a one-storage archive with
the storage's bytes and CRC-32 left open, for a builder that fills them in per tensor.
The archive builder (:mod:`.archive_writer`) checks what they lay out against the running
torch's ``torch.save`` before it is used.
"""

from __future__ import annotations

import functools
import io
import itertools
import operator
import struct
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, cast

import torch

from ..checksum import crc32

__all__ = [
    "AFTER",
    "ALIGN",
    "BEFORE",
    "DESCRIPTOR",
    "PREFIX",
    "ZIP64_FROM",
    "Constants",
    "Layout",
    "SingleStorage",
    "central",
    "data_start",
    "defaults",
    "descriptor",
    "end_records",
    "fold",
    "local_header",
    "name_hash",
    "probe_constants",
    "read_constants",
    "serialization_id",
    "storage_types",
    "torch_save",
    "v3_dtypes",
]

#: The records ``torch.save`` writes before and after the storages, in order.
BEFORE = ("data.pkl", ".format_version", ".storage_alignment", "byteorder")
AFTER = ("version", ".data/serialization_id")
PREFIX = "archive/"
#: torch's default ``storage_alignment``: where every record's bytes start.
ALIGN = 64
#: Archives at least this large would need zip64 fields in their records: left to
#: ``torch.save``.
ZIP64_FROM = 0xFFFFFFFF - (1 << 20)

LOCAL = struct.Struct("<4sHHHHHIIIHH")
DESCRIPTOR = struct.Struct("<4sIII")
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
ZIP64_LOCATOR = struct.Struct("<4sIQI")
END = struct.Struct("<4sHHHHIIH")
U32 = struct.Struct("<I")
#: General purpose flags torch's writer sets: UTF-8 names, and for a record with bytes,
#: its sizes in a data descriptor after them (an empty record has no descriptor).
_UTF8, _DESCRIBED = 0x0800, 0x0008
_MASK64 = (1 << 64) - 1


def _flags(size: int) -> int:
    return _UTF8 | _DESCRIBED if size else _UTF8


def data_start(offset: int, name: bytes) -> int:
    """Where the bytes of a record whose local header is at ``offset`` start."""
    start = offset + LOCAL.size + len(name) + 4
    return start + (-start % ALIGN)


def local_header(offset: int, name: bytes, size: int) -> bytes:
    """A record's local header as torch's writer makes it: sizes and CRC in the data
    descriptor, and an ``FB`` extra field of ``Z``s that puts the data on ``ALIGN``."""
    start = offset + LOCAL.size + len(name) + 4
    pad = -start % ALIGN
    extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
    flags = _flags(size)
    return LOCAL.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + (
        name + extra
    )


def descriptor(crc: int, size: int) -> bytes:
    """What follows a record's bytes: its CRC-32 and sizes (nothing after an empty one)."""
    return DESCRIPTOR.pack(b"PK\x07\x08", crc, size, size) if size else b""


def central(name: bytes, offset: int, crc: int, size: int) -> bytes:
    """A record's central directory entry."""
    flags = _flags(size)
    return (
        CENTRAL.pack(
            b"PK\x01\x02", 0, 0, flags, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset
        )
        + name
    )


def end_records(count: int, directory_size: int, directory_offset: int) -> bytes:
    """torch's end of archive: the zip64 end record and locator, then the classic end
    record (its entry counts capped at 0xFFFF, as miniz caps them)."""
    classic = min(count, 0xFFFF)
    return b"".join(
        (
            ZIP64_END.pack(
                b"PK\x06\x06",
                44,
                0x031E,
                45,
                0,
                0,
                count,
                count,
                directory_size,
                directory_offset,
            ),
            ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, directory_offset + directory_size, 1),
            END.pack(b"PK\x05\x06", 0, 0, classic, classic, directory_size, directory_offset, 0),
        )
    )


@dataclass(frozen=True)
class Constants:
    """What every archive of the running torch holds alike, read off one probe archive:
    the small records' bytes, by name (``version`` among them)."""

    contents: dict[str, bytes]


def torch_save(obj: object) -> bytes:
    """``torch.save(obj)``'s bytes, as a stream gets them."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def probe_constants(data: bytes) -> Constants | None:
    """The small records of a one-storage torch archive, when it holds exactly the
    records :class:`Layout` writes."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = [info.filename for info in archive.infolist()]
        if names != [PREFIX + n for n in (*BEFORE, "data/0", *AFTER)]:
            return None
        contents = {n: archive.read(PREFIX + n) for n in (*BEFORE[1:], "version")}
        serialization_id = archive.read(PREFIX + ".data/serialization_id")
    if contents["byteorder"] != b"little" or contents[".storage_alignment"] != b"%d" % ALIGN:
        return None
    if len(serialization_id) != 40 or not serialization_id.isdigit():
        return None
    return Constants(contents)


def read_constants() -> Constants:
    """The running torch's constants, read off ``torch.save`` of a probe tensor."""
    found = probe_constants(torch_save(torch.zeros(1)))
    if found is None:
        raise ValueError("torch.save writes other records than the builders lay out")
    return found


#: Name hashes by storage count (the names are ``data/0`` ... in order): bounded.
_NAME_HASHES: dict[int, int] = {}
_MAX_NAME_HASHES = 256


def name_hash(storages: int) -> int:
    """The name half of the serialization id of an archive of ``storages`` storages.

    torch folds the hashes of the record names in the order of an ``unordered_set``;
    rather than copy that container's layout, torch's own writer is handed the same
    names (empty records, discarded bytes) and asked. Cached by count: a training job
    saves the same count every time.
    """
    found = _NAME_HASHES.get(storages)
    if found is None:
        writer = torch._C.PyTorchFileWriter(cast(IO[bytes], _Discard()), True, ALIGN)
        for name in (*BEFORE, *(f"data/{i}" for i in range(storages))):
            writer.write_record(name, b"", 0)
        writer.write_end_of_file()
        found = int(writer.serialization_id()[:20])
        if len(_NAME_HASHES) >= _MAX_NAME_HASHES:
            _NAME_HASHES.clear()
        _NAME_HASHES[storages] = found
    return found


class _Discard:
    """A write-only stream that keeps nothing."""

    def write(self, data: bytes) -> int:
        return len(memoryview(data))


def defaults() -> bool:
    """Whether ``torch.save`` would write with the defaults the builders copy."""
    tls = torch.serialization._serialization_tls
    if getattr(tls, "skip_data", False) or sys.byteorder != "little":
        return False
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch before 2.5: no such options
        return True
    save = config.save
    return bool(getattr(save, "compute_crc32", True)) and (
        getattr(save, "storage_alignment", ALIGN) == ALIGN
    )


@functools.cache
def v3_dtypes() -> frozenset[torch.dtype]:
    """The dtypes torch rebuilds with ``_rebuild_tensor_v3`` (over an untyped storage)."""
    new = getattr(torch.storage, "_new_dtypes", None)
    return frozenset(new()) if new is not None else frozenset()


@functools.cache
def storage_types() -> dict[torch.dtype, str]:
    """The legacy storage class name torch pickles for each other dtype."""
    return dict(torch.storage._dtype_to_storage_type_map())


#: The CRC-32 field's place in a data descriptor and in a central directory entry.
DESCRIPTOR_CRC = 4
ENTRY_CRC = 16
_PREFIX = PREFIX.encode()
_CRC_SIZE = operator.itemgetter(2, 3)  # of a (name, offset, crc, size) record
#: Record names as written, by name.
_NAMES = {name: (PREFIX + name).encode() for name in (*BEFORE, *AFTER)}


def fold(records: Iterable[tuple[int, int]], seed: int = 0) -> int:
    """The CRC-32 half of the serialization id: the ``(crc, size)`` of each record in
    order, the non-empty ones folded in by ``c10::hash_combine`` on a 64-bit
    ``size_t`` (inline here: it runs once per record of a save)."""
    for crc, size in records:
        if size:
            seed ^= (crc + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64
    return seed


def serialization_id(names: int, folded: int) -> bytes:
    """The ``.data/serialization_id`` record: the name half (:func:`name_hash`) and the
    CRC-32 half (:func:`fold`), 20 digits each."""
    return b"%020d%020d" % (names, folded)


class Layout:
    """torch's archive laid out record by record, in torch's order: :meth:`opening`
    (``data.pkl`` and the small records), :meth:`storage` and :meth:`stored` once per
    storage (``data/0``, ``data/1``...), then :meth:`closing` (``version``, the
    serialization id, the central directory and the end records). The caller writes
    each record's bytes between the header and the descriptor it is given; offsets,
    directory entries and the serialization id follow from what was laid out."""

    __slots__ = ("_open", "contents", "directory_at", "pos", "records")

    def __init__(self, constants: Constants) -> None:
        self.contents = constants.contents
        self.pos = 0  # the archive offset of the next record
        #: (name, local header offset, CRC-32, size) of each record so far.
        self.records: list[tuple[bytes, int, int, int]] = []
        self.directory_at = 0  # where the central directory starts, once closed
        self._open: tuple[bytes, int, int] = (b"", 0, 0)  # the record awaiting its CRC-32

    def record(self, name: bytes, size: int, crc: int) -> tuple[bytes, bytes]:
        """The next record's local header and data descriptor: its ``size`` bytes
        (CRC-32 ``crc``) go between them."""
        header = self._header(name, size)
        return header, self.stored(crc)

    def storage(self, key: int, size: int) -> bytes:
        """Storage ``key``'s local header (keys count up from 0); its ``size`` bytes
        follow, then the descriptor :meth:`stored` gives once their CRC-32 is known."""
        return self._header(b"%sdata/%d" % (_PREFIX, key), size)

    def _header(self, name: bytes, size: int) -> bytes:
        """The local header of a record of ``size`` bytes, begun at :attr:`pos`."""
        offset = self.pos
        header = local_header(offset, name, size)
        self.pos = offset + len(header) + size
        self._open = (name, offset, size)
        return header

    def stored(self, crc: int) -> bytes:
        """The data descriptor of the record just begun, whose bytes have CRC-32 ``crc``."""
        name, offset, size = self._open
        tail = descriptor(crc, size)
        self.pos += len(tail)
        self.records.append((name, offset, crc, size))
        return tail

    def opening(self, pickled: bytes) -> list[tuple[bytes, bytes, bytes]]:
        """The records before the storages, each as (header, bytes, descriptor)."""
        out = []
        for name in BEFORE:
            data = pickled if name == "data.pkl" else self.contents[name]
            header, tail = self.record(_NAMES[name], len(data), crc32(data))
            out.append((header, data, tail))
        return out

    def closing(self, storages: int) -> bytes:
        """Every byte after the last storage record: the ``version`` and serialization
        id records, the central directory and the end records."""
        version_name, id_name = AFTER
        version = self.contents[version_name]
        header, tail = self.record(_NAMES[version_name], len(version), crc32(version))
        parts = [header, version, tail]
        folded = fold(map(_CRC_SIZE, self.records))
        serial = serialization_id(name_hash(storages), folded)
        header, tail = self.record(_NAMES[id_name], len(serial), crc32(serial))
        parts += (header, serial, tail)
        directory = b"".join(itertools.starmap(central, self.records))
        self.directory_at = self.pos
        parts += (directory, end_records(len(self.records), len(directory), self.pos))
        return b"".join(parts)

    def entry_at(self, index: int) -> int:
        """Where record ``index``'s central directory entry starts (once closed)."""
        return self.directory_at + sum(CENTRAL.size + len(r[0]) for r in self.records[:index])


@dataclass(frozen=True)
class SingleStorage:
    """A one-storage archive laid out by :class:`Layout` but for the storage's bytes:
    ``header`` is every byte before them; :meth:`trailer` every byte after, with the
    fields that the storage's CRC-32 sets (its own, the serialization id, and that
    record's CRC-32) filled in. Made once per tensor shape, filled per tensor."""

    header: bytes
    header_crc: int  # CRC-32 of ``header``
    nbytes: int  # the storage's size
    template: bytes  # the trailer as laid out for a CRC-32 of 0
    before: int  # the CRC-32s of the records before the storage, folded
    after: tuple[tuple[int, int], ...]  # (crc, size) of the records folded after it
    name_hash: int
    crc_at: tuple[int, ...]  # the storage's CRC-32 fields, as offsets in the trailer
    id_at: int  # the serialization id's 40 digits
    id_crc_at: tuple[int, ...]  # the serialization id record's CRC-32 fields

    @classmethod
    def lay_out(cls, pickled: bytes, nbytes: int, constants: Constants) -> SingleStorage:
        """The layout of the archive whose ``data.pkl`` is ``pickled`` and whose one
        storage holds ``nbytes``."""
        layout = Layout(constants)
        header = b"".join(b"".join(record) for record in layout.opening(pickled))
        storage = len(layout.records)
        header += layout.storage(0, nbytes)
        trailer = layout.stored(0) + layout.closing(1)
        start = len(header) + nbytes  # the trailer's offset in the archive
        serial = len(layout.records) - 1
        name, offset, _, _ = layout.records[serial]
        id_at = data_start(offset, name) - start
        crcs = list(map(_CRC_SIZE, layout.records))
        storage_entry = layout.entry_at(storage) + ENTRY_CRC - start
        return cls(
            header=header,
            header_crc=crc32(header),
            nbytes=nbytes,
            template=trailer,
            before=fold(crcs[:storage]),
            after=tuple(crcs[storage + 1 : serial]),
            name_hash=name_hash(1),
            crc_at=(DESCRIPTOR_CRC, storage_entry) if nbytes else (storage_entry,),
            id_at=id_at,
            id_crc_at=(
                id_at + 40 + DESCRIPTOR_CRC,
                layout.entry_at(serial) + ENTRY_CRC - start,
            ),
        )

    def trailer(self, crc: int) -> bytes:
        """The bytes after a storage whose CRC-32 is ``crc``."""
        out = bytearray(self.template)
        for at in self.crc_at:
            U32.pack_into(out, at, crc)
        folded = fold(self.after, fold(((crc, self.nbytes),), self.before))
        serial = serialization_id(self.name_hash, folded)
        out[self.id_at : self.id_at + 40] = serial
        serial_crc = crc32(serial)
        for at in self.id_crc_at:
            U32.pack_into(out, at, serial_crc)
        return bytes(out)

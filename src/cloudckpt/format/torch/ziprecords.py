"""The zip records of torch's archive writer (``PyTorchStreamWriter``), byte for byte.

``torch.save`` writes its archive through miniz with torch's own choices: every record
named under ``archive/``, its bytes starting on a 64-byte boundary (an ``FB`` extra field
of ``Z`` padding), sizes and CRC-32 in a data descriptor after the bytes (none for an
empty record), a zip64 end record and locator before the classic end record, and a
``.data/serialization_id`` that folds every record's name and CRC-32 together. The
archive builders (:mod:`.archive_writer` for whole objects, :mod:`.dcp.tensor_archive`
for a DCP item) lay records out with these functions; each checks its output against
the running torch's ``torch.save`` before it is used.
"""

from __future__ import annotations

import functools
import io
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import IO, cast

import torch

from ..._runtime import probes
from ..checksum import crc32

__all__ = [
    "AFTER",
    "ALIGN",
    "BEFORE",
    "DESCRIPTOR",
    "PREFIX",
    "U32",
    "ZIP64_FROM",
    "Constants",
    "central",
    "constants",
    "defaults",
    "descriptor",
    "end_records",
    "hash_combine",
    "local_header",
    "name_hash",
    "probe_constants",
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


def hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``: how torch folds record CRC-32s into
    the serialization id."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)) & (
        _MASK64
    )


def _flags(size: int) -> int:
    return _UTF8 | _DESCRIBED if size else _UTF8


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
    the small records' bytes, the name half of a one-storage archive's serialization
    id, and the CRC-32 of the ``version`` record."""

    contents: dict[str, bytes]
    name_hash: int
    version_crc: int


def torch_save(obj: object) -> bytes:
    """``torch.save(obj)``'s bytes, as a stream gets them."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def probe_constants(data: bytes) -> Constants | None:
    """The small records and the serialization id's name hash of a one-storage torch
    archive, when it holds exactly the records the builders write."""
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
    return Constants(contents, int(serialization_id[:20]), crc32(contents["version"]))


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


#: The running torch's constants, once its check has read them.
_found: list[Constants] = []


def _check_constants() -> None:
    """Read the constants off ``torch.save`` of a probe tensor (_runtime/probes.py)."""
    found = probe_constants(torch_save(torch.zeros(1)))
    if found is None:
        raise ValueError("torch.save writes other records than the builders lay out")
    _found[:] = [found]


probes.register("torch_zip_records", _check_constants)


def constants() -> Constants | None:
    """The running torch's constants, read once from ``torch.save`` of a probe tensor;
    None when its archive holds other records than the builders write, or with the
    fast paths off (then ``torch.save`` writes every archive)."""
    return _found[0] if probes.on("torch_zip_records") else None

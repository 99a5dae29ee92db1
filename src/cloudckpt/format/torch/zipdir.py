"""Reading a zip archive's directory from its tail, as ``torch.save`` archives are zips.

A ``torch.save`` archive is an uncompressed zip whose records are laid out back to
back. :func:`parse_directory` reads the end-of-central-directory record (zip64 too)
and every central directory entry from bytes fetched off the end of the object, and
locates each record's data from the spacing between consecutive local headers. The
reader fetches each record together with its local header and checks that header, so
a wrong guess about the layout is caught, never read as data.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from ...errors import ChecksumError, CorruptCheckpointError
from ..checksum import crc32

__all__ = [
    "LOCAL_HEADER_SIZE",
    "Directory",
    "Entry",
    "check_local_header",
    "check_record_crc",
    "check_records",
    "parse_directory",
]

_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_EOCD_SIZE = 22
_ZIP64_LOCATOR_SIZE = 20
_CENTRAL_SIZE = 46
LOCAL_HEADER_SIZE = 30
#: A central directory entry's fixed part, the fields read: version made by and needed
#: (skipped), flags, method, time and date (skipped), CRC-32, sizes, name, extra and
#: comment lengths, disk, attributes (skipped), local header offset.
_CENTRAL_ENTRY = struct.Struct("<4x4xHH4xIIIHHH8xI")
#: A local header's name and extra lengths (at byte 26).
_NAME_EXTRA = struct.Struct("<HH")
_MAX_COMMENT = 0xFFFF
#: Bytes from the end that always contain the EOCD (and zip64 locator) records.
TAIL_PROBE = _EOCD_SIZE + _MAX_COMMENT + _ZIP64_LOCATOR_SIZE + 56


@dataclass(slots=True)
class Entry:
    """One record: where its local header and data are, and its checksum."""

    name: str
    header_offset: int
    size: int
    compressed_size: int
    crc32: int
    method: int
    flags: int
    zip64: bool = False  # the directory entry carried zip64 values
    local_header_size: int = 0  # filled by parse_directory; -1 means unknown

    @property
    def data_offset(self) -> int:
        return self.header_offset + self.local_header_size

    @property
    def end(self) -> int:
        return self.data_offset + self.compressed_size


@dataclass
class Directory:
    entries: dict[str, Entry]
    cd_offset: int
    cd_size: int


class NeedMoreBytes(Exception):
    def __init__(self, start: int) -> None:
        self.start = start


def _eocd(tail: bytes, tail_start: int, url: str) -> tuple[int, int, int]:
    """(entry count, central directory size, central directory offset)."""
    pos = tail.rfind(_EOCD, max(0, len(tail) - _EOCD_SIZE - _MAX_COMMENT))
    if pos < 0 or pos + _EOCD_SIZE > len(tail):
        raise CorruptCheckpointError(f"{url} is not a zip archive (no end-of-directory record)")
    (_, _, _, _, count, cd_size, cd_offset, _) = struct.unpack_from("<4sHHHHIIH", tail, pos)
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc = pos - _ZIP64_LOCATOR_SIZE
        if loc < 0 or tail[loc : loc + 4] != _ZIP64_LOCATOR:
            raise CorruptCheckpointError(f"{url}: zip64 locator missing")
        (_, _, z64_offset, _) = struct.unpack_from("<4sIQI", tail, loc)
        rel = z64_offset - tail_start
        if rel < 0:
            raise NeedMoreBytes(z64_offset)
        if tail[rel : rel + 4] != _ZIP64_EOCD or rel + 56 > len(tail):
            raise CorruptCheckpointError(f"{url}: zip64 end-of-directory record missing")
        (_, _, _, _, _, _, _, count, cd_size, cd_offset) = struct.unpack_from(
            "<4sQHHIIQQQQ", tail, rel
        )
    return count, cd_size, cd_offset


def parse_directory(tail: bytes, tail_start: int, object_size: int, url: str) -> Directory:
    """Parse the central directory from ``tail`` (the object's bytes from ``tail_start``).

    Raises ``NeedMoreBytes(start)`` when ``tail`` does not reach back far enough; the caller
    fetches from ``start`` and calls again.
    """
    count, cd_size, cd_offset = _eocd(tail, tail_start, url)
    if cd_offset + cd_size > object_size:
        raise CorruptCheckpointError(f"{url}: central directory lies past the end (truncated?)")
    rel = cd_offset - tail_start
    if rel < 0:
        raise NeedMoreBytes(cd_offset)
    entries: dict[str, Entry] = {}
    pos = rel
    end = len(tail)
    unpack = _CENTRAL_ENTRY.unpack_from
    for _ in range(count):
        if pos + _CENTRAL_SIZE > end or tail[pos : pos + 4] != _CENTRAL:
            raise CorruptCheckpointError(f"{url}: damaged central directory entry at {pos}")
        (flags, method, crc, csize, usize, name_len, extra_len, comment_len, offset) = unpack(
            tail, pos
        )
        name_start = pos + _CENTRAL_SIZE
        name = tail[name_start : name_start + name_len].decode("utf-8", "replace")
        zip64 = 0xFFFFFFFF in (csize, usize, offset)
        if zip64:
            extra = tail[name_start + name_len : name_start + name_len + extra_len]
            usize, csize, offset = _zip64_extra(extra, usize, csize, offset, url, name)
        if offset + LOCAL_HEADER_SIZE + csize > cd_offset:
            raise CorruptCheckpointError(
                f"{url}: record {name!r} claims bytes past the end of the archive"
            )
        if method == 0 and csize != usize:
            raise CorruptCheckpointError(
                f"{url}: record {name!r} is stored uncompressed, yet its directory "
                f"entry gives {csize} stored and {usize} original bytes"
            )
        entries[name] = Entry(name, offset, usize, csize, crc, method, flags, zip64)
        pos = name_start + name_len + extra_len + comment_len
    _infer_local_headers(entries, cd_offset, url)
    return Directory(entries=entries, cd_offset=cd_offset, cd_size=cd_size)


def _zip64_extra(
    extra: bytes, usize: int, csize: int, offset: int, url: str, name: str
) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            fields = extra[pos + 4 : pos + 4 + size]
            values = list(struct.unpack_from(f"<{len(fields) // 8}Q", fields))
            try:
                if usize == 0xFFFFFFFF:
                    usize = values.pop(0)
                if csize == 0xFFFFFFFF:
                    csize = values.pop(0)
                if offset == 0xFFFFFFFF:
                    offset = values.pop(0)
            except IndexError:  # fewer values than the entry needs
                break
            return usize, csize, offset
        pos += 4 + size
    raise CorruptCheckpointError(f"{url}: record {name!r} lacks its zip64 sizes")


def _infer_local_headers(entries: dict[str, Entry], cd_offset: int, url: str) -> None:
    """Each local header spans from its offset to the data that ends at the next header.

    Records written by a streaming zip writer (torch's, flag bit 3) are followed by a
    data descriptor: 16 bytes with its signature, 24 when the entry is zip64 (the
    layout torch's writer uses). Anything that does not fit is marked unknown and the
    reader fetches that local header before planning its reads.
    """
    ordered = sorted(entries.values(), key=lambda e: e.header_offset)
    following = [e.header_offset for e in ordered[1:]] + [cd_offset] if ordered else []
    for entry, nxt in zip(ordered, following, strict=True):
        descriptor = (24 if entry.zip64 else 16) if entry.flags & 0x08 else 0
        size = nxt - entry.header_offset - entry.compressed_size - descriptor
        minimum = LOCAL_HEADER_SIZE + len(entry.name.encode())
        if entry.header_offset + minimum + entry.compressed_size > nxt:
            # Records that overlap would let one file's bytes stand for many records
            # (and allocations many times the object's size): never written so.
            raise CorruptCheckpointError(
                f"{url}: record {entry.name!r} overlaps the record or directory after it"
            )
        if size < minimum or size > minimum + 0xFFFF:
            entry.local_header_size = -1  # unknown: the reader fetches the header first
        else:
            entry.local_header_size = size


def check_local_header(header: bytes | memoryview, entry: Entry, url: str) -> None:
    """Verify that ``header`` is ``entry``'s local header and that its size was right."""
    header = bytes(header)
    if len(header) < LOCAL_HEADER_SIZE or header[:4] != _LOCAL:
        raise CorruptCheckpointError(f"{url}: record {entry.name!r} has no local header")
    name_len, extra_len = _NAME_EXTRA.unpack_from(header, 26)
    name = header[LOCAL_HEADER_SIZE : LOCAL_HEADER_SIZE + name_len].decode("utf-8", "replace")
    if name != entry.name or LOCAL_HEADER_SIZE + name_len + extra_len != entry.local_header_size:
        raise CorruptCheckpointError(
            f"{url}: local header of record {entry.name!r} does not match the directory"
        )


def check_record_crc(where: str, name: str, stored: int, read: int) -> None:
    """Refuse a record whose bytes' CRC-32 (``read``) is not the one its archive stores."""
    if read != stored:
        raise ChecksumError(
            f"{where}: record {name!r} fails its CRC-32 check (stored {stored:08x}, "
            f"read {read:08x}): the object is corrupted"
        )


def local_header_size(header: bytes) -> int:
    """Size of a local header from its first 30 bytes."""
    if header[:4] != _LOCAL:
        raise CorruptCheckpointError("missing local header")
    name_len, extra_len = struct.unpack_from("<HH", header, 26)
    return LOCAL_HEADER_SIZE + name_len + extra_len


def inflate(stored: bytes | bytearray | memoryview, limit: int) -> bytes:
    """A deflated zip record's bytes, never more than ``limit`` of them."""
    return zlib.decompressobj(-15).decompress(stored, limit)


def check_records(data: bytes | bytearray | memoryview, where: str) -> Directory:
    """Check every record of a ``torch.save`` archive held in memory by its zip CRC-32.

    Stored records are checked as they are, deflated ones by their inflated bytes (as a
    loader reads them). A damaged directory or local header, or a record past the end,
    is a :class:`CorruptCheckpointError`; a record whose bytes do not match its CRC-32
    a :class:`ChecksumError`. Used by the DCP reader, ``cloudckpt verify`` and
    :func:`~cloudckpt.format.torch.unpickle.load_torch_bytes`; returns the directory.
    """
    view = memoryview(data)
    start = max(0, len(view) - (1 << 20))  # the directory sits at the end
    while True:
        try:
            directory = parse_directory(bytes(view[start:]), start, len(view), where)
            break
        except NeedMoreBytes as more:
            if not 0 <= more.start < start:
                raise CorruptCheckpointError(f"{where}: damaged zip directory") from None
            start = more.start
    for e in directory.entries.values():
        if e.local_header_size < 0:
            if e.header_offset + 30 > len(view):
                raise CorruptCheckpointError(f"{where}: record {e.name!r} lies past the end")
            header = bytes(view[e.header_offset : e.header_offset + 30])
            e.local_header_size = local_header_size(header)
        if e.end > len(view):
            raise CorruptCheckpointError(f"{where}: record {e.name!r} lies past the end")
        check_local_header(view[e.header_offset : e.data_offset], e, where)
        stored = view[e.data_offset : e.end]
        if e.method == 0:
            crc = crc32(stored)
        elif e.method == 8:
            try:
                crc = crc32(inflate(stored, e.size + 1))
            except zlib.error as exc:
                raise CorruptCheckpointError(f"{where}: record {e.name!r}: {exc}") from None
        else:
            raise CorruptCheckpointError(f"{where}: record {e.name!r} uses compression {e.method}")
        check_record_crc(where, e.name, e.crc32, crc)
    return directory

"""Checksums of what a DCP load reads: CRC-32 per block of large records, per whole chunk.

A rank often reads only part of a saved tensor (resharding), so one CRC-32 over a whole
storage record cannot check it. :class:`CloudStorageWriter` therefore records, in the
layout index, the CRC-32 of every ``block_size`` bytes of each large tensor record
(:func:`block_crcs`) and the CRC-32 of every chunk a reader reads whole (small archives,
byte items). A small tensor record is also placed in the index with its own zip CRC-32,
so that a reader can read it straight into its destination instead of reading the
archive whole; part of one is read as the record's one block (:func:`one_block`).
The reader widens each slice it reads to block boundaries and checks every block it
covers (:class:`BlockCheck`); chunks read whole are checked against their CRC-32,
or, without a layout index, against the zip CRC-32 of each record
(:func:`check_zip_records`). All of them use :func:`cloudckpt.format.checksum.crc32`,
the same CRC-32 the rest of the library uses.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import ChecksumError
from ...store import byte_view
from ..checksum import crc32
from ..torch.zipdir import check_records as check_zip_records

__all__ = [
    "MAX_BLOCK",
    "MIN_BLOCK",
    "BlockCheck",
    "block_crcs",
    "block_size_for",
    "check_chunk",
    "check_zip_records",
    "one_block",
    "valid_block_size",
]

#: Smallest block the writer uses: below this, one more request costs more than the
#: bytes a larger block makes a slice read (see the ``read_gap`` option).
MIN_BLOCK = 64 * 1024
#: Largest block the writer uses: a slice reads at most two blocks more than it needs.
MAX_BLOCK = 1024 * 1024
#: The writer aims at this many blocks per record (between the two sizes above).
_BLOCKS_PER_RECORD = 64
#: Block sizes a reader accepts from a layout index (powers of two in this range).
_ACCEPTED_BLOCKS = (4 * 1024, 64 * 1024 * 1024)


def block_size_for(record_size: int) -> int:
    """The block size for a record: about 1/64 of it, a power of two in 64 KiB..1 MiB."""
    size = MIN_BLOCK
    while size < MAX_BLOCK and size * 2 * _BLOCKS_PER_RECORD <= record_size:
        size *= 2
    return size


def one_block(record_size: int) -> int:
    """The block size that makes a record one block: the least power of two (4 KiB at
    least) that holds it, so that the record's own zip CRC-32 is its block's."""
    size = _ACCEPTED_BLOCKS[0]
    while size < record_size:
        size *= 2
    return size


def valid_block_size(value: object) -> bool:
    """Whether a block size read from a layout index is one a writer could have used."""
    low, high = _ACCEPTED_BLOCKS
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and low <= value <= high
        and value & (value - 1) == 0
    )


def block_count(record_size: int, block_size: int) -> int:
    """Blocks covering a record of ``record_size`` bytes (the last one may be short)."""
    return -(-record_size // block_size)


def block_crcs(data: memoryview, block_size: int) -> bytes:
    """CRC-32 of each ``block_size`` bytes of ``data``, 4 bytes little-endian each."""
    out = bytearray()
    for pos in range(0, data.nbytes, block_size):
        out += crc32(data[pos : pos + block_size]).to_bytes(4, "little")
    return bytes(out)


class BlockCheck:
    """Checks the blocks of a record covered by ``pieces``, once they have been read.

    ``pieces`` are the buffers one read fills, in order; together they hold the record's
    bytes from ``start`` (a block boundary) to a block boundary or the record's end.
    ``where`` says which bytes these are in a message: the data object's URL, the
    position of the record in it, and the tensor's name.
    """

    def __init__(
        self,
        pieces: Sequence[memoryview],
        start: int,
        block_size: int,
        crcs: bytes,
        record_size: int,
        record_offset: int,
        where: tuple[str, str],
    ) -> None:
        self.pieces = list(pieces)
        self.start = start
        self.block_size = block_size
        self.crcs = crcs
        self.record_size = record_size
        self.record_offset = record_offset
        self.where = where

    def __call__(self) -> None:
        size = self.block_size
        block = self.start // size
        block_end = min((block + 1) * size, self.record_size)
        pos = self.start
        crc = 0
        for piece in self.pieces:
            view = byte_view(piece)
            used = 0
            while used < view.nbytes:
                take = min(view.nbytes - used, block_end - pos)
                crc = crc32(view[used : used + take], crc)
                used += take
                pos += take
                if pos == block_end:
                    self._compare(block, crc)
                    block += 1
                    block_end = min((block + 1) * size, self.record_size)
                    crc = 0
        if pos != block_end and pos != block * size:  # pragma: no cover - planning bug
            raise AssertionError(f"block check ended at {pos}, inside block {block}")

    def _compare(self, block: int, crc: int) -> None:
        stored = int.from_bytes(self.crcs[4 * block : 4 * block + 4], "little")
        if crc != stored:
            url, name = self.where
            first = self.record_offset + block * self.block_size
            last = self.record_offset + min((block + 1) * self.block_size, self.record_size)
            raise ChecksumError(
                f"{url}: bytes {first}-{last} ({name}, block {block} of its record) fail "
                f"their CRC-32 check (stored {stored:08x}, read {crc:08x}): the object is "
                "corrupted"
            )


def check_chunk(data: bytes | bytearray | memoryview, expected: int, where: str) -> None:
    """Compare a chunk read whole with the CRC-32 the layout index recorded for it."""
    crc = crc32(data)
    if crc != expected:
        raise ChecksumError(
            f"{where} fail their CRC-32 check (stored {expected:08x}, read {crc:08x}): "
            "the object is corrupted"
        )

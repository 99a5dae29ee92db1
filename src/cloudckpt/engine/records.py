"""Reading a ``torch.save`` archive's storage records, each checked where it lands.

Three ways, by what the load knows when it starts reading:

- :class:`RecordReads`, when the storages are already allocated (``keys=``, a shared
  load): large records are read straight into their storage, runs of small neighbours
  into one buffer and copied out of it.
- :class:`PlacedRecords`, when every record is wanted (a plain load): each record's
  place is decided from the zip directory alone and all reads are sent before
  ``data.pkl`` is unpickled. Large records get a storage of their own; small ones land
  in shared page-aligned blocks, and the storage of each is built over its bytes in the
  block, with no copy. Such a storage is not resizable (as with ``torch.load(...,
  mmap=True)``); a block is freed when the last tensor over it is (docs/format.md,
  "Reading").
- :class:`MappedRecords`, for a local file loaded with ``mmap=True``: no read at all,
  each storage built over a copy-on-write mapping of the file.

Each record's local header and CRC-32 are checked in the thread that read it (mapped:
once the structure says which records are wanted).
"""

from __future__ import annotations

import functools
import mmap
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .._runtime import memview
from ..format.checksum import crc32
from ..format.torch.storages import fixed_storage
from ..format.torch.unpickle import StorageRef
from ..format.torch.zipdir import Entry, check_local_header, check_record_crc
from ..io.ranges import RangeReader

__all__ = [
    "BATCH_BYTES",
    "BATCH_GAP",
    "SMALL_RECORD",
    "MappedRecords",
    "PlacedRecords",
    "RecordReads",
    "check_record",
    "read_record",
    "storage_view",
]

#: Records of at most this many bytes are read with their neighbours into one buffer:
#: one request, one receive loop and one check pass for hundreds of them. Larger records
#: are read straight into their storage.
SMALL_RECORD = 256 * 1024
#: A buffer of small records spans at most this many bytes (the reader still joins
#: neighbouring buffers into reads of up to ``read_chunk_size``).
BATCH_BYTES = 4 * 1024 * 1024
#: Small records this far apart or more are not batched together (torch aligns records
#: with padding inside the header, so neighbours normally touch).
BATCH_GAP = 64 * 1024
#: torch aligns each record's data to this many bytes in the archive; a block starts at
#: such a boundary, so the data in it is aligned in memory as in the file.
_ALIGN = 64


def storage_view(storage: torch.UntypedStorage) -> memoryview:
    """A writable view of a CPU storage's memory (no copy)."""
    return memview.storage_view(storage)


def check_record(url: str, entry: Entry, header: memoryview, data: memoryview) -> None:
    """Refuse a record whose local header or CRC-32 is not the directory's."""
    check_local_header(header, entry, url)
    check_record_crc(url, entry.name, entry.crc32, crc32(data))


def read_record(
    reader: RangeReader, key: str, url: str, entry: Entry, dest: memoryview, owner: object
) -> None:
    """Add the read of one record (its local header, then its data into ``dest``, a view
    of ``owner``'s memory)."""
    header = memoryview(bytearray(entry.local_header_size))
    check = functools.partial(check_record, url, entry, header, dest)
    reader.add(key, entry.header_offset, [header, dest], check, owner)


def _joins(start: int, end: int, entry: Entry, gap: int) -> bool:
    """Whether ``entry`` joins the batch spanning ``[start, end)``: it follows within
    ``gap`` bytes and the batch stays within ``BATCH_BYTES``."""
    return 0 <= entry.header_offset - end <= gap and entry.end - start <= BATCH_BYTES


def _batches(entries: Iterable[Entry], gap: int) -> Iterable[tuple[list[Entry], int, int]]:
    """Runs of small neighbouring records, in the order given: (records, start, end)."""
    batch: list[Entry] = []
    start = end = 0
    for entry in entries:
        if batch and not _joins(start, end, entry, gap):
            yield batch, start, end
            batch = []
        if not batch:
            start = entry.header_offset
        batch.append(entry)
        end = entry.end
    if batch:
        yield batch, start, end


def _small(entry: Entry) -> bool:
    return entry.size <= SMALL_RECORD and entry.local_header_size >= 0


class RecordReads:
    """Adds the reads of records into storages already allocated: large ones straight
    in, runs of small neighbours into one buffer, copied out (:meth:`flush` before
    ``run``)."""

    def __init__(self, reader: RangeReader, key: str, url: str) -> None:
        self._reader = reader
        self._key, self._url = key, url
        #: (record, where it goes, what owns that memory): the owners are held by the
        #: batch's check, which copies into their memory, until it has run.
        self._batch: list[tuple[Entry, memoryview, object]] = []

    def add(self, entry: Entry, dest: memoryview, owner: object) -> None:
        """Read ``entry`` into ``dest``, a view of ``owner``'s memory."""
        if not _small(entry):
            read_record(self._reader, self._key, self._url, entry, dest, owner)
            return
        if self._batch:
            start, end = self._batch[0][0].header_offset, self._batch[-1][0].end
            if not _joins(start, end, entry, min(BATCH_GAP, self._reader.options.read_gap)):
                self.flush()
        self._batch.append((entry, dest, owner))

    def flush(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        start = batch[0][0].header_offset
        buffer = memoryview(bytearray(batch[-1][0].end - start))
        check = functools.partial(self._copy_checked, batch, buffer, start)
        self._reader.add(self._key, start, buffer, check)

    def _copy_checked(
        self, batch: list[tuple[Entry, memoryview, object]], buffer: memoryview, start: int
    ) -> None:
        """Copy each record of a batch read into its storage, and check it there."""
        for entry, dest, _owner in batch:
            at = entry.header_offset - start
            data = at + entry.local_header_size
            dest[:] = buffer[data : data + entry.size]
            check_record(self._url, entry, buffer[at:data], dest)


class _Block:
    """Small records read together into one page-aligned block of memory."""

    __slots__ = ("entries", "memory", "start")

    def __init__(self, entries: list[Entry], start: int, end: int) -> None:
        self.entries = entries
        self.start = start - start % _ALIGN
        self.memory = mmap.mmap(-1, end - self.start)


_direct: dict[torch.dtype, bool] = {}


def _frombuffer_takes(dtype: torch.dtype) -> bool:
    """Whether ``torch.frombuffer`` builds tensors of ``dtype`` (not quantized ones)."""
    found = _direct.get(dtype)
    if found is None:
        try:
            torch.frombuffer(bytearray(16), dtype=dtype, count=1)
            found = True
        except (RuntimeError, TypeError, ValueError):
            found = False
        _direct[dtype] = found
    return found


class PlacedRecords:
    """Every storage record of an archive placed from its directory, and its read added
    to ``reader``: large records into storages of their own, runs of small ones into
    shared blocks (the storages over them are built by :meth:`storage`)."""

    def __init__(self, reader: RangeReader, key: str, url: str, records: Iterable[Entry]) -> None:
        self._url = url
        self._lock = threading.Lock()
        #: Blocks read while the caller still builds the structure, checked after it.
        self._unchecked: list[_Block] | None = []
        self._own: dict[str, torch.UntypedStorage] = {}
        self._in_block: dict[str, tuple[_Block, int]] = {}
        ordered = sorted(records, key=lambda e: e.header_offset)
        aligned = [e for e in ordered if _small(e) and e.data_offset % _ALIGN == 0]
        gap = min(BATCH_GAP, reader.options.read_gap)
        for batch, start, end in _batches(aligned, gap):
            block = _Block(batch, start, end)
            for entry in batch:
                self._in_block[entry.name] = (block, entry.data_offset - block.start)
            check = functools.partial(self._block_read, block)
            reader.add(key, block.start, memoryview(block.memory), check)
        for entry in ordered:
            if entry.name not in self._in_block:
                storage = fixed_storage(entry.size)
                self._own[entry.name] = storage
                read_record(reader, key, url, entry, storage_view(storage), storage)

    def _block_read(self, block: _Block) -> None:
        """A block's bytes are in: check it, or leave it to :meth:`check_arrived`
        (checking 10,000 records holds the interpreter lock ~60 ms, and a reading thread
        that holds it while the caller unpickles stalls every torch call there)."""
        with self._lock:
            if self._unchecked is not None:
                self._unchecked.append(block)
                return
        self._check_block(block)

    def check_arrived(self) -> None:
        """Check the blocks that arrived so far; those arriving later are checked by the
        thread that reads them. Call once, when the structure is built."""
        with self._lock:
            arrived, self._unchecked = self._unchecked or [], None
        for block in arrived:
            self._check_block(block)

    def _check_block(self, block: _Block) -> None:
        view = memoryview(block.memory)
        for entry in block.entries:
            at = entry.header_offset - block.start
            data = at + entry.local_header_size
            check_record(self._url, entry, view[at:data], view[data : data + entry.size])

    def storage(
        self, entry: Entry, ref: StorageRef
    ) -> tuple[torch.UntypedStorage, torch.Tensor | None]:
        """The storage holding ``entry``'s bytes (once they are read), and a 1-D tensor
        of ``ref.dtype`` over all of it where one was made on the way (else None)."""
        own = self._own.get(entry.name)
        if own is not None:
            return own, None
        if not ref.nbytes:
            return fixed_storage(0), None
        block, at = self._in_block[entry.name]
        return _storage_over(block.memory, at, ref)


def _storage_over(
    memory: mmap.mmap, at: int, ref: StorageRef
) -> tuple[torch.UntypedStorage, torch.Tensor | None]:
    """A storage over ``ref.nbytes`` of ``memory`` from ``at`` (no copy; it keeps the
    mapping alive), and the 1-D tensor of ``ref.dtype`` made on the way (else None)."""
    if _frombuffer_takes(ref.dtype):
        count = ref.nbytes // ref.dtype.itemsize
        tensor = torch.frombuffer(memory, dtype=ref.dtype, count=count, offset=at)
        return tensor.untyped_storage(), tensor
    tensor = torch.frombuffer(memory, dtype=torch.uint8, count=ref.nbytes, offset=at)
    return tensor.untyped_storage(), None


class MappedRecords:
    """The storage records of a local archive as a copy-on-write mapping of its file
    (``load(..., mmap=True)``): each storage is built over its record's bytes in the
    mapping, with no read and no copy; a write to a tensor copies only the pages it
    touches, and the file is never changed. :meth:`check` then checks each wanted
    record's local header and CRC-32 over the mapping, several records at once."""

    def __init__(self, memory: mmap.mmap, url: str) -> None:
        self._memory = memory
        self._url = url

    def storage(
        self, entry: Entry, ref: StorageRef
    ) -> tuple[torch.UntypedStorage, torch.Tensor | None]:
        """The storage of ``entry`` over the mapping; a copy when the record's data is
        not aligned as torch writes it (another writer's archive)."""
        if not ref.nbytes:
            return fixed_storage(0), None
        if entry.data_offset % _ALIGN:
            storage = fixed_storage(entry.size)
            view = memoryview(self._memory)[entry.data_offset : entry.data_offset + entry.size]
            storage_view(storage)[:] = view
            return storage, None
        return _storage_over(self._memory, entry.data_offset, ref)

    def check(self, entries: Iterable[Entry], workers: int) -> None:
        """Check every record in ``entries`` (local header, CRC-32) over the mapping,
        on up to ``workers`` threads (the CRC releases the interpreter lock); the first
        failure is raised."""
        batches: list[list[Entry]] = [[]]
        filled = 0
        for entry in sorted(entries, key=lambda e: e.header_offset):
            if filled >= BATCH_BYTES:
                batches.append([])
                filled = 0
            batches[-1].append(entry)
            filled += entry.size
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="cloudckpt-check") as pool:
            for done in [pool.submit(self._check_batch, b) for b in batches if b]:
                done.result()

    def _check_batch(self, entries: list[Entry]) -> None:
        view = memoryview(self._memory)
        try:
            for e in entries:
                header = view[e.header_offset : e.data_offset]
                check_record(self._url, e, header, view[e.data_offset : e.data_offset + e.size])
        finally:
            view.release()

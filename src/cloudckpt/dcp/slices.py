"""How a DCP load's chunks reach their destinations: checked, sliced, delivered.

:class:`SliceReader` serves :class:`~cloudckpt.dcp.reader.CloudStorageReader`'s
``read_data``: it schedules the byte span of each requested slice of a saved tensor
(straight into the destination where it can, widened to checksum blocks), the check of
every chunk read whole, and hands what was read to DCP's planner (tensor archives of
the usual shape parsed where they lie, anything else through the trust boundary of
format/torch/unpickle.py). Every refusal is a typed error naming the object, the bytes and
the item.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .._runtime.memview import tensor_view
from .._runtime.pages import populate
from ..errors import CloudCkptError, CorruptCheckpointError
from ..format.checksum import crc32
from ..format.dcp.archive import ArchiveParses, SavedTensor, parse_archive
from ..format.dcp.checks import BlockCheck, check_chunk, check_zip_records, one_block
from ..format.dcp.layout import WHOLE_LIMIT
from ..format.dcp.metadata import ChunkIndex
from ..format.torch.unpickle import load_torch_bytes
from .destinations import Destinations
from .fetch import RangeFetcher
from .location import CheckpointLocation

__all__ = [
    "HEAD_PROBE",
    "TAIL_PROBE",
    "Archive",
    "Slice",
    "SliceReader",
    "item_names",
    "read_whole",
]

#: Bytes read from the start of a large archive: its local headers and data.pkl.
HEAD_PROBE = 4096
#: Bytes read from the end of a large archive: its zip directory.
TAIL_PROBE = 8192


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return tensor_view(tensor)


def narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The slice of ``tensor`` at ``offsets`` with ``lengths`` (a view)."""
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or n != tensor.size(dim):
            tensor = tensor.narrow(dim, off, n)
    return tensor


@dataclass
class Archive:
    """One stored chunk (a ``torch.save`` archive, or raw bytes) and the reads it serves."""

    relative: str
    offset: int
    length: int
    items: list[ReadItem] = field(default_factory=list)
    whole: bytearray | None = None
    head: bytearray | None = None
    tail: bytearray | None = None
    #: The stream extensions the chunk was written through (torch's ``_extensions``), in
    #: the order its descriptors list them: such a chunk is read whole and decoded.
    transforms: tuple[Any, ...] = ()


@dataclass
class Slice:
    """A planned read of part of a saved tensor into its destination."""

    item: ReadItem
    target: torch.Tensor
    scratch: torch.Tensor | None = None  # bytes to copy from when not read in place
    saved: SavedTensor | None = None


def _flat(a: Archive, saved: SavedTensor) -> torch.Tensor:
    """The storage record of an archive read whole, as a flat tensor of its dtype (a
    view of the bytes read)."""
    assert a.whole is not None
    count = saved.record_size // saved.dtype.itemsize
    return torch.frombuffer(a.whole, dtype=saved.dtype, count=count, offset=saved.data_offset)


def _whole_into(
    a: Archive, saved: SavedTensor, target: torch.Tensor, lengths: tuple[int, ...]
) -> bool:
    """Copy the whole saved tensor's bytes into ``target`` when that is one copy of the
    record (the slice is the whole tensor, dense over its record, and the destination a
    contiguous CPU tensor of its dtype); False to copy through a view instead."""
    if (
        lengths != saved.size
        or not saved.dense
        or target.dtype != saved.dtype
        or not target.is_cpu
        or not target.is_contiguous()
    ):
        return False
    assert a.whole is not None
    start = saved.data_offset
    tensor_bytes(target)[:] = memoryview(a.whole)[start : start + saved.record_size]
    return True


class _RecordCheck:
    """The check of a storage record read straight into its destination: its CRC-32
    against the one the layout index recorded (the message built only on failure)."""

    __slots__ = ("crc", "fqn", "start", "url", "view")

    def __init__(self, view: memoryview, crc: int, url: str, start: int, fqn: str) -> None:
        self.view, self.crc, self.url, self.start, self.fqn = view, crc, url, start, fqn

    def __call__(self) -> None:
        if crc32(self.view) != self.crc:
            end = self.start + self.view.nbytes
            where = f"{self.url} bytes {self.start}-{end} ({self.fqn}, its storage record)"
            check_chunk(self.view, self.crc, where)


def _contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of a tensor of ``sizes`` (in elements)."""
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def read_whole(a: Archive) -> bool:
    """Small chunks, byte items and encoded chunks are read whole; large tensor archives
    by slice."""
    return (
        a.length <= WHOLE_LIMIT
        or bool(a.transforms)
        or any(i.type == LoadItemType.BYTE_IO for i in a.items)
    )


def item_names(a: Archive) -> str:
    """The first few items a chunk serves, for messages."""
    names = sorted({i.storage_index.fqn for i in a.items})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class SliceReader:
    """The checks, slices and deliveries of one load of the checkpoint at ``location``."""

    def __init__(
        self,
        location: CheckpointLocation,
        chunks: ChunkIndex | None,
        weights_only: bool,
        dest: Destinations,
    ) -> None:
        self.location = location
        self.dest = dest  # the load's planner: where each item goes
        self._chunks = chunks
        self.weights_only = weights_only
        #: The archives this load has parsed (never kept past it).
        self.parses = ArchiveParses()
        self._urls: dict[str, str] = {}  # each object's name checked once, not per item

    def _url(self, relative: str) -> str:
        """The URL of the data object ``relative`` (a name that escapes the prefix is
        refused, the first time it is asked for)."""
        url = self._urls.get(relative)
        if url is None:
            url = self._urls[relative] = self.location.url_of(relative)
        return url

    def check_sizes(self, whole: list[Archive]) -> None:
        """Before allocating a large chunk read whole, make sure its object holds it."""
        sizes: dict[str, int] = {}
        for a in whole:
            if a.length <= WHOLE_LIMIT:
                continue
            if a.relative not in sizes:
                sizes[a.relative] = self.location.store.head(self.location.key(a.relative)).size
            if a.offset + a.length > sizes[a.relative]:
                raise CorruptCheckpointError(
                    f"{self._url(a.relative)} holds {sizes[a.relative]} bytes; "
                    f".metadata places {item_names(a)} at bytes {a.offset}-{a.offset + a.length}"
                )

    def whole_check(self, a: Archive, crc: int | None) -> Callable[[], None]:
        """The check of a chunk read whole: its CRC-32 from the layout index, or else the
        zip CRC-32 of each record (byte items that are not archives have none; an encoded
        chunk's records are checked once decoded)."""
        self._url(a.relative)  # refuse a bad name now, in the planning thread

        def check() -> None:
            assert a.whole is not None
            if crc is not None:
                if crc32(a.whole) != crc:  # the message (item names) only on failure
                    check_chunk(a.whole, crc, self._where(a))
            elif not a.transforms:
                self._check_records(a, self._where(a))

        return check

    def _where(self, a: Archive) -> str:
        """The chunk's object, bytes and items, for messages."""
        url = self._url(a.relative)
        return f"{url} bytes {a.offset}-{a.offset + a.length} ({item_names(a)})"

    @staticmethod
    def _check_records(a: Archive, where: str) -> None:
        """The zip CRC-32 of each record of a chunk read whole, when it is an archive."""
        assert a.whole is not None
        if a.whole[:4] == b"PK\x03\x04" or any(i.type != LoadItemType.BYTE_IO for i in a.items):
            check_zip_records(a.whole, where)

    def _decode(self, a: Archive) -> None:
        """Undo the stream extensions a chunk was written through, as FileSystemReader
        does (each extension's ``transform_from`` in turn), then check its records."""
        assert a.whole is not None
        where = self._where(a)
        stream: Any = io.BytesIO(a.whole)
        try:
            for extension in a.transforms:
                stream = extension.transform_from(stream)
            a.whole = bytearray(stream.read(-1))
        except Exception as exc:
            names = [e.get_descriptor() for e in a.transforms]
            raise CorruptCheckpointError(f"{where} do not decode through {names}: {exc}") from exc
        self._check_records(a, where)

    def _chunk_of(self, item: ReadItem, url: str) -> tuple[tuple[int, ...], torch.dtype]:
        found = self._chunks.get(item.storage_index) if self._chunks is not None else None
        if found is None:
            raise CorruptCheckpointError(
                f"{url}: .metadata describes no saved chunk of {item.storage_index.fqn} at "
                f"offsets {list(item.storage_index.offset or [])}"
            )
        return found

    def _load_bytes(self, a: Archive, item: ReadItem, url: str) -> None:
        """Hand a byte item to the planner, after the trust boundary accepted it.

        With ``weights_only`` (the default) the bytes are loaded through the boundary
        (format/torch/unpickle.py); torch's ``DefaultLoadPlanner`` is given that object as its
        ``load_bytes`` would set it, so its ``torch.load(weights_only=False)`` never
        runs; any other planner gets the accepted bytes. ``weights_only=False`` hands
        the bytes to the planner as they are (an explicit opt-in)."""
        assert a.whole is not None
        planner: Any = getattr(self.dest.planner, "wrapped", self.dest.planner)
        where = f"{url} bytes {a.offset}-{a.offset + a.length} ({item.storage_index.fqn})"
        if self.weights_only:
            obj = load_torch_bytes(a.whole, weights_only=True, url=where)
            if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
                fqn = item.dest_index.fqn
                if planner.flatten_state_dict:
                    set_element(planner.original_state_dict, planner.mappings[fqn], obj)
                else:
                    planner.state_dict[fqn] = obj
                return
        try:
            planner.load_bytes(item, io.BytesIO(a.whole))
        except CloudCkptError:
            raise
        except Exception as exc:  # the planner's own load of the bytes
            raise CorruptCheckpointError(f"{where} could not be loaded: {exc}") from exc

    def deliver_whole(self, a: Archive) -> None:
        """Hand a fully read chunk to the planner.

        A tensor archive of the usual shape (one tensor, stored records, little-endian)
        is parsed where it lies and its slices copied straight from the storage record:
        a third of the CPU of ``torch.load`` per archive, which is most of a load of
        many small tensors. Anything else is loaded through the trust boundary
        (``FileSystemReader`` would ``torch.load`` it).
        """
        assert a.whole is not None
        if a.transforms:
            self._decode(a)
        url = self._url(a.relative)
        if all(i.type != LoadItemType.BYTE_IO for i in a.items):
            record = self._record_in(a, url)
            if record is not None:
                saved, flat = record
                for item in a.items:
                    target, lengths, first = self.slice_of(a, saved, item, url)
                    # A whole tensor: its record's bytes copied straight into the
                    # destination; else a copy through a strided view of the record.
                    if math.prod(lengths) and not _whole_into(a, saved, target, lengths):
                        if flat is None:
                            flat = _flat(a, saved)
                        source = flat.as_strided(lengths, saved.stride, first)
                        copy_into(target, source, url, item.storage_index.fqn)
                    self.dest.commit(item, target)
                return
        loaded: torch.Tensor | None = None
        for item in a.items:
            if item.type == LoadItemType.BYTE_IO:
                self._load_bytes(a, item, url)
                continue
            if loaded is None:
                where = f"{url} bytes {a.offset}-{a.offset + a.length} ({item.storage_index.fqn})"
                loaded = load_torch_bytes(a.whole, map_location="cpu", url=where)
                if not isinstance(loaded, torch.Tensor):
                    raise CorruptCheckpointError(
                        f"{url}: {item.storage_index.fqn} holds {type(loaded).__name__}"
                    )
            sizes, dtype = self._chunk_of(item, url)
            if tuple(loaded.shape) != sizes or loaded.dtype != dtype:
                raise CorruptCheckpointError(
                    f"{url}: bytes {a.offset}-{a.offset + a.length} hold a {loaded.dtype} "
                    f"tensor of shape {tuple(loaded.shape)}; .metadata says "
                    f"{item.storage_index.fqn} is {dtype} {sizes}"
                )
            if len(item.storage_offsets) != loaded.dim() or any(
                o < 0 or o + n > s
                for o, n, s in zip(item.storage_offsets, item.lengths, loaded.shape, strict=True)
            ):
                raise CorruptCheckpointError(
                    f"{url}: {item.storage_index.fqn} asks for offsets "
                    f"{tuple(item.storage_offsets)} lengths {tuple(item.lengths)} of a saved "
                    f"chunk of shape {tuple(loaded.shape)}"
                )
            source = narrow(loaded, item.storage_offsets, item.lengths)
            target = self.dest.resolve(item)
            if target.size() != source.size():
                raise CorruptCheckpointError(
                    f"{url}: {item.storage_index.fqn} slice has shape {tuple(source.shape)}, "
                    f"the destination {tuple(target.shape)}"
                )
            copy_into(target, source, url, item.storage_index.fqn)
            self.dest.commit(item, target)

    def _record_in(self, a: Archive, url: str) -> tuple[SavedTensor, torch.Tensor | None] | None:
        """The tensor of an archive read whole and, where it is empty, its storage record
        as a flat tensor (else None: :func:`_flat` makes one when a slice needs it), or
        None when ``torch.load`` must read it."""
        assert a.whole is not None
        data = bytes(a.whole[:HEAD_PROBE])
        where = f"{url} bytes {a.offset}-{a.offset + a.length}"
        size = len(a.whole)  # the chunk's length, or its decoded length
        saved = parse_archive(data, bytes(a.whole[-TAIL_PROBE:]), size, where, self.parses)
        if saved is None or saved.data_offset + saved.record_size > size:
            return None
        itemsize = saved.dtype.itemsize
        if saved.record_size % itemsize or saved.data_offset % itemsize:
            return None
        if saved.record_size == 0:
            return saved, torch.empty(0, dtype=saved.dtype)
        return saved, None

    def slice_of(
        self,
        a: Archive,
        saved: SavedTensor,
        item: ReadItem,
        url: str,
        target: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[int, ...], int]:
        """``item``'s destination (``target`` when the caller resolved it), its lengths
        and the element of the storage record where the slice starts, once the saved
        tensor is the one ``.metadata`` describes, the slice lies inside it and inside its
        record, and the destination has its shape."""
        fqn = item.storage_index.fqn
        sizes, dtype = self._chunk_of(item, url)
        if saved.size != sizes or saved.dtype != dtype:
            raise CorruptCheckpointError(
                f"{url}: bytes {a.offset}-{a.offset + a.length} hold a {saved.dtype} tensor "
                f"of shape {saved.size}; .metadata says {fqn} is {dtype} {sizes}"
            )
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if len(lengths) != len(saved.size) or any(
            o < 0 or o + n > s for o, n, s in zip(offsets, lengths, saved.size, strict=True)
        ):
            raise CorruptCheckpointError(
                f"{url}: {fqn} asks for offsets {offsets} lengths {lengths} "
                f"of a saved chunk of shape {saved.size}"
            )
        first = saved.storage_offset + sum(
            o * st for o, st in zip(offsets, saved.stride, strict=True)
        )
        if math.prod(lengths):
            last = first + sum((n - 1) * st for n, st in zip(lengths, saved.stride, strict=True))
            if (
                saved.storage_offset < 0
                or any(st < 0 for st in saved.stride)
                or (last + 1) * saved.dtype.itemsize > saved.record_size
            ):
                raise CorruptCheckpointError(
                    f"{url}: {fqn} lies past the end of its storage record"
                )
        if target is None:
            target = self.dest.resolve(item)
        if tuple(target.shape) != lengths:
            raise CorruptCheckpointError(
                f"{url}: {fqn} slice has shape {lengths}, the destination {tuple(target.shape)}"
            )
        return target, lengths, first

    def plan_record(
        self,
        a: Archive,
        record: tuple[int, int],
        item: ReadItem,
        fetcher: RangeFetcher,
    ) -> Slice:
        """Schedule ``item`` from a small storage record the layout index places
        (``record``: where its bytes start in the chunk, their CRC-32): the tensor is the
        chunk ``.metadata`` describes, contiguous. A whole tensor into a contiguous CPU
        destination of its dtype is read straight into it and checked there, the common
        case kept to a few calls (thousands of small tensors); anything else is a slice
        of the record read as one block (:meth:`plan_slice`)."""
        url = self._url(a.relative)
        sizes, dtype = self._chunk_of(item, url)
        data_offset, crc = record
        record_size = math.prod(sizes) * dtype.itemsize
        if data_offset + record_size > a.length:
            raise CorruptCheckpointError(
                f"{url}: the layout index places {item.storage_index.fqn} at bytes "
                f"{data_offset}-{data_offset + record_size} of a chunk of {a.length} bytes"
            )
        target = self.dest.resolve(item)
        if (
            record_size
            and target.dtype is dtype
            and target.is_cpu
            and target.is_contiguous()
            and target.shape == sizes
            and tuple(item.lengths) == sizes
            and not any(item.storage_offsets)
        ):
            populate(target.data_ptr(), record_size)  # fresh memory: faulted in here, not in recv
            view = tensor_view(target)  # record_size bytes (the record's shape and dtype)
            start = a.offset + data_offset
            check = _RecordCheck(view, crc, url, start, item.storage_index.fqn)
            fetcher.add(a.relative, start, view, check, target)
            return Slice(item, target)
        saved = SavedTensor(
            dtype=dtype,
            storage_offset=0,
            size=sizes,
            stride=_contiguous(sizes),
            data_offset=data_offset,
            record_size=record_size,
            block_size=one_block(record_size),
            block_crcs=crc.to_bytes(4, "little"),
        )
        return self.plan_slice(a, saved, item, fetcher, target)

    def plan_slice(
        self,
        a: Archive,
        saved: SavedTensor,
        item: ReadItem,
        fetcher: RangeFetcher,
        target: torch.Tensor | None = None,
    ) -> Slice:
        """Schedule the byte span holding ``item``'s slice of a saved tensor, and its check.

        With block checksums the span is widened to block boundaries: the extra bytes
        (less than a block at each end) go to small scratch buffers, the span itself
        still straight into the destination, and every block is checked once read.
        Without them, a slice that is the whole record is checked by its zip CRC-32; a
        partial slice of an archive written without a layout index is not checked.
        """
        url = self._url(a.relative)
        fqn = item.storage_index.fqn
        target, lengths, first = self.slice_of(a, saved, item, url, target)
        numel = math.prod(lengths)
        if numel == 0:
            return Slice(item, target)
        itemsize = saved.dtype.itemsize
        span = sum((n - 1) * st for n, st in zip(lengths, saved.stride, strict=True)) + 1
        dense = span == numel and all(
            n == 1 or st == math.prod(lengths[d + 1 :])
            for d, (n, st) in enumerate(zip(lengths, saved.stride, strict=True))
        )
        result = Slice(item, target)
        if (
            dense
            and target.device.type == "cpu"
            and target.dtype == saved.dtype
            and target.is_contiguous()
        ):
            middle, owner = tensor_bytes(target), target
        else:
            result = Slice(item, target, torch.empty(span * itemsize, dtype=torch.uint8), saved)
            assert result.scratch is not None
            middle, owner = tensor_bytes(result.scratch), result.scratch
        record = a.offset + saved.data_offset  # where the record's bytes start in the object
        lo, hi = first * itemsize, (first + span) * itemsize
        if saved.block_size:
            self._add_checked(a, saved, lo, hi, middle, owner, fetcher, f"{fqn}")
        elif saved.record_crc is not None and lo == 0 and hi == saved.record_size:
            expected = saved.record_crc
            where = f"{url} bytes {record}-{record + hi} ({fqn}, its storage record)"
            check = functools.partial(check_chunk, middle, expected, where)
            fetcher.add(a.relative, record, middle, check, owner)
        else:
            fetcher.add(a.relative, record + lo, middle, None, owner)
        return result

    def _add_checked(
        self,
        a: Archive,
        saved: SavedTensor,
        lo: int,
        hi: int,
        middle: memoryview,
        owner: torch.Tensor,
        fetcher: RangeFetcher,
        name: str,
    ) -> None:
        """Read record bytes ``[lo, hi)`` into ``middle`` widened to whole blocks, each
        request a run of whole blocks (up to ``read_chunk_size``) checked when it lands."""
        size = saved.block_size
        start = lo // size * size
        end = min(-(-hi // size) * size, saved.record_size)
        pieces = [
            (start, memoryview(bytearray(lo - start))),
            (lo, middle),
            (hi, memoryview(bytearray(end - hi))),
        ]
        record = a.offset + saved.data_offset
        where = (self._url(a.relative), name)
        group = max(size, self.location.options.read_chunk_size // size * size)
        for g_start in range(start, end, group):
            g_end = min(g_start + group, end)
            views = [
                view[max(g_start, pos) - pos : min(g_end, pos + view.nbytes) - pos]
                for pos, view in pieces
                if pos < g_end and pos + view.nbytes > g_start
            ]
            check = BlockCheck(
                views, g_start, size, saved.block_crcs, saved.record_size, record, where
            )
            fetcher.add(a.relative, record + g_start, views, check, owner)


def copy_into(target: torch.Tensor, source: torch.Tensor, url: str, fqn: str) -> None:
    """``target.copy_(source)``; a copy torch cannot make (a quantized or bit dtype the
    checkpoint's metadata gives, into the destination's) is CorruptCheckpointError
    naming the item, not torch's own error from deep inside the load."""
    try:
        target.copy_(source)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise CorruptCheckpointError(
            f"{url}: {fqn} is stored as {source.dtype} {tuple(source.shape)}, which cannot "
            f"be copied into its destination ({target.dtype} {tuple(target.shape)}): {exc}"
        ) from None

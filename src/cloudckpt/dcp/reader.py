"""``CloudStorageReader``: torch.distributed.checkpoint's StorageReader for every cloudckpt store.

DCP calls it in this order (from ``dcp.load``)::

    0) all ranks    reset(checkpoint_id)          when a checkpoint_id is passed
    1) all ranks    read_metadata()               .metadata, the commit marker, and the
                                                  layout index (which checks .metadata)
    2) all ranks    set_up_storage_reader(metadata, is_coordinator)
    3) all ranks    prepare_local_plan(plan)
    4) coordinator  prepare_global_plan(plans)
    5) all ranks    read_data(plan, planner)

``read_data`` reads only the bytes this rank needs, in two rounds of coalesced,
concurrent ranged reads: first small archives whole plus the head and tail of each
large one whose place the layout index does not give (where ``data.pkl`` and the zip
directory sit), then exactly the byte span of each requested slice, straight into the
destination tensor when it is a contiguous CPU tensor of the saved dtype (otherwise
into a scratch buffer, copied). Every read is checked in the thread that made it:
slices of large records by the CRC-32 of each block they cover (the read is widened to
block boundaries into small scratch buffers), chunks read whole by their CRC-32 (see
:mod:`cloudckpt.format.dcp.checks`).
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine.memview import writable_view
from ..engine.scheduler import TransferGroup
from ..errors import (
    BucketNotFoundError,
    ChecksumError,
    CloudCkptError,
    CorruptCheckpointError,
    NotFoundError,
    UnsafeCheckpointError,
)
from ..format.checksum import crc32
from ..format.dcp.archive import SavedTensor, parse_archive
from ..format.dcp.checks import BlockCheck, check_chunk, check_zip_records
from ..format.dcp.index import LayoutIndex, parse_index, read_document
from ..format.dcp.layout import WHOLE_LIMIT, layout_name, metadata_name
from ..format.dcp.metadata import ChunkIndex, decode_metadata
from ..options import TransferOptions, resolve_options
from .fetch import RangeFetcher
from .location import CheckpointLocation, LocatedCheckpoint

__all__ = ["CloudStorageReader"]
#: Bytes read from the start of a large archive: its local headers and data.pkl.
HEAD_PROBE = 4096
#: Bytes read from the end of a large archive: its zip directory.
TAIL_PROBE = 8192


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    return writable_view(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        if off != 0 or n != tensor.size(dim):
            tensor = tensor.narrow(dim, off, n)
    return tensor


@dataclass
class _Archive:
    """One stored chunk (a ``torch.save`` archive, or raw bytes) and the reads it serves."""

    relative: str
    offset: int
    length: int
    items: list[ReadItem] = field(default_factory=list)
    whole: bytearray | None = None
    head: bytearray | None = None
    tail: bytearray | None = None


@dataclass
class _Slice:
    """A planned read of part of a saved tensor into its destination."""

    item: ReadItem
    target: torch.Tensor
    scratch: torch.Tensor | None = None  # bytes to copy from when not read in place
    saved: SavedTensor | None = None


class CloudStorageReader(LocatedCheckpoint, StorageReader):
    """Reads a DCP checkpoint from ``url`` (any store cloudckpt supports).

    Loads checkpoints written by :class:`CloudStorageWriter` and by torch's
    ``FileSystemWriter`` (uploaded as is). Keyword arguments are
    :class:`~cloudckpt.TransferOptions` fields (``read_concurrency``,
    ``read_chunk_size``, ``storage_options``...).

    Non-tensor items (DCP's byte items) are unpickled by the planner with
    ``weights_only=False``; with ``weights_only=True`` (the default) the reader first
    checks each one with torch's weights-only unpickler and refuses, with
    :class:`~cloudckpt.errors.UnsafeCheckpointError`, one that names anything else
    (a class, a function): a data object from a bucket cannot run code on load.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        weights_only: bool = True,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.location = CheckpointLocation(url, resolve_options(options, url=url, **overrides))
        self.weights_only = weights_only
        self.storage_data: dict[Any, Any] = {}
        self.rank: int | None = None
        self.use_collectives = True
        self._save_id: str | None = None
        self._chunks: ChunkIndex | None = None
        self._index: LayoutIndex | None = None
        self._index_read = False
        #: The layout index read with ``.metadata`` by read_metadata: (save id, index).
        self._read_with: tuple[str, LayoutIndex] | None = None
        #: Requests and bytes of the last ``read_data`` (both rounds).
        self.last_read_requests = 0
        self.last_read_bytes = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` when given."""
        self.storage_data = {}
        self._save_id, self._chunks, self._index, self._index_read = None, None, None, False
        self._read_with = None
        if checkpoint_id:
            self.location = CheckpointLocation(checkpoint_id, self.location.options)

    # -- metadata ------------------------------------------------------------------------
    def _layout_payload(self, rank: int | None) -> bytes | None:
        """The layout index's bytes beside ``metadata_name(rank)``; None when absent."""
        store, key = self.location.store, self.location.key(layout_name(rank))
        try:
            return store.get(key)
        except BucketNotFoundError:
            raise
        except NotFoundError:
            return None

    def _layout_document(self, rank: int | None) -> dict[str, Any] | None:
        """The layout index as a JSON object; None when absent."""
        url = self.location.url_of(layout_name(rank))
        payload = self._layout_payload(rank)
        return None if payload is None else read_document(payload, url)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The commit marker, checked against the layout index written with it.

        A checkpoint without ``.metadata`` is not loadable. When the layout index of the
        same save is there, ``.metadata``'s bytes must match the CRC-32 it holds. Both
        are read at once.
        """
        rank = kwargs.get("rank")
        name = metadata_name(rank)
        url = self.location.url_of(name)
        store, key = self.location.store, self.location.key(name)
        group = TransferGroup(self.location.options, 2)
        try:
            marker = group.submit(lambda: store.get(key), f"read {url}")
            layout = group.submit(lambda: self._layout_payload(rank), f"read layout of {url}")
            group.wait()
        except BucketNotFoundError:
            raise
        except NotFoundError:
            raise NotFoundError(
                f"no committed checkpoint at {self.url}: {url} does not exist (a save that "
                "did not finish leaves none)"
            ) from None
        payload, raw = marker.result(), layout.result()
        doc = None if raw is None else read_document(raw, self.location.url_of(layout_name(rank)))
        expected = doc.get("metadata_crc32") if doc is not None else None
        vouched = type(expected) is int and expected == crc32(payload)
        metadata = decode_metadata(payload, url, scan=not vouched)
        save_id = _save_id(metadata)
        self._read_with = None
        if doc is not None and save_id and doc.get("save_id") == save_id:
            layout_url = self.location.url_of(layout_name(rank))
            index = parse_index(doc, layout_url)  # checks metadata_crc32 is a CRC-32
            if expected is not None and not vouched:
                raise ChecksumError(
                    f"{url} fails the CRC-32 check recorded in {layout_url} (stored "
                    f"{expected:08x}, read {crc32(payload):08x}): the object is corrupted"
                )
            self._read_with = (save_id, index)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the item -> (object, offset, length) map of the checkpoint."""
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.url}: .metadata has no storage data")
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._save_id = _save_id(metadata)
        self._chunks = ChunkIndex(metadata)
        self._index, self._index_read = None, False
        if self._read_with is not None and self._save_id == self._read_with[0]:
            self._index, self._index_read = self._adopt(self._read_with[1]), True

    def _layout_index(self) -> LayoutIndex | None:
        """cloudckpt's index of large tensors' byte offsets and checksums, if this save
        wrote one (read with ``.metadata``, or here when the metadata came from elsewhere).

        Trusted only when its save id is the one in ``.metadata``: a checkpoint later
        overwritten by another writer leaves a stale index, which is then ignored.
        """
        if self._index_read:
            return self._index
        self._index_read = True
        if not self._save_id:
            return None
        rank = None if self.use_collectives else self.rank
        doc = self._layout_document(rank)
        if doc is not None and doc.get("save_id") == self._save_id:
            self._index = self._adopt(parse_index(doc, self.location.url_of(layout_name(rank))))
        return self._index

    def _adopt(self, index: LayoutIndex) -> LayoutIndex:
        """The index, once every chunk it names is one ``.metadata`` has (else damaged)."""
        chunks = {(info.relative_path, info.offset) for info in self.storage_data.values()}
        for where in (*index.archives, *index.chunks):
            if where not in chunks:
                rank = None if self.use_collectives else self.rank
                raise CorruptCheckpointError(
                    f"{self.location.url_of(layout_name(rank))} is damaged: it describes "
                    f"bytes {where[1]}+ of {where[0]}, where .metadata has no item; delete "
                    "it to load the checkpoint without the checksums of partial reads"
                )
        return index

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    # -- data ----------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch what ``plan`` needs, check it, and hand it to ``planner``."""
        archives: dict[tuple[str, int], _Archive] = {}
        for item in plan.items:
            try:
                info = self.storage_data[item.storage_index]
            except KeyError:
                raise CorruptCheckpointError(
                    f"{self.url}: .metadata has no storage entry for {item.storage_index}"
                ) from None
            descriptors = getattr(info, "transform_descriptors", None)
            if descriptors:
                raise CorruptCheckpointError(
                    f"{self.url}: {item.storage_index.fqn} was written with stream transforms "
                    f"{list(descriptors)}, which CloudStorageReader does not apply; load this "
                    "checkpoint with torch's FileSystemReader"
                )
            k = (info.relative_path, info.offset)
            archive = archives.get(k)
            if archive is None:
                archive = archives[k] = _Archive(info.relative_path, info.offset, info.length)
            elif archive.length != info.length:
                raise CorruptCheckpointError(
                    f"{self.url}: .metadata gives bytes {info.offset}+ of {info.relative_path} "
                    f"two lengths ({archive.length} and {info.length})"
                )
            archive.items.append(item)

        self.last_read_requests = self.last_read_bytes = 0
        index = self._layout_index() if archives else None
        self._check_sizes([a for a in archives.values() if _read_whole(a)])
        slices: list[_Slice] = []
        with RangeFetcher(self.location, stream=True) as first:
            self._plan_first(archives, index, planner, first, slices)
            self._run(first)
        for a in archives.values():
            if a.whole is not None:
                self._deliver_whole(a, planner)
                a.whole = None

        fallback: list[_Archive] = []
        with RangeFetcher(self.location, stream=True) as second:
            for a in archives.values():
                if a.head is None or a.tail is None:
                    continue
                url = self.location.url_of(a.relative)
                where = f"{url} bytes {a.offset}-{a.offset + a.length}"
                saved = parse_archive(bytes(a.head), bytes(a.tail), a.length, where)
                a.head = a.tail = None
                if saved is None:
                    a.whole = bytearray(a.length)
                    second.add(
                        a.relative, a.offset, memoryview(a.whole), self._whole_check(a, None)
                    )
                    fallback.append(a)
                    continue
                for item in a.items:
                    slices.append(self._plan_slice(a, saved, item, planner, second))
            self._run(second)
        for a in fallback:
            self._deliver_whole(a, planner)
            a.whole = None
        for s in slices:
            if s.scratch is not None and s.saved is not None:
                src = s.scratch.view(s.saved.dtype).as_strided(
                    tuple(s.item.lengths), s.saved.stride, 0
                )
                s.target.copy_(src)
            planner.commit_tensor(s.item, s.target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _plan_first(
        self,
        archives: dict[tuple[str, int], _Archive],
        index: LayoutIndex | None,
        planner: LoadPlanner,
        first: RangeFetcher,
        slices: list[_Slice],
    ) -> None:
        """The first round: chunks read whole, slices the layout index places, and the
        head and tail of every other archive (to find its tensor in the second round)."""
        for a in archives.values():
            if _read_whole(a):
                a.whole = bytearray(a.length)
                crc = index.chunks.get((a.relative, a.offset)) if index is not None else None
                first.add(a.relative, a.offset, memoryview(a.whole), self._whole_check(a, crc))
            elif index is not None and (known := index.archives.get((a.relative, a.offset))):
                if not known.dense or known.data_offset + known.record_size > a.length:
                    raise CorruptCheckpointError(
                        f"{self.location.url_of(layout_name(None))}: the entry of "
                        f"{a.relative}@{a.offset} does not describe a tensor archive of "
                        f"{a.length} bytes"
                    )
                for item in a.items:  # written by us: read the spans in this round
                    slices.append(self._plan_slice(a, known, item, planner, first))
            else:
                a.head, a.tail = bytearray(HEAD_PROBE), bytearray(TAIL_PROBE)
                first.add(a.relative, a.offset, memoryview(a.head))
                first.add(a.relative, a.offset + a.length - TAIL_PROBE, memoryview(a.tail))

    def _run(self, fetcher: RangeFetcher) -> None:
        fetcher.run()
        self.last_read_requests += fetcher.requests
        self.last_read_bytes += fetcher.bytes

    def _check_sizes(self, whole: list[_Archive]) -> None:
        """Before allocating a large chunk read whole, make sure its object holds it."""
        sizes: dict[str, int] = {}
        for a in whole:
            if a.length <= WHOLE_LIMIT:
                continue
            if a.relative not in sizes:
                sizes[a.relative] = self.location.store.head(self.location.key(a.relative)).size
            if a.offset + a.length > sizes[a.relative]:
                raise CorruptCheckpointError(
                    f"{self.location.url_of(a.relative)} holds {sizes[a.relative]} bytes; "
                    f".metadata places {_names(a)} at bytes {a.offset}-{a.offset + a.length}"
                )

    def _whole_check(self, a: _Archive, crc: int | None) -> Callable[[], None]:
        """The check of a chunk read whole: its CRC-32 from the layout index, or else the
        zip CRC-32 of each record (byte items that are not archives have none)."""
        where = (
            f"{self.location.url_of(a.relative)} bytes {a.offset}-{a.offset + a.length} "
            f"({_names(a)})"
        )

        def check() -> None:
            assert a.whole is not None
            if crc is not None:
                check_chunk(a.whole, crc, where)
            elif a.whole[:4] == b"PK\x03\x04" or any(
                i.type != LoadItemType.BYTE_IO for i in a.items
            ):
                check_zip_records(a.whole, where)

        return check

    def _chunk_of(self, item: ReadItem, url: str) -> tuple[tuple[int, ...], torch.dtype]:
        found = self._chunks.get(item.storage_index) if self._chunks is not None else None
        if found is None:
            raise CorruptCheckpointError(
                f"{url}: .metadata describes no saved chunk of {item.storage_index.fqn} at "
                f"offsets {list(item.storage_index.offset or [])}"
            )
        return found

    def _vet_bytes(self, a: _Archive, item: ReadItem, url: str) -> None:
        """Refuse a byte item that torch's weights-only unpickler refuses."""
        assert a.whole is not None
        try:
            torch.load(io.BytesIO(a.whole), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as exc:
            raise UnsafeCheckpointError(
                f"{url}: {item.storage_index.fqn} holds objects that weights_only loading "
                f"does not allow: {exc}. If you trust this checkpoint, pass "
                "CloudStorageReader(..., weights_only=False); to allow a specific class, "
                "use torch.serialization.add_safe_globals([...])."
            ) from exc
        except Exception:  # damaged bytes: the planner's own load reports them
            pass

    def _deliver_whole(self, a: _Archive, planner: LoadPlanner) -> None:
        """Hand a fully read chunk to the planner.

        A tensor archive of the usual shape (one tensor, stored records, little-endian)
        is parsed where it lies and its slices copied straight from the storage record:
        a third of the CPU of ``torch.load`` per archive, which is most of a load of
        many small tensors. Anything else is unpickled by ``torch.load``, as
        FileSystemReader does.
        """
        assert a.whole is not None
        url = self.location.url_of(a.relative)
        if all(i.type != LoadItemType.BYTE_IO for i in a.items):
            record = self._record_in(a, url)
            if record is not None:
                saved, flat = record
                for item in a.items:
                    target, lengths, first = self._slice_of(a, saved, item, planner, url)
                    if math.prod(lengths):
                        target.copy_(flat.as_strided(lengths, saved.stride, first))
                    planner.commit_tensor(item, target)
                return
        loaded: torch.Tensor | None = None
        for item in a.items:
            if item.type == LoadItemType.BYTE_IO:
                if self.weights_only:
                    self._vet_bytes(a, item, url)
                try:
                    planner.load_bytes(item, io.BytesIO(a.whole))
                except CloudCkptError:
                    raise
                except Exception as exc:  # the default planner: torch.load of the bytes
                    raise CorruptCheckpointError(
                        f"{url}: bytes {a.offset}-{a.offset + a.length} "
                        f"({item.storage_index.fqn}) could not be loaded: {exc}"
                    ) from exc
                continue
            if loaded is None:
                try:
                    loaded = torch.load(io.BytesIO(a.whole), map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise CorruptCheckpointError(
                        f"{url}: bytes {a.offset}-{a.offset + a.length} "
                        f"({item.storage_index.fqn}) are not a tensor archive: {exc}"
                    ) from exc
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
            source = _narrow(loaded, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CorruptCheckpointError(
                    f"{url}: {item.storage_index.fqn} slice has shape {tuple(source.shape)}, "
                    f"the destination {tuple(target.shape)}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)

    def _record_in(self, a: _Archive, url: str) -> tuple[SavedTensor, torch.Tensor] | None:
        """The tensor of an archive read whole and its storage record as a flat tensor of
        its dtype (a view of the bytes read), or None when ``torch.load`` must read it."""
        assert a.whole is not None
        data = bytes(a.whole[:HEAD_PROBE])
        where = f"{url} bytes {a.offset}-{a.offset + a.length}"
        saved = parse_archive(data, bytes(a.whole[-TAIL_PROBE:]), a.length, where)
        if saved is None or saved.data_offset + saved.record_size > a.length:
            return None
        itemsize = saved.dtype.itemsize
        if saved.record_size % itemsize or saved.data_offset % itemsize:
            return None
        count = saved.record_size // itemsize
        if count == 0:
            return saved, torch.empty(0, dtype=saved.dtype)
        flat = torch.frombuffer(a.whole, dtype=saved.dtype, count=count, offset=saved.data_offset)
        return saved, flat

    def _slice_of(
        self, a: _Archive, saved: SavedTensor, item: ReadItem, planner: LoadPlanner, url: str
    ) -> tuple[torch.Tensor, tuple[int, ...], int]:
        """``item``'s destination, its lengths and the element of the storage record where
        the slice starts, once the saved tensor is the one ``.metadata`` describes, the
        slice lies inside it and inside its record, and the destination has its shape."""
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
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise CorruptCheckpointError(
                f"{url}: {fqn} slice has shape {lengths}, the destination {tuple(target.shape)}"
            )
        return target, lengths, first

    def _plan_slice(
        self,
        a: _Archive,
        saved: SavedTensor,
        item: ReadItem,
        planner: LoadPlanner,
        fetcher: RangeFetcher,
    ) -> _Slice:
        """Schedule the byte span holding ``item``'s slice of a saved tensor, and its check.

        With block checksums the span is widened to block boundaries: the extra bytes
        (less than a block at each end) go to small scratch buffers, the span itself
        still straight into the destination, and every block is checked once read.
        Without them, a slice that is the whole record is checked by its zip CRC-32; a
        partial slice of an archive written without a layout index is not checked.
        """
        url = self.location.url_of(a.relative)
        fqn = item.storage_index.fqn
        target, lengths, first = self._slice_of(a, saved, item, planner, url)
        numel = math.prod(lengths)
        if numel == 0:
            return _Slice(item, target)
        itemsize = saved.dtype.itemsize
        span = sum((n - 1) * st for n, st in zip(lengths, saved.stride, strict=True)) + 1
        dense = span == numel and all(
            n == 1 or st == math.prod(lengths[d + 1 :])
            for d, (n, st) in enumerate(zip(lengths, saved.stride, strict=True))
        )
        result = _Slice(item, target)
        if (
            dense
            and target.device.type == "cpu"
            and target.dtype == saved.dtype
            and target.is_contiguous()
        ):
            middle = _tensor_bytes(target)
        else:
            result = _Slice(item, target, torch.empty(span * itemsize, dtype=torch.uint8), saved)
            assert result.scratch is not None
            middle = _tensor_bytes(result.scratch)
        record = a.offset + saved.data_offset  # where the record's bytes start in the object
        lo, hi = first * itemsize, (first + span) * itemsize
        if saved.block_size:
            self._add_checked(a, saved, lo, hi, middle, fetcher, f"{fqn}")
        elif saved.record_crc is not None and lo == 0 and hi == saved.record_size:
            expected = saved.record_crc
            where = f"{url} bytes {record}-{record + hi} ({fqn}, its storage record)"
            fetcher.add(a.relative, record, middle, lambda: check_chunk(middle, expected, where))
        else:
            fetcher.add(a.relative, record + lo, middle)
        return result

    def _add_checked(
        self,
        a: _Archive,
        saved: SavedTensor,
        lo: int,
        hi: int,
        middle: memoryview,
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
        where = (self.location.url_of(a.relative), name)
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
            fetcher.add(a.relative, record + g_start, views, check)


def _read_whole(a: _Archive) -> bool:
    return a.length <= WHOLE_LIMIT or any(i.type == LoadItemType.BYTE_IO for i in a.items)


def _names(a: _Archive) -> str:
    names = sorted({i.storage_index.fqn for i in a.items})
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _save_id(metadata: Metadata) -> str | None:
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return save_id if isinstance(save_id, str) else None

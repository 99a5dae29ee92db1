"""``CloudStorageWriter``: torch.distributed.checkpoint's StorageWriter for every cloudckpt store.

DCP calls it in this order (from ``dcp.save`` / ``dcp.async_save``)::

    0) all ranks    reset(checkpoint_id)          when a checkpoint_id is passed
    1) all ranks    set_up_storage_writer(is_coordinator, rank=...)
    2) all ranks    prepare_local_plan(plan)
    3) coordinator  prepare_global_plan(plans)    removes a previous .metadata (or refuses)
    4) all ranks    write_data(plan, planner)     streams the rank's data objects
    5) coordinator  finish(metadata, results)     writes .metadata, only after every
                                                  rank's write_data returned its results

Each data object is streamed with :class:`~cloudckpt.io.sink.BorrowingSink` (large
tensor records sent from the tensors' memory, not copied into part buffers): its
parts go through the I/O scheduler (bounded write concurrency and bytes in flight),
and it becomes visible only when complete. A rank that fails aborts its uploads and
DCP never calls ``finish``, so no ``.metadata`` appears. A tensor item's archive is
built as header, storage view and trailer, the bytes ``torch.save`` would write
(:mod:`cloudckpt.format.dcp.tensor_archive`); unusual tensors go through ``torch.save``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import os
import pickle
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._runtime.gcpause import paused_gc
from .._runtime.memview import storage_view, tensor_view
from ..errors import ConfigError
from ..format.checksum import crc32
from ..format.commit import commit_marker
from ..format.dcp.archive import SavedTensor
from ..format.dcp.checks import block_crcs, block_size_for
from ..format.dcp.described import describe_metadata
from ..format.dcp.index import encode_index
from ..format.dcp.layout import (
    DATA_SUFFIX,
    WHOLE_LIMIT,
    StorageInfo,
    auto_fanout,
    data_prefix,
    item_nbytes,
    layout_name,
    metadata_name,
    split_items,
)
from ..format.dcp.sharing import share_in_metadata, share_in_save_plan
from ..format.dcp.tensor_archive import TensorArchive, archive_builder_on, tensor_archive
from ..io.scheduler import Cancelled
from ..io.sink import BORROW_MIN, BorrowingSink, BorrowingWriter
from ..options import TransferOptions
from ..ranks.collectives import world_size
from ..store import byte_view
from ..store.deadline import Deadline, start_deadline, within
from .location import CheckpointLocation, LocatedCheckpoint

__all__ = ["CloudStorageWriter"]

#: What FileSystemWriter of current torch stamps into Metadata.version.
_DCP_VERSION = "1.0.0"
#: Per-item allowance for the zip records around a tensor's bytes in its archive.
_ARCHIVE_OVERHEAD = 4096


def _cpu_tensor(data: Any) -> torch.Tensor:
    """A CPU tensor holding exactly the item's elements (no larger shared storage).

    ``torch.save`` writes a tensor's whole storage, so a view into a larger one (a
    shard cut from a bigger tensor) needs a storage of its own. For a contiguous view
    that is an alias of its bytes (``torch.frombuffer``, no copy); the caller keeps
    ``data`` alive while the alias is in use. Anything else is copied.
    """
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        return tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    if nbytes and tensor.layout == torch.strided and not tensor.is_quantized:
        try:
            alias = torch.frombuffer(tensor_view(tensor), dtype=torch.uint8)
            return alias.view(tensor.dtype).view(tensor.shape)
        except (RuntimeError, TypeError, ValueError):
            pass
    return tensor.clone()


def _built_archive(tensor: torch.Tensor) -> TensorArchive | None:
    """``torch.save(tensor)``'s archive built as header, storage view and trailer
    (:mod:`cloudckpt.format.dcp.tensor_archive`), or None where torch.save must write it."""
    if tensor.device.type != "cpu":
        return None
    return tensor_archive(tensor, storage_view(tensor.untyped_storage()))


@dataclasses.dataclass(frozen=True)
class _Written:
    """What a rank reports for one item: DCP's storage info, and for the layout index
    where a tensor's bytes sit in its archive (with their block CRC-32s) and the CRC-32
    of a chunk readers read whole, each where there is one. Split in ``finish``."""

    info: Any
    saved: SavedTensor | None = None
    crc: int | None = None
    #: A small built archive's storage record: (data_offset, its zip CRC-32).
    record: tuple[int, int] | None = None
    #: On an object's last item: the object's size and the ETag the store gave it.
    made: tuple[int, str | None] | None = None


class _Tap:
    """Forwards ``torch.save``'s writes, noting where the write of ``watch`` bytes began
    (torch writes a storage record's bytes in one call) and the CRC-32 of each block of
    it, while the bytes are in memory; and the CRC-32 of everything written, as long as
    that is small enough to be read whole."""

    def __init__(self, sink: BorrowingWriter, watch: int) -> None:
        self.sink = sink
        self.watch = watch
        self.found: int | None = None
        self.block_size = 0
        self.blocks = b""
        self.written = 0
        self.crc: int | None = 0

    def write(self, data: Any) -> int:
        view = byte_view(data)
        self.written += view.nbytes
        if self.crc is not None:
            self.crc = crc32(view, self.crc) if self.written <= WHOLE_LIMIT else None
        if self.found is None and view.nbytes == self.watch:
            self.found = self.sink.tell()
            if self.watch > WHOLE_LIMIT // 2:  # else the archive is read whole
                self.block_size = block_size_for(self.watch)
                self.blocks = block_crcs(view, self.block_size)
        return self.sink.write(view)

    def flush(self) -> None:
        """Nothing to flush: the sink uploads parts on its own schedule."""


def _write_tensor(
    sink: BorrowingSink, data: Any, build: bool
) -> tuple[SavedTensor | None, int | None, tuple[int, int] | None]:
    """Write a tensor item's ``torch.save`` archive: built as header, storage and trailer
    where ``build`` allows and the tensor is plain (three writes), else by ``torch.save``
    through a tap. Returns what the layout index records: for an archive read by slice,
    where its storage bytes sit and their block CRC-32s; for one read whole, its CRC-32
    and, when built here, where its storage record sits and the record's CRC-32."""
    offset = sink.tell()
    tensor = _cpu_tensor(data)
    nbytes = tensor.numel() * tensor.element_size()
    # A large record is sent from the tensor's memory; what owns it (the item's data,
    # and a CPU copy or alias of it) is kept until it is sent.
    owner = (data, tensor)
    built = _built_archive(tensor) if build else None
    if built is not None:
        sink.write(built.header)
        if built.storage.nbytes >= BORROW_MIN:
            sink.write_borrowed(built.storage, owner)
        else:
            sink.write(built.storage)
        sink.write(built.trailer)
        crc, block_size, blocks = built.crc, built.block_size, built.block_crcs
        found: int | None = offset + built.data_offset
    else:
        own = {tensor.data_ptr(): (nbytes, owner)} if nbytes >= BORROW_MIN else {}
        tap = _Tap(BorrowingWriter(sink, own), nbytes)
        torch.save(tensor, tap)  # type: ignore[arg-type]
        crc, block_size, blocks, found = tap.crc, tap.block_size, tap.blocks, tap.found
    if sink.tell() - offset <= WHOLE_LIMIT:  # read whole: one CRC-32
        # A built archive's record is placed too (its bytes are the tensor's, contiguous):
        # a reader that knows the index reads them straight into the destination.
        record = (built.data_offset, built.record_crc) if built is not None and nbytes else None
        return None, crc, record
    if found is None:  # pragma: no cover - torch.save always writes the storage in one go
        return None, None, None
    saved = SavedTensor(
        dtype=tensor.dtype,
        storage_offset=0,
        size=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        data_offset=found - offset,
        record_size=nbytes,
        block_size=block_size,
        block_crcs=blocks,
    )
    return saved, None, None


class CloudStorageWriter(LocatedCheckpoint, StorageWriter):
    """Writes a DCP checkpoint under ``url`` (``s3://bucket/ckpt/step-100``, a path, ...).

    ``files_per_rank`` data objects are written concurrently by each rank (each one
    uploading ``write_concurrency`` parts at once); ``prefix_fanout`` spreads ranks'
    objects over that many sub-prefixes (default: one per 64 ranks, none up to 64:
    ``format.dcp.layout.auto_fanout``); ``overwrite=False`` refuses a URL that
    already holds a committed checkpoint. Other keyword arguments are
    :class:`~cloudckpt.TransferOptions` fields (``part_size``, ``storage_options``...).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        files_per_rank: int = 1,
        prefix_fanout: int | None = None,
        overwrite: bool = True,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        for name, value in (("files_per_rank", files_per_rank), ("prefix_fanout", prefix_fanout)):
            if value is None and name == "prefix_fanout":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        self.location = CheckpointLocation.resolve(url, options, **overrides)
        self.files_per_rank = files_per_rank
        self.prefix_fanout = prefix_fanout
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self.use_collectives = True
        self._deadline: Deadline | None = None  # set when a save starts
        #: The coordinator's, after ``finish``: each object the save wrote, by its key
        #: under the checkpoint, with its size and the ETag the store gave it.
        self.committed: dict[str, tuple[int, str | None]] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, at ``checkpoint_id`` when given."""
        if checkpoint_id:
            self.location = CheckpointLocation(checkpoint_id, self.location.options)
        self.save_id = uuid.uuid4().hex
        self.committed = None

    def storage_meta(self) -> Any:
        """Checkpoint and save ids recorded in the metadata (torch >= 2.4)."""
        try:
            from torch.distributed.checkpoint.metadata import StorageMeta
        except ImportError:  # pragma: no cover
            return None
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    # -- planning ------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember this instance's role (``rank`` and ``use_collectives`` on newer torch)."""
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        # The save starts here on every rank: its deadline bounds the rest of this
        # rank's part (data and, on the coordinator, the commit).
        self._deadline = start_deadline(self.location.options.deadline)

    def _own_marker(self) -> str:
        rank = None if self.use_collectives or self.rank is None else self.rank
        return metadata_name(rank)

    def _clear_marker(self, name: str) -> None:
        """Remove a previous commit marker before any data is rewritten (or refuse),
        under the save's deadline (started by ``set_up_storage_writer``)."""
        with within(self._deadline):
            self.location.clear_marker(name, self.overwrite)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Without collectives each rank names its own objects and clears its own marker.
        The plan's equal shapes and tensor properties become one object each, so that
        DCP's gather and scatter of plans pickle each once (format/dcp/sharing.py)."""
        plan = share_in_save_plan(plan)
        if not self.use_collectives and self.rank is not None:
            self._clear_marker(self._own_marker())
            return dataclasses.replace(
                plan, storage_data=data_prefix(self.rank, self._fanout(world_size()))
            )
        return plan

    def _fanout(self, world_size: int) -> int:
        return self.prefix_fanout if self.prefix_fanout is not None else auto_fanout(world_size)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: clear the old marker, then give each rank its object name prefix."""
        self._clear_marker(metadata_name())
        fanout = self._fanout(len(plans))
        return [
            dataclasses.replace(plan, storage_data=data_prefix(i, fanout))
            if not isinstance(plan.storage_data, str)
            else plan
            for i, plan in enumerate(plans)
        ]

    # -- data ----------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stream this rank's items into ``files_per_rank`` data objects, concurrently."""
        prefix = plan.storage_data
        if not isinstance(prefix, str):
            prefix = data_prefix(self.rank or 0, self._fanout(world_size()))
        files = [
            (f"{prefix}{n}{DATA_SUFFIX}", bucket)
            for n, bucket in enumerate(split_items(plan.items, self.files_per_rank))
        ]
        cancel = threading.Event()
        results: list[WriteResult] = []
        with paused_gc(kept=True), within(self._deadline):  # a result per item, kept
            results = self._write_all(files, planner, cancel)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_all(
        self,
        files: list[tuple[str, list[WriteItem]]],
        planner: SavePlanner,
        cancel: threading.Event,
    ) -> list[WriteResult]:
        """Each data object's items, the objects written at once."""
        results: list[WriteResult] = []
        if len(files) == 1:
            results = self._write_object(files[0][0], files[0][1], planner, cancel)
        elif files:
            with ThreadPoolExecutor(len(files), thread_name_prefix="cloudckpt-dcp") as pool:
                futures = [
                    # each in a copy of this context: the save's deadline goes along
                    pool.submit(
                        contextvars.copy_context().run,
                        self._write_object,
                        name,
                        items,
                        planner,
                        cancel,
                    )
                    for name, items in files
                ]
                errors: list[BaseException] = []
                for f in futures:
                    try:
                        results += f.result()
                    except BaseException as exc:
                        cancel.set()
                        errors.append(exc)
                real = [e for e in errors if not isinstance(e, Cancelled)]
                if errors:
                    raise (real or errors)[0]
        return results

    def _write_object(
        self,
        relative: str,
        items: Sequence[WriteItem],
        planner: SavePlanner,
        cancel: threading.Event,
    ) -> list[WriteResult]:
        """One data object: each item's bytes (tensors as ``torch.save`` archives) in turn."""
        opts = self.location.options
        store, key = self.location.store, self.location.key(relative)
        size_hint = sum(item_nbytes(i) + _ARCHIVE_OVERHEAD for i in items)
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        sink = BorrowingSink(store, key, opts, size_hint=size_hint)
        build = archive_builder_on()  # torch's serialization options, once per object
        results: list[WriteResult] = []
        try:
            for item in ordered:
                if cancel.is_set():
                    raise Cancelled()
                offset = sink.tell()
                data = planner.resolve_data(item)
                saved: SavedTensor | None = None
                crc: int | None = None
                record: tuple[int, int] | None = None
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise TypeError(f"byte item {item.index.fqn} resolved to {type(data)}")
                    buffer = data.getbuffer()
                    crc = crc32(buffer)  # byte items are always read whole
                    sink.write(buffer)
                    del buffer
                else:
                    saved, crc, record = _write_tensor(sink, data, build)
                length = sink.tell() - offset
                info = StorageInfo(relative, offset, length)
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_Written(info, saved, crc, record),
                    )
                )
            size = sink.commit()
            if results:  # what the manager's commit checks: this object, by its ETag
                last = results[-1]
                made = dataclasses.replace(last.storage_data, made=(size, sink.etag))
                results[-1] = dataclasses.replace(last, storage_data=made)
        except BaseException as exc:
            error = sink.abort_after(exc)
            if error is not exc:  # torch.save wrapped our failure
                raise error from None
            raise
        return results

    # -- commit --------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank's data committed: write ``.metadata`` (the
        marker). ``committed`` then names every object the save wrote, with its size and
        the ETag the store gave it (what the manager's commit checks)."""
        made: dict[str, tuple[int, str | None]] = {}
        for rank_results in results:
            for wr in rank_results:
                written = wr.storage_data
                if isinstance(written, _Written) and written.made is not None:
                    made[written.info.relative_path] = written.made
        with paused_gc(kept=True):  # an entry per item, kept in the metadata returned
            payload, index = self._encode(metadata, results)
        with within(self._deadline):
            layout = layout_name(self._layout_rank())
            made[layout] = (len(index), self.location.store.put(self.location.key(layout), index))
            self._commit(payload)
            made[self._own_marker()] = (len(payload), None)  # create-only: the bytes are ours
        self.committed = made

    def _layout_rank(self) -> int | None:
        return None if self.use_collectives or self.rank is None else self.rank

    def _encode(self, metadata: Metadata, results: list[list[WriteResult]]) -> tuple[bytes, bytes]:
        """``.metadata``'s bytes (with every result's storage info) and the layout index's."""
        storage_md: dict[Any, Any] = {}
        archives: dict[str, Any] = {}
        chunks: dict[str, int] = {}
        records: dict[str, list[int]] = {}
        for rank_results in results:
            for wr in rank_results:
                written = wr.storage_data
                if isinstance(written, _Written):
                    storage_md[wr.index] = written.info
                    where = f"{written.info.relative_path}@{written.info.offset}"
                    if written.saved is not None:
                        archives[where] = written.saved.to_json()
                    if written.crc is not None:
                        chunks[where] = written.crc
                    if written.record is not None:
                        placed = records.get(written.info.relative_path)
                        if placed is None:
                            placed = records[written.info.relative_path] = []
                        placed += (written.info.offset, *written.record)
                else:  # a result from another writer: keep it as DCP gave it
                    storage_md[wr.index] = written
        metadata.storage_data = storage_md
        if hasattr(metadata, "version"):
            metadata.version = _DCP_VERSION
        if hasattr(metadata, "storage_meta"):
            metadata.storage_meta = self.storage_meta()
        share_in_metadata(metadata)  # equal shapes pickled once (format/dcp/sharing.py)
        payload = pickle.dumps(metadata)
        # Written before the marker: a committed checkpoint always has its index, which
        # also holds the CRC-32 of the marker's bytes and a description of them that
        # readers build the metadata from (format/dcp/described.py).
        described = describe_metadata(metadata)
        return payload, encode_index(
            self.save_id, crc32(payload), archives, chunks, records, described
        )

    def _commit(self, payload: bytes) -> None:
        """Write the marker (``.metadata``) once, refusing another save's (format/commit.py)."""
        commit_marker(self.location.store, self.location.key(self._own_marker()), payload)

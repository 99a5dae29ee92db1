"""``CloudStorageReader``: torch.distributed.checkpoint's StorageReader for every cloudckpt store.

DCP calls it in this order (from ``dcp.load``)::

    0) all ranks    reset(checkpoint_id)          when a checkpoint_id is passed
    1) all ranks    read_metadata()               .metadata, the commit marker, and the
                                                  layout index (which checks .metadata)
    2) all ranks    set_up_storage_reader(metadata, is_coordinator)
    3) all ranks    prepare_local_plan(plan)
    4) coordinator  prepare_global_plan(plans)
    5) all ranks    read_data(plan, planner)      a plan marked SharedRead: first every
                                                  rank makes the gloo groups of the
                                                  partition (ranks/groups.py), then each
                                                  part reads once and shares

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

import dataclasses
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._runtime.gcpause import paused_gc
from .._runtime.memview import tensor_view
from ..errors import CorruptCheckpointError, DistributedLoadError, UnsupportedFormatError
from ..format.dcp.archive import parse_archive
from ..format.dcp.index import LayoutIndex, parse_index, save_id_of
from ..format.dcp.layout import layout_name
from ..format.dcp.metadata import ChunkIndex
from ..format.dcp.sharing import share_in_load_plan
from ..options import TransferOptions
from ..ranks.collectives import group_rank, settle
from ..ranks.groups import group_ranks
from ..ranks.share import broadcast_views, part_group, report, share_group_size, split_even
from ..store.deadline import Deadline, start_deadline, within
from .commit_read import adopt, layout_document, read_commit
from .destinations import Destinations
from .fetch import RangeFetcher
from .location import CheckpointLocation, LocatedCheckpoint
from .slices import HEAD_PROBE, TAIL_PROBE, Archive, Slice, SliceReader, copy_into, read_whole

if TYPE_CHECKING:
    from torch.distributed.checkpoint._extension import ExtensionRegistry

__all__ = ["CloudStorageReader", "MetadataOnceReader", "SharedRead"]


@dataclasses.dataclass(frozen=True)
class SharedRead:
    """``LoadPlan.storage_data`` of the plans the coordinator marked for a shared read.

    ``parts`` partitions the world's ranks (each part ascending, parts in order of their
    first rank) by plan: the ranks of a part asked for the same items (the data-parallel
    replicas of one model-parallel shard; the whole world in a DDP resume) and read them
    once between them; a part of one rank reads alone. Every rank's plan carries the
    whole partition, not only its own part, because every rank makes every part's group
    (:func:`cloudckpt.ranks.groups.partition_group`): ``new_group`` is a collective on
    the world. A few bytes a rank in each plan sent (3 to 5 KiB a plan at 1,024 ranks).
    """

    parts: tuple[tuple[int, ...], ...]


class _Recorder:
    """A planner that keeps each tensor it is handed (``commit_tensor``), so a shared
    load sends the bytes this rank read, whatever the planner does with them."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner
        #: The planner byte items are delivered to (dcp/slices.py).
        self.wrapped = planner
        self.committed: dict[int, torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.committed[id(read_item)] = tensor
        self._planner.commit_tensor(read_item, tensor)


class CloudStorageReader(LocatedCheckpoint, StorageReader):
    """Reads a DCP checkpoint from ``url`` (any store cloudckpt supports).

    Loads checkpoints written by :class:`CloudStorageWriter` and by torch's
    ``FileSystemWriter`` (uploaded as is). Keyword arguments are
    :class:`~cloudckpt.TransferOptions` fields (``read_concurrency``,
    ``read_chunk_size``, ``storage_options``...).

    Non-tensor items (DCP's byte items): with ``weights_only=True`` (the default) each
    is loaded through cloudckpt's trust boundary (format/torch/unpickle.py), which refuses,
    with :class:`~cloudckpt.errors.UnsafeCheckpointError`, whatever
    ``torch.load(weights_only=True)`` refuses; torch's ``DefaultLoadPlanner`` is given
    the loaded object (its own ``torch.load(weights_only=False)`` never runs), another
    planner the accepted bytes. ``weights_only=False`` hands the bytes to the planner
    unchecked: only for checkpoints you trust.

    Chunks written through torch's stream extensions (``FileSystemWriter(...,
    _extensions=[ZStandard()])``) are read whole and decoded by the extensions
    ``extension_registry`` names (torch's ``ExtensionRegistry``, by default its built-in
    ones), as ``FileSystemReader`` does; one it does not know is refused with
    :class:`~cloudckpt.errors.UnsupportedFormatError`. ``load_id`` is a new id for each
    load, set in the metadata's ``storage_meta`` as ``FileSystemReader`` sets it.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        weights_only: bool = True,
        extension_registry: ExtensionRegistry | None = None,
        share_reads: bool = True,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.location = CheckpointLocation.resolve(url, options, **overrides)
        self.weights_only = weights_only
        #: When ranks' plans are the same (a replicated state, a DDP resume: every
        #: rank; the data-parallel replicas of each model-parallel shard: each group of
        #: them), each rank of a group reads a share of the tensor data and the group
        #: exchanges it.
        self.share_reads = share_reads
        self.extension_registry = extension_registry
        self.load_id = str(uuid.uuid4())
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
        #: The global ranks the last ``read_data`` shared with (this one among them), or
        #: () where it read alone.
        self.last_shared_with: tuple[int, ...] = ()
        #: This load's deadline, from read_metadata on (store/deadline.py).
        self._deadline: Deadline | None = None
        #: read_metadata started this load's deadline (until reset or read_data).
        self._metadata_read = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` when given."""
        self.storage_data = {}
        self._save_id, self._chunks, self._index, self._index_read = None, None, None, False
        self._read_with = None
        self._metadata_read = False
        self.load_id = str(uuid.uuid4())
        if checkpoint_id:
            self.location = CheckpointLocation(checkpoint_id, self.location.options)

    # -- metadata ------------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The commit marker, checked against the layout index written with it
        (dcp/commit_read.py); both are read at once. Its ``storage_meta`` carries this
        load's ``load_id``, as FileSystemReader's does."""
        # The load starts here on every rank: its deadline bounds the reads to come.
        # torch's fallback to the rank's own marker (a second call, with ``rank=``) is
        # the same load: it keeps the deadline the first call started.
        if not ("rank" in kwargs and self._metadata_read):
            self._deadline = start_deadline(self.location.options.deadline)
        self._metadata_read = True
        with paused_gc(kept=True), within(self._deadline):  # objects per item, kept
            metadata, self._read_with = read_commit(self.location, kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
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
        self._save_id = save_id_of(metadata)
        with paused_gc(kept=True):  # an entry per item, kept for the load
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
        doc = layout_document(self.location, rank)  # (read_data has paused the collector)
        if doc is not None and doc.get("save_id") == self._save_id:
            url = self.location.url_of(layout_name(rank))
            self._index = self._adopt(parse_index(doc, url))
        return self._index

    def _adopt(self, index: LayoutIndex) -> LayoutIndex:
        rank = None if self.use_collectives else self.rank
        return adopt(index, self.storage_data, self.location.url_of(layout_name(rank)))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan's equal shapes made one object each, so that DCP's gather and scatter
        of plans pickle each once (format/dcp/sharing.py)."""
        return share_in_load_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: when two or more ranks ask for the same items, mark every plan
        :class:`SharedRead` with the ranks grouped by plan (a DDP resume: one group of
        all; tensor or pipeline parallel x data parallel, HSDP: one group per shard, of
        its replicas). Decided here, from the plans DCP already gathered, so it costs no
        collective of its own, and only when the load spans the whole world (whose ranks
        all make the groups, in read_data)."""
        parts = self._partition(plans)
        if parts is None:
            return plans
        mark = SharedRead(parts)
        return [dataclasses.replace(p, storage_data=mark) for p in plans]

    def _partition(self, plans: list[LoadPlan]) -> tuple[tuple[int, ...], ...] | None:
        """The ranks grouped by equal plans (the same read items, in the same order), or
        None where no two ranks share: sharing is off, the load spans fewer ranks than
        the world, a plan carries storage data already, or no two plans are equal with a
        tensor to read. A plan's index is its rank: a group of the world's size is the
        world, ranks in order."""
        if not self.share_reads or len(plans) < 2 or share_group_size() != len(plans):
            return None
        if any(p.storage_data is not None for p in plans):
            return None
        by_items: dict[tuple[ReadItem, ...], list[int]] = {}
        for rank, p in enumerate(plans):
            by_items.setdefault(tuple(p.items), []).append(rank)
        parts: list[tuple[int, ...]] = []
        for items, ranks in by_items.items():
            if len(ranks) > 1 and any(i.type != LoadItemType.BYTE_IO for i in items):
                parts.append(tuple(ranks))
            else:  # alone, or nothing to share (byte items are read by every rank)
                parts.extend((r,) for r in ranks)
        if all(len(part) == 1 for part in parts):
            return None
        return tuple(sorted(parts))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch what ``plan`` needs, check it, and hand it to ``planner``; a plan the
        coordinator marked :class:`SharedRead` makes the partition's groups (every rank,
        first, before anything that can fail, so no member waits for one that raised)
        and is then read a share per rank of its group and exchanged within the group."""
        mark = plan.storage_data
        group = part_group(mark.parts) if isinstance(mark, SharedRead) else None
        self.last_shared_with = group_ranks(group) if group is not None else ()
        self._metadata_read = False  # a later read_metadata starts another load
        with paused_gc(kept=True), within(self._deadline):  # objects per item, kept
            if group is not None:
                self._read_shared(plan, planner, group)
            else:
                self._read(plan, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_shared(self, plan: LoadPlan, planner: LoadPlanner, group: Any) -> None:
        """Each of the N ranks of ``group`` reads the tensor items of about 1/N of the
        data (whole archives, contiguous in the checkpoint), byte items all; every rank
        of the group raises if any rank's reads failed (``settle``); then every tensor
        goes from the rank that read and checked it to the others (ranks/share.py).
        Ranks outside the group take no part: they read their own items, and DCP's
        gather of every rank's outcome after read_data fails the load everywhere."""
        me, ranks = group_rank(group)
        tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        archives: dict[tuple[str, int], int] = {}
        for item in sorted(tensors, key=self._place):
            archives.setdefault(self._place(item), self._info(item).length)
        owner_of = dict(zip(archives, split_even(list(archives.values()), ranks), strict=True))
        owners = [owner_of[self._place(i)] for i in tensors]
        mine = [i for i, o in zip(tensors, owners, strict=True) if o == me]
        mine += [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
        error: BaseException | None = None
        recorder = _Recorder(planner)
        try:
            self._read(dataclasses.replace(plan, items=mine), cast(LoadPlanner, recorder))
            total = sum(archives.values())
            report(self.url, group, self.last_read_requests, self.last_read_bytes, total)
        except Exception as exc:
            error = exc
        what = f"the shared load of {self.url}"
        settle(error, what, group=group, error_type=DistributedLoadError)
        views: list[tuple[int, memoryview]] = []
        keep: list[torch.Tensor] = []  # every buffer a view points into, alive till sent
        staged: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        dest = Destinations(planner)
        for item, owner in zip(tensors, owners, strict=True):
            if owner == me:  # what this rank read, as it handed it to the planner
                buf = recorder.committed[id(item)]
                if not (buf.is_contiguous() and buf.device.type == "cpu"):
                    buf = buf.detach().cpu().contiguous()
            else:  # where the planner wants it (a planner may hand out a scratch tensor)
                target = dest.resolve(item)
                buf = target
                if not (target.is_contiguous() and target.device.type == "cpu"):
                    buf = torch.empty(tuple(target.shape), dtype=target.dtype)
                staged.append((item, target, buf))
            keep.append(buf)
            views.append((owner, tensor_view(buf)))
        broadcast_views(group, views)
        for item, target, buf in staged:
            if buf is not target:
                copy_into(target, buf, self.url, item.storage_index.fqn)
            dest.commit(item, target)

    def _info(self, item: Any) -> Any:
        try:
            return self.storage_data[item.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.url}: .metadata has no storage entry for {item.storage_index}"
            ) from None

    def _place(self, item: Any) -> tuple[str, int]:
        info = self._info(item)
        return (info.relative_path, info.offset)

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Fetch ``plan``'s items in two rounds, check them, hand them to ``planner``."""
        archives: dict[tuple[str, int], Archive] = {}
        extensions: dict[tuple[str, ...], tuple[Any, ...]] = {}
        for item in plan.items:
            info = self._info(item)
            descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
            if descriptors not in extensions:
                extensions[descriptors] = self._stream_extensions(
                    descriptors, item.storage_index.fqn
                )
            k = (info.relative_path, info.offset)
            archive = archives.get(k)
            if archive is None:
                archive = archives[k] = Archive(
                    info.relative_path, info.offset, info.length, transforms=extensions[descriptors]
                )
            elif archive.length != info.length or archive.transforms != extensions[descriptors]:
                raise CorruptCheckpointError(
                    f"{self.url}: .metadata describes bytes {info.offset}+ of "
                    f"{info.relative_path} twice: {archive.length} and {info.length} bytes, "
                    f"or through different stream extensions"
                )
            archive.items.append(item)

        self.last_read_requests = self.last_read_bytes = 0
        index = self._layout_index() if archives else None
        slicer = SliceReader(self.location, self._chunks, self.weights_only, Destinations(planner))
        slicer.check_sizes([a for a in archives.values() if read_whole(a)])
        slices: list[Slice] = []
        with RangeFetcher(self.location, stream=True) as first:
            self._plan_first(archives, index, first, slices, slicer)
            self._run(first)
        for a in archives.values():
            if a.whole is not None:
                slicer.deliver_whole(a)
                a.whole = None

        fallback: list[Archive] = []
        with RangeFetcher(self.location, stream=True) as second:
            for a in archives.values():
                if a.head is None or a.tail is None:
                    continue
                url = self.location.url_of(a.relative)
                where = f"{url} bytes {a.offset}-{a.offset + a.length}"
                saved = parse_archive(bytes(a.head), bytes(a.tail), a.length, where, slicer.parses)
                a.head = a.tail = None
                if saved is None:
                    a.whole = bytearray(a.length)
                    second.add(
                        a.relative, a.offset, memoryview(a.whole), slicer.whole_check(a, None)
                    )
                    fallback.append(a)
                    continue
                for item in a.items:
                    slices.append(slicer.plan_slice(a, saved, item, second))
            self._run(second)
        for a in fallback:
            slicer.deliver_whole(a)
            a.whole = None
        for s in slices:
            if s.scratch is not None and s.saved is not None:
                src = s.scratch.view(s.saved.dtype).as_strided(
                    tuple(s.item.lengths), s.saved.stride, 0
                )
                copy_into(s.target, src, self.url, s.item.storage_index.fqn)
            slicer.dest.commit(s.item, s.target)

    def _stream_extensions(self, descriptors: Sequence[str], fqn: str) -> tuple[Any, ...]:
        """The stream extensions that decode a chunk written through ``descriptors``
        (torch's ExtensionRegistry), or UnsupportedFormatError naming the one not known."""
        if not descriptors:
            return ()
        try:
            from torch.distributed.checkpoint._extension import (
                ExtensionRegistry,
                StreamTransformExtension,
            )
        except ImportError:  # torch < 2.7 has no stream extensions
            raise UnsupportedFormatError(
                f"{self.url}: {fqn} was written through the stream extensions "
                f"{list(descriptors)}, which torch {torch.__version__} cannot decode"
            ) from None
        registry = self.extension_registry or ExtensionRegistry()
        found: list[Any] = []
        for descriptor in descriptors:
            try:
                (extension,) = registry.from_descriptor_list([descriptor])
            except Exception as exc:  # ValueError: an unknown name, a missing module
                raise UnsupportedFormatError(
                    f"{self.url}: {fqn} was written through the stream extension "
                    f"{descriptor!r}, which CloudStorageReader cannot decode ({exc}); "
                    "register it in CloudStorageReader(..., extension_registry=...)"
                ) from exc
            if not isinstance(extension, StreamTransformExtension):
                raise UnsupportedFormatError(
                    f"{self.url}: {fqn} names the extension {descriptor!r}, which is not a "
                    "stream extension; CloudStorageReader cannot decode it"
                )
            found.append(extension)
        return tuple(found)

    def _plan_first(
        self,
        archives: dict[tuple[str, int], Archive],
        index: LayoutIndex | None,
        first: RangeFetcher,
        slices: list[Slice],
        slicer: SliceReader,
    ) -> None:
        """The first round: slices the layout index places, chunks read whole, and the
        head and tail of every other archive (to find its tensor in the second round).

        A tensor whose storage record the index places is read straight into its
        destination, whatever its size (cloudckpt's writer places small records too,
        each checked by its own CRC-32); a small chunk it does not place is read whole."""
        places = index.archives if index is not None else {}
        records = index.records if index is not None else {}
        for a in archives.values():
            where = (a.relative, a.offset)
            plain = not a.transforms and all(i.type != LoadItemType.BYTE_IO for i in a.items)
            known = places.get(where) if plain else None
            record = records.get(where) if plain and known is None else None
            if record is not None:
                for item in a.items:
                    slices.append(slicer.plan_record(a, record, item, first))
            elif known is not None:
                if not known.dense or known.data_offset + known.record_size > a.length:
                    raise CorruptCheckpointError(
                        f"{self.location.url_of(layout_name(None))}: the entry of "
                        f"{a.relative}@{a.offset} does not describe a tensor archive of "
                        f"{a.length} bytes"
                    )
                for item in a.items:  # written by us: read the spans in this round
                    slices.append(slicer.plan_slice(a, known, item, first))
            elif read_whole(a):
                a.whole = bytearray(a.length)
                crc = index.chunks.get(where) if index is not None else None
                first.add(a.relative, a.offset, memoryview(a.whole), slicer.whole_check(a, crc))
            else:
                a.head, a.tail = bytearray(HEAD_PROBE), bytearray(TAIL_PROBE)
                first.add(a.relative, a.offset, memoryview(a.head))
                first.add(a.relative, a.offset + a.length - TAIL_PROBE, memoryview(a.tail))

    def _run(self, fetcher: RangeFetcher) -> None:
        fetcher.run()
        self.last_read_requests += fetcher.requests
        self.last_read_bytes += fetcher.bytes


class MetadataOnceReader(CloudStorageReader):
    """A reader for several loads of one checkpoint (an export's batches, megatron's
    steps): ``.metadata`` and its layout index are read by the first load only."""

    _commit: tuple[Metadata, Any] | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._commit is None:
            self._commit = (super().read_metadata(*args, **kwargs), self._read_with)
        metadata, self._read_with = self._commit
        return metadata

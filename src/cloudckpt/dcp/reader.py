"""``CloudStorageReader``: torch.distributed.checkpoint's StorageReader for every cloudckpt store.

DCP calls it in this order (from ``dcp.load``)::

    0) all ranks    reset(checkpoint_id)          when a checkpoint_id is passed
    1) all ranks    read_metadata()               .metadata, the commit marker
    2) all ranks    set_up_storage_reader(metadata, is_coordinator)
    3) all ranks    prepare_local_plan(plan)
    4) coordinator  prepare_global_plan(plans)
    5) all ranks    read_data(plan, planner)

``read_data`` reads only the bytes this rank needs, in two rounds of coalesced,
concurrent ranged reads: first small archives whole plus the head and tail of each
large one (where ``data.pkl`` and the zip directory sit), then exactly the byte span
of each requested slice, straight into the destination tensor when it is a
contiguous CPU tensor of the saved dtype (otherwise into a scratch buffer, copied).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine.memview import writable_view
from ..engine.scheduler import call_with_retries
from ..errors import (
    BucketNotFoundError,
    CorruptCheckpointError,
    NotFoundError,
    UnsafeCheckpointError,
)
from ..options import TransferOptions, resolve_options
from .archive import SavedTensor, parse_archive, saved_from_json
from .fetch import RangeFetcher
from .layout import WHOLE_LIMIT, layout_name, metadata_name
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


_METADATA_MODULES = frozenset({"torch.distributed.checkpoint.metadata"})
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: no arbitrary globals, no code.

    ``.metadata`` is a pickle; a plain ``pickle.load`` of a file from a bucket would run
    whatever it names. Only DCP's metadata classes, dtypes and a few value types pass.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never "
            "needs; refusing to load it"
        )


def decode_metadata(payload: bytes, url: str) -> Metadata:
    """DCP's ``.metadata`` from its bytes, through the allow-list unpickler."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(payload)).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{url}: {exc}") from exc
    except Exception as exc:
        raise CorruptCheckpointError(f"{url} is not DCP metadata: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{url} holds {type(metadata).__name__}, not Metadata")
    return metadata


class CloudStorageReader(LocatedCheckpoint, StorageReader):
    """Reads a DCP checkpoint from ``url`` (any store cloudckpt supports).

    Loads checkpoints written by :class:`CloudStorageWriter` and by torch's
    ``FileSystemWriter`` (uploaded as is). Keyword arguments are
    :class:`~cloudckpt.TransferOptions` fields (``read_concurrency``,
    ``read_chunk_size``, ``storage_options``...).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        options: TransferOptions | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.location = CheckpointLocation(url, resolve_options(options, url=url, **overrides))
        self.storage_data: dict[Any, Any] = {}
        self.rank: int | None = None
        self.use_collectives = True
        self._save_id: str | None = None
        self._layouts: dict[tuple[str, int], SavedTensor] | None = None
        #: Requests and bytes of the last ``read_data`` (both rounds).
        self.last_read_requests = 0
        self.last_read_bytes = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, from ``checkpoint_id`` when given."""
        self.storage_data = {}
        self._save_id, self._layouts = None, None
        if checkpoint_id:
            self.location = CheckpointLocation(checkpoint_id, self.location.options)

    # -- metadata ------------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The commit marker; a checkpoint without it is not loadable."""
        name = metadata_name(kwargs.get("rank"))
        store, key, url = self.location.store, self.location.key(name), self.location.url_of(name)
        try:
            payload = call_with_retries(lambda: store.get(key), self.location.options, url)
        except BucketNotFoundError:
            raise
        except NotFoundError:
            raise NotFoundError(
                f"no committed checkpoint at {self.url}: {url} does not exist (a save that "
                "did not finish leaves none)"
            ) from None
        return decode_metadata(payload, url)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Keep the item -> (object, offset, length) map of the checkpoint."""
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.url}: .metadata has no storage data")
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self._save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        self._layouts = None

    def _layout_index(self) -> dict[tuple[str, int], SavedTensor]:
        """cloudckpt's index of large tensors' byte offsets, if this save wrote one.

        Trusted only when its save id is the one in ``.metadata``: a checkpoint later
        overwritten by another writer leaves a stale index, which is then ignored.
        """
        if self._layouts is not None:
            return self._layouts
        self._layouts = {}
        if not self._save_id:
            return self._layouts
        name = layout_name(None if self.use_collectives else self.rank)
        store, key = self.location.store, self.location.key(name)
        try:
            payload = call_with_retries(
                lambda: store.get(key), self.location.options, self.location.url_of(name)
            )
            index = json.loads(payload)
        except NotFoundError:
            return self._layouts
        except ValueError:  # not JSON: ignore it, probing the archives still works
            return self._layouts
        if not isinstance(index, dict) or index.get("save_id") != self._save_id:
            return self._layouts
        for where, value in dict(index.get("archives") or {}).items():
            relative, _, offset = str(where).rpartition("@")
            saved = saved_from_json(value)
            if saved is not None and offset.isdigit():
                self._layouts[(relative, int(offset))] = saved
        return self._layouts

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """No storage-specific planning."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """No storage-specific planning."""
        return plans

    # -- data ----------------------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch what ``plan`` needs and hand it to ``planner``."""
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
            archive.items.append(item)

        self.last_read_requests = self.last_read_bytes = 0
        layouts = (
            self._layout_index() if any(a.length > WHOLE_LIMIT for a in archives.values()) else {}
        )
        first = RangeFetcher(self.location)
        slices: list[_Slice] = []
        for a in archives.values():
            if a.length <= WHOLE_LIMIT or any(i.type == LoadItemType.BYTE_IO for i in a.items):
                a.whole = bytearray(a.length)
                first.add(a.relative, a.offset, memoryview(a.whole))
            elif (known := layouts.get((a.relative, a.offset))) is not None and (
                known.data_offset + known.record_size <= a.length
            ):
                for item in a.items:  # written by us: read the spans in this round
                    slices += self._plan_slice(a, known, item, planner, first)
            else:
                a.head, a.tail = bytearray(HEAD_PROBE), bytearray(TAIL_PROBE)
                first.add(a.relative, a.offset, memoryview(a.head))
                first.add(a.relative, a.offset + a.length - TAIL_PROBE, memoryview(a.tail))
        self._run(first)
        for a in archives.values():
            if a.whole is not None:
                self._deliver_whole(a, planner)
                a.whole = None

        second = RangeFetcher(self.location)
        fallback: list[_Archive] = []
        for a in archives.values():
            if a.head is None or a.tail is None:
                continue
            url = self.location.url_of(a.relative)
            saved = parse_archive(bytes(a.head), bytes(a.tail), a.length, url)
            a.head = a.tail = None
            if saved is None:
                a.whole = bytearray(a.length)
                second.add(a.relative, a.offset, memoryview(a.whole))
                fallback.append(a)
                continue
            for item in a.items:
                slices += self._plan_slice(a, saved, item, planner, second)
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

    def _run(self, fetcher: RangeFetcher) -> None:
        fetcher.run()
        self.last_read_requests += fetcher.requests
        self.last_read_bytes += fetcher.bytes

    def _deliver_whole(self, a: _Archive, planner: LoadPlanner) -> None:
        """Hand a fully read chunk to the planner, as FileSystemReader does."""
        assert a.whole is not None
        url = self.location.url_of(a.relative)
        loaded: torch.Tensor | None = None
        for item in a.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(a.whole))
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
            source = _narrow(loaded, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CorruptCheckpointError(
                    f"{url}: {item.storage_index.fqn} slice has shape {tuple(source.shape)}, "
                    f"the destination {tuple(target.shape)}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)

    def _plan_slice(
        self,
        a: _Archive,
        saved: SavedTensor,
        item: ReadItem,
        planner: LoadPlanner,
        fetcher: RangeFetcher,
    ) -> list[_Slice]:
        """Schedule the byte span holding ``item``'s slice of a saved tensor."""
        url = self.location.url_of(a.relative)
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if len(lengths) != len(saved.size) or any(
            o < 0 or o + n > s for o, n, s in zip(offsets, lengths, saved.size, strict=True)
        ):
            raise CorruptCheckpointError(
                f"{url}: {item.storage_index.fqn} asks for offsets {offsets} lengths {lengths} "
                f"of a saved chunk of shape {saved.size}"
            )
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise CorruptCheckpointError(
                f"{url}: {item.storage_index.fqn} slice has shape {lengths}, "
                f"the destination {tuple(target.shape)}"
            )
        numel = math.prod(lengths)
        if numel == 0:
            return [_Slice(item, target)]
        itemsize = saved.dtype.itemsize
        strides = saved.stride
        first = saved.storage_offset + sum(o * st for o, st in zip(offsets, strides, strict=True))
        span = sum((n - 1) * st for n, st in zip(lengths, saved.stride, strict=True)) + 1
        if (first + span) * itemsize > saved.record_size:
            raise CorruptCheckpointError(
                f"{url}: {item.storage_index.fqn} lies past the end of its storage record"
            )
        start = a.offset + saved.data_offset + first * itemsize
        dense = span == numel and all(
            n == 1 or st == math.prod(lengths[d + 1 :])
            for d, (n, st) in enumerate(zip(lengths, saved.stride, strict=True))
        )
        if (
            dense
            and target.device.type == "cpu"
            and target.dtype == saved.dtype
            and target.is_contiguous()
        ):
            fetcher.add(a.relative, start, _tensor_bytes(target))
            return [_Slice(item, target)]
        scratch = torch.empty(span * itemsize, dtype=torch.uint8)
        fetcher.add(a.relative, start, _tensor_bytes(scratch))
        return [_Slice(item, target, scratch, saved)]

"""DCP's ``.metadata``: unpickled through an allow-list, then checked field by field.

``.metadata`` is a pickle (torch writes it so); a plain ``pickle.load`` of a file from a
bucket would run whatever it names. :func:`decode_metadata` runs the trust boundary's
pickle machine (format/torch/restricted_pickle.py) under a policy that admits only the
classes the writers of DCP checkpoints put there (named one by one in ``_GLOBALS``),
dtypes and a few value types, never changes one of them, and then checks the
structure the planner and the reader rely on (types, non-negative offsets and lengths,
chunks inside their tensor), so a damaged file is a
:class:`~cloudckpt.errors.CorruptCheckpointError`, never an ``AttributeError`` deep
inside a load.

The writers whose ``.metadata`` decodes:

* torch's ``FileSystemWriter`` (and cloudckpt's writer): DCP's metadata classes and
  ``_StorageInfo``; torch before 2.3 named ``TensorProperties`` (and its memory-format
  enum) in ``torch.distributed._shard.sharded_tensor.metadata``, decoded as today's;
* megatron-core's ``torch_dist`` backend, which adds ``all_local_plans`` (torch's
  ``SavePlan``, ``WriteItem``, ``WriteItemType``, ``TensorWriteData``) and, in 0.15, its
  own ``MCoreMetadata`` and ``MCoreSavePlan``. Those two are decoded into the stand-ins
  below whether megatron-core is installed or not: the same fields on torch's base
  classes, and nothing of megatron-core imported for a name read from a bucket.
"""

from __future__ import annotations

import collections
import itertools
import math
import pathlib
import pickletools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.serialization import _get_layout

from ...errors import CorruptCheckpointError, UnsafeCheckpointError
from ..dtype_names import DTYPES
from ..torch.restricted_pickle import PROTOCOL4_OPCODES, Policy, run_restricted
from .layout import MAX_COUNT, MAX_DIMS, StorageInfo, is_count

__all__ = ["ChunkIndex", "MCoreMetadata", "MCoreSavePlan", "check_metadata", "decode_metadata"]


@dataclass
class MCoreMetadata(Metadata):
    """megatron-core 0.15's ``Metadata`` subclass, decoded without megatron-core: its
    ``mcore_data`` (per-tensor data megatron's loader reads with ``getattr``) kept."""

    mcore_data: dict[str, dict[str, Any]] | None = None


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """megatron-core 0.15's ``SavePlan`` subclass (in ``all_local_plans``), decoded without
    megatron-core, its ``mcore_data`` kept."""

    mcore_data: dict[str, dict[str, Any]] | None = None


_DCP = "torch.distributed.checkpoint"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"
_LEGACY = "torch.distributed._shard.sharded_tensor.metadata"


def _named(module: str, *objects: Any) -> dict[tuple[str, str], Any]:
    """Allow-list entries: each object as ``module`` names it (its own name)."""
    return {(module, o.__name__): o for o in objects}


#: Every global a DCP ``.metadata`` may name, and what it decodes to.
_GLOBALS: dict[tuple[str, str], Any] = {
    **_named(
        f"{_DCP}.metadata",
        Metadata,
        StorageMeta,
        MetadataIndex,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        _MEM_FORMAT_ENCODING,
    ),
    **_named(f"{_DCP}.filesystem", StorageInfo),  # _StorageInfo
    # megatron-core's all_local_plans: the save plans of every rank
    **_named(f"{_DCP}.planner", SavePlan, WriteItem, WriteItemType, TensorWriteData),
    **_named(_MCORE, MCoreMetadata, MCoreSavePlan),  # the stand-ins above
    # torch < 2.3 kept TensorProperties here: the same fields and state as today's
    (_LEGACY, "TensorProperties"): TensorProperties,
    (_LEGACY, "MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    **_named("torch.serialization", _get_layout),
    **_named("torch", torch.Size),
    **_named("collections", collections.OrderedDict),
    **_named(
        "pathlib",
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ),
}


def _refuse(module: str, name: str) -> Exception:
    return UnsafeCheckpointError(
        f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never "
        "needs; refusing to load it"
    )


#: What a ``.metadata`` pickle may hold: the classes above, dtypes, protocol 2-5 opcodes.
_POLICY = Policy(
    globals={
        **{f"{m}.{n}": o for (m, n), o in _GLOBALS.items()},
        **{f"torch.{n}": v for n, v in DTYPES.items()},  # as a pickle names them
    },
    opcodes=PROTOCOL4_OPCODES,
    refuse_global=_refuse,
    map_python2_names=False,
    advice="",
    encoding="ascii",  # pickle.load's, as DCP's own reader decodes .metadata
)


def _check_frames(payload: bytes, url: str) -> None:
    """Refuse what Python's unpickler refuses in protocol 4's frames (which the pickle
    machine does not track): an opcode that runs past the end of its frame, a frame
    that begins before the last one ended."""
    frame_end = -1
    try:
        ops = list(pickletools.genops(payload))
    except Exception as exc:  # genops: ValueError on anything malformed
        raise CorruptCheckpointError(f"{url} is not DCP metadata: {exc}") from None
    starts = [at or 0 for _, _, at in ops]  # genops gives positions for bytes
    ends = [*starts[1:], starts[-1] + 1 if starts else 0]
    for (info, arg, _), at, nxt in zip(ops, starts, ends, strict=True):
        if at < frame_end < nxt:
            raise CorruptCheckpointError(f"{url} is not DCP metadata: an opcode spans a frame")
        if info.name == "FRAME":
            if at < frame_end:
                raise CorruptCheckpointError(
                    f"{url} is not DCP metadata: a frame begins inside another"
                )
            frame_end = nxt + (arg if isinstance(arg, int) else 0)


def decode_metadata(payload: bytes, url: str, *, scan: bool = True) -> Metadata:
    """DCP's ``.metadata`` from its bytes, through the trust boundary
    (format/torch/restricted_pickle.py) under its own allow-list, then checked field by field.

    ``scan=False`` skips the check of protocol 4's frames (:func:`_check_frames`); only for
    bytes known to be the ones a writer produced (their CRC-32 matched the layout index
    written with them)."""
    if scan:
        _check_frames(payload, url)
    metadata = run_restricted(payload, _POLICY, None, url, what="DCP metadata")
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{url} holds {type(metadata).__name__}, not Metadata")
    check_metadata(metadata, url)
    return metadata


_INT_ONLY = {int}


def _describe(value: Any) -> str:
    """A short description of a value that may be a half-built object (no repr call)."""
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        return f"{type(value).__name__} with fields {sorted(map(str, fields))[:8]}"
    return type(value).__name__


def _text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _texts(value: Any) -> bool:
    """None or a list of strings (a chunk's stream extension descriptors)."""
    return value is None or (
        isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    )


def _check_megatron_fields(metadata: Metadata, bad: Callable[[str], Exception]) -> None:
    """megatron-core's additions: ``all_local_plans`` a list of save plans, ``mcore_data``
    a map of names to dicts (no reader relies on more)."""
    plans = getattr(metadata, "all_local_plans", None)
    if plans is not None and not (
        isinstance(plans, list)
        and all(
            isinstance(p, SavePlan) and isinstance(getattr(p, "items", None), list) for p in plans
        )
    ):
        raise bad("all_local_plans is not a list of save plans")
    mcore = getattr(metadata, "mcore_data", None)
    if mcore is not None and not (
        isinstance(mcore, dict)
        and all(isinstance(k, str) and isinstance(v, dict) for k, v in mcore.items())
    ):
        raise bad("mcore_data is not a map of names to dicts")


def _shape(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple when it is a shape (at most :data:`MAX_DIMS` counts, fewer
    than :data:`MAX_COUNT` elements in all), else None. Run three times per item of
    ``.metadata``: the element checks are C calls, not a loop."""
    if not isinstance(value, (torch.Size, tuple)):
        return None
    if not value:
        return ()
    if (
        len(value) <= MAX_DIMS
        and set(map(type, value)) <= _INT_ONLY
        and min(value) >= 0
        and max(value) < MAX_COUNT
        and math.prod(value) < MAX_COUNT
    ):
        return tuple(value)
    return None


class _Shapes:
    """:func:`_shape` and element counts, each worked out once per object: the writer
    shares equal ``torch.Size`` objects (format/dcp/sharing.py), so 10,000 items of one
    shape are one check. Keyed by identity, for one pass over a ``Metadata`` that holds
    every object alive."""

    __slots__ = ("_counts", "_shapes")

    def __init__(self) -> None:
        self._shapes: dict[int, tuple[int, ...] | None] = {}
        self._counts: dict[int, int] = {}

    def __call__(self, value: Any) -> tuple[int, ...] | None:
        key = id(value)
        try:
            return self._shapes[key]
        except KeyError:
            found = self._shapes[key] = _shape(value)
            return found

    def elements(self, value: Any, checked: tuple[int, ...]) -> int:
        """The element count of ``value``, already checked as the shape ``checked``."""
        key = id(value)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = math.prod(checked)
        return count


#: Chunks of one tensor checked pair by pair where they do not form a grid; more
#: than this many such chunks is refused (sharding makes grids: row, column, 2-D).
MAX_LOOSE_CHUNKS = 4096


def _disjoint(chunks: list[tuple[Any, Any]]) -> bool:
    """Whether no two of ``chunks`` ((offsets, sizes), each inside the tensor) share an
    element. Chunks from sharding form a grid (each dimension cut into intervals, every
    chunk one cell): checked in one pass. Any other layout is checked pair by pair, in
    blocks of tensor operations, up to :data:`MAX_LOOSE_CHUNKS`."""
    dims = len(chunks[0][0])
    cuts: list[dict[tuple[int, int], int]] = [{} for _ in range(dims)]
    cells = set()
    for offsets, sizes in chunks:
        cells.add(
            tuple(cuts[d].setdefault((offsets[d], sizes[d]), len(cuts[d])) for d in range(dims))
        )
    if len(cells) != len(chunks):
        return False  # two chunks with the same place in every dimension
    grid = math.prod(len(c) for c in cuts) == len(chunks) and all(
        _partition(sorted(c)) for c in cuts
    )
    if grid:
        return True
    if len(chunks) > MAX_LOOSE_CHUNKS:
        return False
    starts = torch.tensor([list(o) for o, _ in chunks], dtype=torch.int64)
    ends = starts + torch.tensor([list(n) for _, n in chunks], dtype=torch.int64)
    empty = (ends == starts).any(dim=1)
    for first in range(0, len(chunks), 256):
        block = slice(first, first + 256)
        meets = (starts[block, None, :] < ends[None, :, :]) & (
            starts[None, :, :] < ends[block, None, :]
        )
        overlap = meets.all(dim=2)
        overlap &= ~empty[block, None] & ~empty[None, :]
        rows = torch.arange(first, min(first + 256, len(chunks)))
        overlap[rows - first, rows] = False
        if bool(overlap.any()):
            return False
    return True


def _partition(intervals: list[tuple[int, int]]) -> bool:
    """Whether ``intervals`` ((start, length), sorted) follow one another from 0."""
    end = 0
    for start, length in intervals:
        if start != end:
            return False
        end = start + length
    return True


def _check_spans(infos: Any, bad: Callable[[str], Exception]) -> None:
    """No two items' bytes overlap in a data object (two items may name the same bytes).
    A reader allocates each chunk it reads whole: overlapping entries would let a small
    file ask for far more memory than its objects hold. No writer overlaps them."""
    spans = sorted({(i.relative_path, i.offset, i.length) for i in infos})
    for (path, start, length), (next_path, next_start, _) in itertools.pairwise(spans):
        if path == next_path and next_start < start + length:
            raise bad(f"the bytes of two items overlap in {path} at {next_start}")


def check_metadata(metadata: Metadata, url: str) -> None:
    """Check the fields the planner and the reader use; CorruptCheckpointError if damaged."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{url} is damaged DCP metadata: {what}")

    state = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(state, dict):
        raise bad("state_dict_metadata is not a dict")
    shape = _Shapes()
    inside: dict[tuple[int, int, int], bool] = {}  # (offsets, sizes, size) by identity
    checked_properties: set[int] = set()
    for fqn, md in state.items():
        if not isinstance(fqn, str):
            raise bad(f"a key is {_describe(fqn)}, not a string")
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise bad(f"{fqn} is described by {type(md).__name__}")
        properties = getattr(md, "properties", None)
        if id(properties) not in checked_properties:
            if not isinstance(properties, TensorProperties) or not isinstance(
                getattr(properties, "dtype", None), torch.dtype
            ):
                raise bad(f"{fqn} has no dtype")
            checked_properties.add(id(properties))
        size_value = getattr(md, "size", None)
        size = shape(size_value)
        chunks = getattr(md, "chunks", None)
        if size is None or not isinstance(chunks, list):
            raise bad(
                f"{fqn} has no chunk list or no size (a shape of at most {MAX_DIMS} counts, "
                "fewer than 2**62 elements)"
            )
        covered = 0
        for chunk in chunks:
            offsets_value = getattr(chunk, "offsets", None)
            sizes_value = getattr(chunk, "sizes", None)
            offsets, sizes = shape(offsets_value), shape(sizes_value)
            if not isinstance(chunk, ChunkStorageMetadata) or offsets is None or sizes is None:
                raise bad(f"{fqn} has a chunk outside its size {list(size)}")
            key = (id(offsets_value), id(sizes_value), id(size_value))
            fits = inside.get(key)
            if fits is None:
                fits = inside[key] = len(offsets) == len(sizes) == len(size) and not any(
                    o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)
                )
            if not fits:
                raise bad(f"{fqn} has a chunk outside its size {list(size)}")
            covered += shape.elements(sizes_value, sizes)
        # torch's planner reads only the chunks listed: one missing would leave part of
        # the destination as it was, silently. Chunks that do not overlap and hold as
        # many elements as the tensor cover it.
        if covered != shape.elements(size_value, size) or (
            len(chunks) > 1 and not _disjoint([(c.offsets, c.sizes) for c in chunks])
        ):
            raise bad(f"the chunks of {fqn} do not cover its size {list(size)}")
    storage = getattr(metadata, "storage_data", None)
    if storage is not None:
        if not isinstance(storage, dict):
            raise bad("storage_data is not a dict")
        for index, info in storage.items():
            if (
                not isinstance(index, MetadataIndex)
                or not isinstance(getattr(index, "fqn", None), str)
                or not (
                    getattr(index, "offset", None) is None
                    or shape(getattr(index, "offset", None)) is not None
                )
                or not (getattr(index, "index", None) is None or is_count(index.index))
            ):
                raise bad(f"storage key {_describe(index)}")
            if (
                not isinstance(info, StorageInfo)
                or not isinstance(getattr(info, "relative_path", None), str)
                or not is_count(getattr(info, "offset", None))
                or not is_count(getattr(info, "length", None))
                or not _texts(getattr(info, "transform_descriptors", None))
            ):
                raise bad(f"storage entry of {index.fqn}: {_describe(info)}")
        _check_spans(storage.values(), bad)
    planner = getattr(metadata, "planner_data", None)
    # A path's integers index lists of the saved state; each element of such a list is
    # an item of its own, so an index is below the number of items (a planner that
    # rebuilds the state, torch's _EmptyStateDictLoadPlanner, makes lists that long).
    items = len(state)
    if planner is not None and (
        not isinstance(planner, dict)
        or not all(
            isinstance(k, str)
            and isinstance(v, (tuple, list))
            and all(type(p) is str or (type(p) is int and 0 <= p < items) for p in v)
            for k, v in planner.items()
        )
    ):
        raise bad("planner_data is not a map of names to paths (names, and list indices)")
    _check_megatron_fields(metadata, bad)
    meta = getattr(metadata, "storage_meta", None)
    save_id = getattr(meta, "save_id", None)
    if meta is not None and (not isinstance(meta, StorageMeta) or not _text(save_id)):
        raise bad("storage_meta is damaged")
    if not _text(getattr(metadata, "version", None)):
        raise bad("version is not a string")


class ChunkIndex:
    """The saved chunks of each tensor: (fqn, offsets) -> (sizes, dtype)."""

    def __init__(self, metadata: Metadata) -> None:
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
        self._single: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        # One tuple per shape object (the writer shares equal shapes): the index then
        # costs a few references per chunk, whatever the shapes' dimensions.
        tuples: dict[int, tuple[int, ...]] = {}

        def as_tuple(shape: Any) -> tuple[int, ...]:
            found = tuples.get(id(shape))
            if found is None:
                found = tuples[id(shape)] = tuple(shape)
            return found

        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = md.properties.dtype
                for chunk in md.chunks:
                    entry = (as_tuple(chunk.sizes), dtype)
                    self._chunks[(fqn, as_tuple(chunk.offsets))] = entry
                if len(md.chunks) == 1:
                    self._single[fqn] = (as_tuple(md.chunks[0].sizes), dtype)

    def get(self, index: MetadataIndex) -> tuple[tuple[int, ...], torch.dtype] | None:
        """Sizes and dtype of the saved chunk ``index`` names, or None."""
        offset = getattr(index, "offset", None)
        if offset is None:
            return self._single.get(index.fqn)
        return self._chunks.get((index.fqn, tuple(offset)))

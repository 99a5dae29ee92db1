"""What a DCP checkpoint looks like under its URL: the same layout ``FileSystemWriter`` writes.

A checkpoint is a prefix holding

* data objects ``__{rank}_{n}.distcp``: each one the ``torch.save`` archives of the
  rank's tensors (and the raw bytes of its non-tensor items) back to back;
* ``.metadata``: DCP's pickled :class:`~torch.distributed.checkpoint.metadata.Metadata`,
  whose ``storage_data`` maps every item to ``_StorageInfo(relative_path, offset,
  length)`` inside a data object. It is written last, by the coordinator, after every
  rank's data objects have committed, so it is the commit marker: a prefix without it
  is never loadable.

With ``prefix_fanout=N`` data objects sit under ``d00/`` ... ``d{N-1}/`` (rank ``r``
under ``d{r % N}``) so that a store that partitions by key prefix (S3) spreads the
load; the default is one sub-prefix per 64 ranks (:func:`auto_fanout`), none up to 64.
``relative_path`` carries the sub-prefix, so ``FileSystemReader`` still reads a
downloaded copy.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..commit import DCP_MARKER

__all__ = [
    "DATA_SUFFIX",
    "LAYOUT_NAME",
    "MAX_COUNT",
    "MAX_DIMS",
    "METADATA_NAME",
    "WHOLE_LIMIT",
    "StorageInfo",
    "data_prefix",
    "is_count",
    "item_nbytes",
    "layout_name",
    "metadata_name",
    "split_items",
]

#: Suffix of data objects, as FileSystemWriter names them.
DATA_SUFFIX = ".distcp"
#: The commit marker: DCP's metadata, written last.
METADATA_NAME = DCP_MARKER
#: cloudckpt's own index of where each large tensor's bytes sit inside its archive
#: (JSON, written just before ``.metadata``); lets the reader skip probing archives.
#: Other readers ignore it; it is trusted only when its save id matches ``.metadata``.
LAYOUT_NAME = ".cloudckpt-layout.json"
#: Archives up to this size are read whole; larger ones are read by byte span.
WHOLE_LIMIT = 256 * 1024
#: Offsets, sizes and counts read from a checkpoint's metadata stay below this: no
#: object holds that many bytes, and no tensor that many elements.
MAX_COUNT = 1 << 62
#: Dimensions of a shape read from a checkpoint's metadata or index, at most: more than
#: any model's tensor has, few enough that a shape's checks cost little.
MAX_DIMS = 64


def is_count(value: Any) -> bool:
    """Whether ``value``, read from ``.metadata`` or the layout index, is a count: an
    ``int`` (not a ``bool``) in ``[0, MAX_COUNT)``."""
    return type(value) is int and 0 <= value < MAX_COUNT


try:  # torch's own record type, so FileSystemReader reads our .metadata unchanged
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
except ImportError:  # pragma: no cover - every supported torch has it
    raise ImportError("cloudckpt.dcp needs torch.distributed.checkpoint (torch>=2.4)") from None


def layout_name(rank: int | None = None) -> str:
    """The layout index beside ``metadata_name(rank)``."""
    return LAYOUT_NAME if rank is None else f"__{rank}{LAYOUT_NAME}"


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` when ranks save without collectives."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


#: Ranks whose data objects share one sub-prefix when the writer spreads them itself.
RANKS_PER_PREFIX = 64


def auto_fanout(world_size: int) -> int:
    """Sub-prefixes for ``world_size`` ranks' data objects: one up to
    :data:`RANKS_PER_PREFIX` ranks, then one per that many (1,024 ranks: 16), so no key
    prefix takes more than 64 ranks' uploads (docs/scale.md has the arithmetic)."""
    return max(1, -(-world_size // RANKS_PER_PREFIX))


def data_prefix(rank: int, fanout: int) -> str:
    """Relative name prefix of a rank's data objects (``__0_``, or ``d03/__3_`` fanned out)."""
    name = f"__{rank}_"
    return f"d{rank % fanout:02d}/{name}" if fanout > 1 else name


def item_nbytes(item: WriteItem) -> int:
    """Bytes of a tensor item's data (0 for byte items, whose size is unknown up front)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for s in item.tensor_data.size:
        numel *= s
    dtype: Any = item.tensor_data.properties.dtype
    return numel * torch.empty((), dtype=dtype).element_size()


def split_items(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over ``bins`` data objects: bytes round-robin, tensors largest first
    into the lightest bin (as FileSystemWriter does), dropping empty bins."""
    if bins <= 1:
        return [list(items)] if items else []
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO), key=item_nbytes, reverse=True
    )
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in tensor_items:
        idx = min(enumerate(sizes), key=operator.itemgetter(1))[0]
        buckets[idx].append(item)
        sizes[idx] += item_nbytes(item)
    return [b for b in buckets if b]

"""Read once, share: bytes that every rank of a group loads are read by one rank each.

When several ranks load the same object (a DDP resume), each byte range is assigned to
one rank (contiguous runs of about equal size, in offset order, so reads still join),
read and checked there (its CRC-32, by the rank that read it), then broadcast to the
others over a gloo group of its own (:mod:`.groups`). The store sees each byte once,
and each rank makes a 1/N share of the requests.

Collectives (:mod:`.collectives`) frame it, so no rank ever waits for bytes that will
not come: ``agree`` (every rank names the same object, else each loads on its own),
``on_first`` (the first rank finds the object and its directory, once for all; if it
cannot, every rank raises), the reads, ``settle`` (every rank's reads succeeded, else
every rank raises), then :func:`broadcast_views`. Small views are packed into buckets
for the broadcast (one collective per bucket, not per tensor); large ones go from their
own memory.

The group may be the whole world (:func:`share_group`) or one part of a partition of it
(:func:`part_group`: a shared DCP load whose data-parallel replicas of each
model-parallel shard load the same bytes, while other parts load others); the
collectives are then the part's own, and no rank waits on a part it is not in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import group_rank, world_size
from .groups import checkpoint_group, partition_group

log = logging.getLogger("cloudckpt")

__all__ = [
    "broadcast_views",
    "part_group",
    "report",
    "share_group",
    "share_group_size",
    "split_even",
]

#: Views at least this large are broadcast from their own memory, one collective each.
LARGE = 1024 * 1024
#: Smaller views are packed into buckets of up to this many bytes.
BUCKET = 16 * 1024 * 1024


def share_group(process_group: Any = None) -> Any | None:
    """The gloo group a load shares over, or None where there is no one to share with."""
    if world_size() < 2 or dist.get_world_size(process_group) < 2:
        return None
    return checkpoint_group(process_group)


def part_group(parts: Sequence[tuple[int, ...]]) -> Any | None:
    """The gloo group of this rank's part of ``parts`` (a partition of the world's ranks,
    the same on every rank), or None where that part is this rank alone. A collective
    on the whole world: every rank calls it, at the same point (see
    :func:`.groups.partition_group`)."""
    if world_size() < 2:
        return None
    group = partition_group(parts)
    return group if group is not None and dist.get_world_size(group) >= 2 else None


def report(url: str, group: Any, requests: int, nbytes: int, total: int) -> None:
    """Log what this rank read of a shared load (INFO, logger ``cloudckpt``): its share
    of the requests and bytes, so a job can see that each byte was read once."""
    me, ranks = group_rank(group)
    log.info(
        "shared load of %s: rank %d of %d read %d of %d bytes in %d requests",
        url,
        me,
        ranks,
        nbytes,
        total,
        requests,
    )


def share_group_size() -> int:
    """The ranks :func:`share_group` would share over (1: nobody to share with); no
    collective, so a coordinator may ask alone."""
    return world_size()


def split_even(sizes: Sequence[int], parts: int) -> list[int]:
    """The owner (0..parts-1) of each item: contiguous runs of about equal total size,
    each item to the part its middle byte falls in."""
    total = sum(sizes)
    owners: list[int] = []
    pos = 0
    for n in sizes:
        middle = pos + n / 2
        owners.append(min(parts - 1, int(middle * parts / total)) if total else 0)
        pos += n
    return owners


def _tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)


def broadcast_views(group: Any, items: Sequence[tuple[int, memoryview]]) -> int:
    """Make every rank's ``view`` hold its owner's bytes; ``items`` is ``(owner, view)``
    in the same order on every rank, each view already filled on its owner. Returns
    the bytes this rank received."""
    me, _ = group_rank(group)
    received = 0
    bucket: list[memoryview] = []
    bucket_owner = -1
    bucket_size = 0

    def flush() -> None:
        nonlocal bucket, bucket_size, received
        if not bucket:
            return
        packed = torch.empty(bucket_size, dtype=torch.uint8)
        src = dist.get_global_rank(group, bucket_owner)
        if me == bucket_owner:
            pos = 0
            for v in bucket:
                packed[pos : pos + v.nbytes].copy_(_tensor(v))
                pos += v.nbytes
        dist.broadcast(packed, src=src, group=group)
        if me != bucket_owner:
            pos = 0
            for v in bucket:
                _tensor(v).copy_(packed[pos : pos + v.nbytes])
                pos += v.nbytes
            received += bucket_size
        bucket, bucket_size = [], 0

    for owner, view in items:
        if not view.nbytes:
            continue
        if view.nbytes >= LARGE:
            flush()
            dist.broadcast(_tensor(view), src=dist.get_global_rank(group, owner), group=group)
            received += view.nbytes if me != owner else 0
            continue
        if owner != bucket_owner or bucket_size + view.nbytes > BUCKET:
            flush()
            bucket_owner = owner
        bucket.append(view)
        bucket_size += view.nbytes
    flush()
    return received

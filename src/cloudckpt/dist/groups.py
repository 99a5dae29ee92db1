"""The gloo process group checkpoint collectives run on.

A Megatron save's planning, its "every rank's data is durable" gather and its commit
broadcast, and a shared load's agreement and broadcasts (dist/share.py), run on a
group created for checkpointing alone, never on the training group: an asynchronous
upload then can't interleave its collectives with the training loop's (which hangs or
corrupts both), and CPU tensors and objects never need a device (gloo works whatever
the training backend is). One group per set of ranks, created on first use by every
member (a collective itself, so every rank's first use must be in step, as
megatron-core's own save and a DDP resume already are).

:func:`partition_group` makes the groups of a partition of the world (the data-parallel
replicas of each model-parallel shard, for a shared DCP load) on every rank at once:
each rank calls ``new_group`` for every part, in the same order, members and not (see
its docstring for why not ``use_local_synchronization``).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from typing import Any

from .collectives import torch_distributed

__all__ = ["DEFAULT_TIMEOUT", "checkpoint_group", "drain_group", "group_ranks", "partition_group"]

#: How long a checkpoint collective waits for a peer before failing that save.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_lock = threading.Lock()
#: (ranks, purpose) -> (the default group it was made under, the group).
_groups: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = {}
#: A part of a partition -> (the default group it was made under, the part's group, or
#: None on a rank outside it). Filled the same on every rank (see partition_group).
_parts: dict[tuple[int, ...], tuple[Any, Any]] = {}


def group_ranks(process_group: Any = None) -> tuple[int, ...]:
    """The global ranks of ``process_group`` (the whole world when None)."""
    if process_group is None or process_group is torch_distributed().GroupMember.WORLD:
        return tuple(range(torch_distributed().get_world_size()))
    return tuple(torch_distributed().get_process_group_ranks(process_group))


def checkpoint_group(process_group: Any = None) -> Any:
    """The dedicated gloo group over ``process_group``'s ranks (created once, then reused)."""
    return _dedicated(group_ranks(process_group), "checkpoint")


def drain_group(process_group: Any = None) -> Any:
    """A second dedicated gloo group over the same ranks, for a local tier's background
    drain: its collectives run in the drainer thread while a newer save's run on
    :func:`checkpoint_group` in DCP's thread, so the two never share a group."""
    return _dedicated(group_ranks(process_group), "drain")


def _dedicated(ranks: tuple[int, ...], purpose: str) -> Any:
    world = torch_distributed().group.WORLD
    with _lock:
        made = _groups.get((ranks, purpose))
        group = made[1] if made is not None and made[0] is world else None
        if group is None:
            whole = len(ranks) == torch_distributed().get_world_size()
            group = torch_distributed().new_group(
                ranks=None if whole else list(ranks),
                backend="gloo",
                timeout=DEFAULT_TIMEOUT,
                use_local_synchronization=not whole,
            )
            _groups[(ranks, purpose)] = (world, group)
        return group


def partition_group(parts: Sequence[tuple[int, ...]]) -> Any:
    """This rank's gloo group among ``parts``, a partition of the world's global ranks
    (each part ascending, every rank in exactly one), each part's group made once, then
    reused. A partition of one part is the whole world's :func:`checkpoint_group`.

    A collective on the whole world: every rank calls it with the same ``parts`` in the
    same order (a DCP load's coordinator sends the same partition to every rank). Each
    rank then calls ``new_group`` for every part not made yet, its own and the others'
    (for a part it is not in, no connection: a name and a return), so torch's group
    names, which count the world's calls, agree on every rank, and the torchcomms path
    (which splits the world, every rank taking part) works too. Not
    ``use_local_synchronization``: its hashed names count the groups each rank already
    holds, so two members with different histories (one shared before, one read alone)
    would meet under different names and wait for each other until the timeout. A
    one-rank part gets a group too, which keeps every rank's count of groups in step, so
    the hashed names of :func:`checkpoint_group`'s subset groups (made that way) still
    agree after a shared load. Only a part's members wait
    for each other (gloo connects them as its group is made), so the caller must reach
    this before anything that can fail.
    """
    if len(parts) == 1:
        return checkpoint_group()
    me = torch_distributed().get_rank()
    world = torch_distributed().group.WORLD
    mine: Any = None
    with _lock:
        for ranks in parts:
            made = _parts.get(ranks)
            if made is None or made[0] is not world:
                group = torch_distributed().new_group(
                    ranks=list(ranks), backend="gloo", timeout=DEFAULT_TIMEOUT
                )
                made = _parts[ranks] = (world, group if me in ranks else None)
            if me in ranks:
                mine = made[1]
    return mine

"""The gloo process group checkpoint collectives run on.

A Megatron save's planning, its "every rank's data is durable" gather and its commit
broadcast, and a shared load's agreement and broadcasts (engine/share.py), run on a
group created for checkpointing alone, never on the training group: an asynchronous
upload then can't interleave its collectives with the training loop's (which hangs or
corrupts both), and CPU tensors and objects never need a device (gloo works whatever
the training backend is). One group per set of ranks, created on first use by every
member (a collective itself, so every rank's first use must be in step, as
megatron-core's own save and a DDP resume already are).
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "checkpoint_group", "group_ranks"]

#: How long a checkpoint collective waits for a peer before failing that save.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_lock = threading.Lock()
#: ranks -> (the default group it was made under, the checkpoint group).
_groups: dict[tuple[int, ...], tuple[Any, Any]] = {}


def group_ranks(process_group: Any = None) -> tuple[int, ...]:
    """The global ranks of ``process_group`` (the whole world when None)."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(process_group))


def checkpoint_group(process_group: Any = None) -> Any:
    """The dedicated gloo group over ``process_group``'s ranks (created once, then reused)."""
    ranks = group_ranks(process_group)
    world = dist.group.WORLD
    with _lock:
        made = _groups.get(ranks)
        group = made[1] if made is not None and made[0] is world else None
        if group is None:
            whole = len(ranks) == dist.get_world_size()
            group = dist.new_group(
                ranks=None if whole else list(ranks),
                backend="gloo",
                timeout=DEFAULT_TIMEOUT,
                use_local_synchronization=not whole,
            )
            _groups[ranks] = (world, group)
        return group

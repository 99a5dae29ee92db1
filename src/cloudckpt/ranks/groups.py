"""The gloo process groups checkpoint collectives run on.

Every collective of cloudckpt's runs on a group of its own, never on the program's
(:func:`dedicated`, which ranks/collectives.py applies to each call): a collective in the
caller's thread over the whole world on the "caller" group, a background commit's on
:func:`checkpoint_group`, a drain's on :func:`drain_group`, a shared load's on its
part's group. A group of the program's that holds only some ranks is the exception: it
is used as given (see :func:`dedicated`).

A Megatron save's planning, its "every rank's data is durable" gather and its commit
broadcast, and a shared load's agreement and broadcasts (ranks/share.py), run on a
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

The groups are cloudckpt's, so cloudckpt destroys them at interpreter exit (an
``atexit`` hook), while threads can still take the interpreter lock: a gloo group left
to the interpreter's teardown right after a collective aborts the process about one
run in four ("terminate called without an active exception": gloo's worker drops the
collective's tensors after the interpreter is gone). A program whose last act is a
2-rank save and that never calls ``destroy_process_group`` ended that way. The hook
leaves the groups as they are while a background thread that runs their collectives
(:func:`runs_collectives`) is still alive, since one may be mid-collective; the
default group is the program's, never touched.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DEFAULT_TIMEOUT",
    "checkpoint_group",
    "dedicated",
    "drain_group",
    "group_ranks",
    "partition_group",
    "runs_collectives",
    "torch_distributed",
]

log = logging.getLogger(__name__)


def torch_distributed() -> Any:
    """``torch.distributed``, imported when first needed (the command line never is)."""
    import torch.distributed

    return torch.distributed


#: How long a checkpoint collective waits for a peer before failing that save.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_lock = threading.Lock()
#: (ranks, purpose) -> (the default group it was made under, the group).
_groups: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = {}
#: A part of a partition -> (the default group it was made under, the part's group, or
#: None on a rank outside it). Filled the same on every rank (see partition_group).
_parts: dict[tuple[int, ...], tuple[Any, Any]] = {}
#: id() of every group above (kept alive there): the groups :func:`dedicated` keeps.
_ours: set[int] = set()
#: Background threads that may run collectives on these groups (see the module's notes).
_callers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def group_ranks(process_group: Any = None) -> tuple[int, ...]:
    """The global ranks of ``process_group`` (the whole world when None)."""
    if process_group is None or process_group is torch_distributed().GroupMember.WORLD:
        return tuple(range(torch_distributed().get_world_size()))
    return tuple(torch_distributed().get_process_group_ranks(process_group))


def dedicated(process_group: Any = None) -> Any:
    """The group a collective of cloudckpt's over ``process_group``'s ranks runs on.

    ``process_group`` itself when cloudckpt made it (a background commit's
    :func:`checkpoint_group`, a drain's :func:`drain_group`, a part's group); for the
    whole world (None, the default group, or the program's group of every rank) a
    third group of cloudckpt's, for the caller's thread, so its collectives never share
    a group with a background commit's; a program's group of some ranks stays itself
    (a group of cloudckpt's over them would need the same history of groups on each of
    them: see :func:`partition_group`).
    """
    if process_group is not None and id(process_group) in _ours:
        return process_group
    ranks = group_ranks(process_group)
    if len(ranks) != torch_distributed().get_world_size():
        return process_group
    return _dedicated(ranks, "caller")


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
            if made is not None:  # made under an earlier default group, gone with it
                _ours.discard(id(made[1]))
            whole = len(ranks) == torch_distributed().get_world_size()
            group = torch_distributed().new_group(
                ranks=None if whole else list(ranks),
                backend="gloo",
                timeout=DEFAULT_TIMEOUT,
                use_local_synchronization=not whole,
            )
            _groups[(ranks, purpose)] = (world, group)
            _ours.add(id(group))
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
                if made is not None:
                    _ours.discard(id(made[1]))
                group = torch_distributed().new_group(
                    ranks=list(ranks), backend="gloo", timeout=DEFAULT_TIMEOUT
                )
                made = _parts[ranks] = (world, group if me in ranks else None)
                if me in ranks:
                    _ours.add(id(group))
            if me in ranks:
                mine = made[1]
    return mine


def runs_collectives(thread: threading.Thread) -> None:
    """Note that ``thread`` (a background save's or drain's) may run collectives on these
    groups: while it is alive at exit, the groups are not destroyed."""
    with _lock:
        _callers.add(thread)


def _destroy_at_exit() -> None:
    """Destroy the groups made under the program's current default group, unless a
    thread noted by :func:`runs_collectives` is still alive."""
    with _lock:
        if not _groups and not _parts:
            return
        busy = [t.name for t in _callers if t.is_alive()]
        made = list(_groups.values()) + list(_parts.values())
        if not busy:
            _groups.clear()
            _parts.clear()
            _ours.clear()
    dist = torch_distributed()
    if not dist.is_initialized():  # the program destroyed them (and its own) already
        return
    if _torch_release() < (2, 5):  # its gloo teardown can hang joining threads (docs/dcp.md)
        return
    if busy:
        log.debug("checkpoint groups left to the interpreter: %s still running", busy)
        return
    world = dist.group.WORLD
    for made_under, group in made:
        if made_under is not world or group is None:
            continue  # made under an earlier default group (gone with it), or no member
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # at exit: never hide the program's own outcome
            log.debug("destroying a checkpoint group at exit failed: %s", exc)


def _torch_release() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _forget_after_fork() -> None:
    """In a forked child: the parent's groups are not the child's to destroy."""
    global _lock, _callers
    _lock = threading.Lock()
    _groups.clear()
    _parts.clear()
    _ours.clear()
    _callers = weakref.WeakSet()


atexit.register(_destroy_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

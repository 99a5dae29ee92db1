"""Rank 0 asks storage, every rank gets the answer: keeps listings off N ranks.

When ``torch.distributed`` is initialized with more than one rank, :func:`on_rank0`
runs a function on rank 0 only and broadcasts its result (or its error, re-raised on
every rank) with ``broadcast_object_list``. Otherwise it just calls the function.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import StorageError

__all__ = ["barrier", "is_distributed", "on_rank0", "rank"]

T = TypeVar("T")


def is_distributed() -> bool:
    """True when torch.distributed is initialized with more than one rank."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def rank() -> int:
    if not is_distributed():
        return 0
    import torch.distributed as dist

    return int(dist.get_rank())


def barrier() -> None:
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


def on_rank0(fn: Callable[[], T], group: Any = None) -> T:
    """``fn()`` on rank 0, its result (or error) broadcast to every rank (over
    ``group``, default the world; a background commit uses the checkpoint group)."""
    if not is_distributed():
        return fn()
    import torch.distributed as dist

    box: list[Any] = [None]
    error: BaseException | None = None
    first = 0 if group is None else dist.get_global_rank(group, 0)
    if dist.get_rank() == first:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # shipped to the other ranks, re-raised here below
            error = exc
            try:
                pickle.dumps(exc)
                box[0] = ("error", exc)
            except Exception:
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=first, group=group)
    status, value = box[0]
    if error is not None:
        raise error
    if status == "error":
        if isinstance(value, BaseException):
            raise value
        raise StorageError(f"rank 0 failed: {value}")
    return value  # type: ignore[no-any-return]

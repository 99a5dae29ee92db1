"""The ceiling with the resharding layout: 2 ranks PUT, 3 ranks GET, pre-built bytes.

The same transport and method as ``ceiling`` (botocore, zero-copy parts, ranged GETs
``readinto`` anonymous memory, cloudckpt's default sizes and concurrencies), run by the
same forked gloo ranks as ``cloudckpt-dcp-2to3``: rank r of 2 uploads half of the
bytes as its own object; rank r of 3 reads its third of them, across both objects.
It is the raw-transfer bound for that job on this machine (three clients and the
server share the cores), so the resharded load is compared with it, as well as with
the one-process ceiling. :func:`put_on` and :func:`get_on` take any number of ranks
(``ceiling-2to2``, the Megatron scenario's bound, uses 2 and 2).
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from . import ceiling
from .common import Ctx
from .ranks import Step, run_ranks

SAVE_RANKS = 2
LOAD_RANKS = 3
SELF_CHECKED = True
prepare = ceiling.prepare


def _bounds(size: int, parts: int, i: int) -> tuple[int, int]:
    return size * i // parts, size * (i + 1) // parts


def _key(ctx: Ctx, i: int) -> str:
    return f"{ctx.prefix}/ceiling-{i}.bin"


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> None:
    """Untimed, in the parent, so forked ranks inherit built clients."""
    ceiling.warm(state, ctx)


def save(data: bytearray, ctx: Ctx) -> dict[str, Any]:
    return put_on(SAVE_RANKS, data, ctx)


def load(ctx: Ctx, template: Any) -> dict[str, Any]:
    return get_on(LOAD_RANKS, ctx)


def put_on(world: int, data: bytearray, ctx: Ctx) -> dict[str, Any]:
    """``world`` ranks PUT one share of ``data`` each, as its own object."""

    def setup(rank: int, world: int) -> tuple[Step, Step]:
        a, b = _bounds(len(data), world, rank)
        return lambda: ceiling.put(ctx, _key(ctx, rank), memoryview(data)[a:b]), lambda: None

    global _SAVED
    _SAVED = (data, world)
    return run_ranks(world, setup)


#: The bytes the last save uploaded and its ranks (the load checks each share against them).
_SAVED = (bytearray(), 1)


def get_on(world: int, ctx: Ctx) -> dict[str, Any]:
    """``world`` ranks GET one share each of the last :func:`put_on`'s bytes, across its
    objects, each rank checking its share afterwards."""
    data, saved_on = _SAVED
    size = len(data)
    objects = [_bounds(size, saved_on, i) for i in range(saved_on)]

    def setup(rank: int, world: int) -> tuple[Step, Step]:
        a, b = _bounds(size, world, rank)
        out = mmap.mmap(-1, b - a)
        view = memoryview(out)
        spans = []
        for i, (oa, ob) in enumerate(objects):
            lo, hi = max(a, oa), min(b, ob)
            if lo < hi:
                spans.append((_key(ctx, i), lo - oa, view[lo - a : hi - a]))

        def check() -> None:
            if out[:] != data[a:b]:
                raise AssertionError(f"rank {rank}: ceiling GET returned different bytes")

        return lambda: ceiling.get(ctx, spans), check

    return run_ranks(world, setup)

"""cloudckpt.async_save: stall (until training may go on) and total (until committed).

The first save warms the staging buffers and is not timed (stall is defined from the
second save on); the timed save is the second. Load is cloudckpt.load, measured by the
``cloudckpt`` system, so this one has none.
"""

from __future__ import annotations

import statistics
import time

import torch

import cloudckpt

from .common import Ctx

LOAD = False


def warm_memcpy_seconds(state: dict[str, torch.Tensor]) -> float:
    """One warm copy of the state into already-touched host buffers (median of 3 passes)."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():  # first pass touches the pages
        dst[k].copy_(v)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def warm(state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, float]:
    """Untimed: one full async save, so the timed one reuses the staging buffers."""
    memcpy = warm_memcpy_seconds(state)
    first = cloudckpt.async_save(state, f"{ctx.url}/warm.pt", storage_options=ctx.storage_options())
    first.result()
    return {"memcpy_s": memcpy, "first_stall_s": first.stall_seconds}


def save(state: dict[str, torch.Tensor], ctx: Ctx) -> dict[str, float]:
    t0 = time.perf_counter()
    handle = cloudckpt.async_save(
        state, f"{ctx.url}/ckpt.pt", storage_options=ctx.storage_options()
    )
    stall = time.perf_counter() - t0
    handle.result()
    return {"stall_s": stall, "handle_stall_s": handle.stall_seconds}

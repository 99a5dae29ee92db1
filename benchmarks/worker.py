"""One system, one repetition, in its own process: build the state, save it, load it back.

Run by ``run.py`` as ``python -m benchmarks.worker SPEC.json RESULT.json``. Each operation
is measured for wall time, client CPU (getrusage of this process and its children),
peak extra RSS (VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS at
the start) and the S3 requests the server logged. A failure is recorded with its error.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.systems import SYSTEMS, gpt_adamw
from benchmarks.systems.common import Ctx, cpu_seconds, reset_peak, status_kib
from cloudckpt.testing import count_requests

#: Columns of the benchmark's weight matrices.
COLUMNS = 1024


def build_state(total_bytes: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    """``tensors`` random fp32 matrices of (nearly) equal size, ``total_bytes`` in all.

    Matrices of ``COLUMNS`` columns, like a model's weights, so that sharding them by
    rows (``cloudckpt-dcp-2to3``) is what FSDP does. Not 1-D: torch's DTensor planning
    builds an index over every row of a shard, which for 1-D tensors of millions of
    elements costs 0.5-0.8 ms each, per rank, in save and load alike.
    """
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_bytes // 4 // tensors)
    cols = min(COLUMNS, per)
    rows = max(1, per // cols)
    return {f"layer{i:05d}.weight": torch.rand(rows, cols, generator=gen) for i in range(tensors)}


def build_even_state(total_bytes: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    """``tensors`` random fp32 matrices of one shape, ``total_bytes`` in all to within
    0.1%: the scaling sweep's states, the same bytes at every tensor count. Each matrix
    has as many rows of ``COLUMNS`` as its share of the bytes fills (at least one), widened
    to hold the rest (``build_state`` drops it: 6 rows of 1024 instead of 6.55 at 256 MiB
    in 10,000 tensors, 8% fewer bytes; here 6 rows of 1118)."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, total_bytes // 4 // tensors)
    rows = max(1, per // COLUMNS)
    cols = per // rows
    return {f"layer{i:06d}.weight": torch.rand(rows, cols, generator=gen) for i in range(tensors)}


#: How the worker builds a variant's state (``spec["layout"]``); the default: ``build_state``.
LAYOUTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "matrices": lambda spec: build_state(spec["bytes"], spec["tensors"], spec["seed"]),
    "even": lambda spec: build_even_state(spec["bytes"], spec["tensors"], spec["seed"]),
    "gpt-adamw": lambda spec: gpt_adamw.build(gpt_adamw.GptAdamwShape(**spec["model"]),
                                              spec["seed"]),
}  # fmt: skip


def tensors_of(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a (nested) state, flat, by their path: what the ceilings move."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        if isinstance(v, dict | list | tuple | torch.Tensor):
            out.update(tensors_of(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def measure(fn: Callable[[], Any], log_path: str, server: str) -> tuple[Any, dict[str, Any]]:
    """Run ``fn``; its result and figures (time, CPU, peak extra RSS, requests logged)."""
    gc.collect()
    exact = reset_peak()
    rss0 = status_kib("VmRSS")
    cpu0, off, t0 = cpu_seconds(), os.path.getsize(log_path), time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    peak = status_kib("VmHWM")
    return out, {
        "seconds": seconds,
        "cpu_s": cpu,
        "peak_extra_rss": (peak - rss0) * 1024,
        "peak_exact": exact,
        "requests": count_requests(log_path, off, server=server),
    }


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:400]


def _check(loaded: Any, state: Any, path: str = "") -> None:
    """Every value of the (nested) ``state`` is in ``loaded``, tensors equal in dtype too."""
    if isinstance(state, torch.Tensor):
        if not (isinstance(loaded, torch.Tensor) and loaded.dtype == state.dtype
                and torch.equal(loaded, state)):  # fmt: skip
            raise AssertionError(f"loaded tensor {path} differs from the saved one")
    elif isinstance(state, dict):
        if not isinstance(loaded, dict) or set(loaded) != set(state):
            raise AssertionError(f"loaded keys differ from the saved state at {path or 'top'}")
        for k, v in state.items():
            _check(loaded[k], v, f"{path}.{k}" if path else str(k))
    elif isinstance(state, list | tuple):
        if not isinstance(loaded, list | tuple) or len(loaded) != len(state):
            raise AssertionError(f"loaded {path} differs from the saved one")
        for i, (a, b) in enumerate(zip(loaded, state, strict=True)):
            _check(a, b, f"{path}.{i}")
    elif loaded != state:
        raise AssertionError(f"loaded {path} = {loaded!r}, saved {state!r}")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    name = spec["system"]
    server = spec.get("server", "rclone")
    ctx = Ctx(**spec["ctx"])
    out: dict[str, Any] = {"system": name, "variant": spec["variant"], "rep": spec["rep"]}
    try:
        mod = importlib.import_module(f"benchmarks.systems.{SYSTEMS[name]}")
        if hasattr(mod, "configure"):
            mod.configure(ctx)
        if hasattr(mod, "own_state"):  # what its save and load take, and its bytes
            state, size = mod.own_state(spec)
        else:
            state = LAYOUTS[spec.get("layout", "matrices")](spec)
            size = sum(t.numel() * t.element_size() for t in tensors_of(state).values())
        out["bytes"] = size
        payload: Any = state
        if hasattr(mod, "prepare"):  # the ceilings: every tensor's bytes, pre-built
            state = tensors_of(state)
            payload = mod.prepare(state)
        if hasattr(mod, "warm"):
            out["warm"] = mod.warm(state, ctx)
        if SYSTEMS[name] == "ceiling":  # checked against its bytes: one copy less (4 GiB)
            state = None
    except BaseException as exc:
        out["save"] = out["load"] = {"error": _error(exc)}
        out["traceback"] = traceback.format_exc()[-3000:]
        return out
    try:
        if hasattr(mod, "setup"):  # a reader only: what it reads is written untimed
            mod.setup(payload, ctx)
            out["save"] = {}
        else:
            extra, figures = measure(lambda: mod.save(payload, ctx), spec["log"], server)
            if isinstance(extra, dict):
                figures.update(extra)
            out["save"] = figures
    except BaseException as exc:
        out["save"] = {"error": _error(exc)}
        out["traceback"] = traceback.format_exc()[-3000:]
        out["load"] = {"error": "not run: save failed"}
        return out
    if not getattr(mod, "LOAD", True):
        return out
    try:
        if SYSTEMS[name] == "ceiling":
            loaded, figures = measure(lambda: mod.load(ctx, size), spec["log"], server)
            if not mod.same(loaded, payload):
                raise AssertionError("ceiling GET returned different bytes")
        elif getattr(mod, "SELF_CHECKED", False):  # checked inside, returns figures
            extra, figures = measure(lambda: mod.load(ctx, state), spec["log"], server)
            figures.update(extra)
            if hasattr(mod, "verify"):  # checked after the clock
                mod.verify(ctx, state)
        else:
            loaded, figures = measure(lambda: mod.load(ctx, state), spec["log"], server)
            _check(loaded, state)
        out["load"] = figures
    except BaseException as exc:
        out["load"] = {"error": _error(exc)}
        out["traceback"] = traceback.format_exc()[-3000:]
    return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DCP saves and loads of many small tensors, one after another in one process: the
load's cost in steady state, with the cyclic collector's share of it.

    .venv/bin/python -m benchmarks.studies.dcp_cycles [CYCLES] [TENSORS]   # 20, 10000

Each cycle saves ``TENSORS`` fp32 tensors of 16 KiB with ``dcp.save`` through
``CloudStorageWriter`` into a fresh directory on tmpfs (``/dev/shm``: no server and no
disk in the figures), then loads them into a preallocated state with ``dcp.load``
through ``CloudStorageReader``. Printed per phase: the median and total seconds, and
the collections of each generation with the objects the full ones walked. The
benchmark's many-small variant times one load in a fresh process, where whether a full
collection lands inside the load depends on the collector's counters that process's
save left; here that lands where it lands, cycle after cycle. Run it with the code to
compare first on ``PYTHONPATH`` (an A/B against an earlier commit: ``git worktree``).
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    warnings.filterwarnings("ignore", message=".*single process.*")
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(4096) for i in range(n)}
    out = {k: torch.empty_like(v) for k, v in state.items()}
    phase = "save"
    counts: Counter[tuple[str, int]] = Counter()
    walked: Counter[str] = Counter()
    began = [0.0]
    gc_seconds: dict[str, float] = {"save": 0.0, "load": 0.0}

    def heard(stage: str, info: dict[str, Any]) -> None:
        if stage == "start":
            counts[(phase, info["generation"])] += 1
            began[0] = time.perf_counter()
            if info["generation"] == 2:
                walked[phase] += sum(gc.get_count()) + len(gc.get_objects(2))
        else:
            gc_seconds[phase] += time.perf_counter() - began[0]

    took: dict[str, list[float]] = {"save": [], "load": []}
    gc.callbacks.append(heard)
    root = Path(tempfile.mkdtemp(prefix="dcp-cycles-", dir="/dev/shm"))
    try:
        for c in range(cycles):
            url = (root / str(c)).as_uri()
            phase = "save"
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=CloudStorageWriter(url), no_dist=True)
            took["save"].append(time.perf_counter() - t0)
            phase = "load"
            t0 = time.perf_counter()
            dcp.load(out, storage_reader=CloudStorageReader(url), no_dist=True)
            took["load"].append(time.perf_counter() - t0)
            for written in (root / str(c)).iterdir():
                written.unlink()
    finally:
        gc.callbacks.remove(heard)
        for d in root.iterdir():
            d.rmdir()
        root.rmdir()
    assert all(torch.equal(out[k], state[k]) for k in state)
    print(f"{cycles} cycles of {n} tensors (16 KiB each), torch {torch.__version__}")
    for p in ("save", "load"):
        gens = [counts[(p, g)] for g in range(3)]
        print(
            f"{p}: median {statistics.median(took[p]):.3f} s, total {sum(took[p]):.2f} s; "
            f"collections by generation {gens}, {gc_seconds[p]:.2f} s in them; "
            f"full ones walked {walked[p] / 1e6:.1f} M objects"
        )


if __name__ == "__main__":
    main()

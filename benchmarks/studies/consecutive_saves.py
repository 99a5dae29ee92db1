"""Consecutive saves in one process: what warm buffers change from the first save on.

    .venv/bin/python -m benchmarks.studies.consecutive_saves [MiB]   # default 256

Starts ``rclone serve s3`` on tmpfs (as ``make bench`` does), then saves a state of MiB
in 100 fp32 tensors four times with ``cloudckpt.save`` and four times with
``cloudckpt.async_save`` (each over the last, so tmpfs holds two objects), printing per
save the throughput, the process CPU seconds and, for async saves, the stall against
one warm copy of the state.
"""

from __future__ import annotations

import resource
import sys
import time

import cloudckpt
from benchmarks import server
from benchmarks.systems.cloudckpt_async import warm_memcpy_seconds
from benchmarks.worker import build_state


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    gib = mib / 1024
    srv = server.start(log_level="ERROR")
    try:
        srv.make_bucket("consecutive")
        so = srv.storage_options()
        state = build_state(mib << 20, 100, 0)
        for i in range(4):
            c0, t0 = _cpu(), time.perf_counter()
            cloudckpt.save(state, "s3://consecutive/sync.pt", storage_options=so)
            wall = time.perf_counter() - t0
            print(f"save       #{i + 1}: {gib / wall:.3f} GiB/s, {_cpu() - c0:.2f} CPU-s")
        memcpy = warm_memcpy_seconds(state)
        for i in range(4):
            c0, t0 = _cpu(), time.perf_counter()
            handle = cloudckpt.async_save(state, "s3://consecutive/async.pt", storage_options=so)
            stall = time.perf_counter() - t0
            handle.result()
            wall = time.perf_counter() - t0
            print(
                f"async_save #{i + 1}: stall {stall:.3f} s = {stall / memcpy:.1f}x one warm copy "
                f"({memcpy:.3f} s), {gib / wall:.3f} GiB/s, {_cpu() - c0:.2f} CPU-s"
            )
    finally:
        server.stop(srv)


if __name__ == "__main__":
    main()

"""The async-save stall while another Python thread runs (a data loader, a logger).

    .venv/bin/python -m benchmarks.studies.stall_busy_thread [TENSORS] [MiB] [--out F]

Saves a state of MiB (default 160) in TENSORS fp32 tensors (default 10,000) with
``cloudckpt.async_save`` to a tmpfs directory, five times with no other thread and five
times while one thread counts in a Python loop; prints each median stall against one
warm copy of the state (``copy_`` into touched tensors, median of three; with the
busy thread too), as JSON.
The first save of each series warms the staging buffers and is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import cloudckpt
from benchmarks.systems.cloudckpt_async import warm_memcpy_seconds
from benchmarks.worker import build_state


def _stalls(state: Any, where: Path, count: int) -> list[float]:
    out = []
    for i in range(count + 1):
        t0 = time.perf_counter()
        handle = cloudckpt.async_save(state, where / f"s{i}.pt")
        stall = time.perf_counter() - t0
        handle.result()
        if i:
            out.append(stall)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tensors", nargs="?", type=int, default=10_000)
    parser.add_argument("mib", nargs="?", type=int, default=160)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    state = build_state(args.mib << 20, args.tensors, 0)
    memcpy = warm_memcpy_seconds(state)
    tmp = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    quiet = _stalls(state, tmp, 5)
    stop = threading.Event()

    def busy() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        loaded = _stalls(state, tmp, 5)
        memcpy_loaded = warm_memcpy_seconds(state)
    finally:
        stop.set()
        thread.join()
    result = {
        "tensors": args.tensors,
        "mib": args.mib,
        "memcpy_s": memcpy,
        "stall_s": statistics.median(quiet),
        "stall_with_busy_thread_s": statistics.median(loaded),
        "memcpy_with_busy_thread_s": memcpy_loaded,
        "stalls": quiet,
        "stalls_with_busy_thread": loaded,
    }
    result["x_memcpy"] = result["stall_s"] / memcpy
    result["x_memcpy_with_busy_thread"] = result["stall_with_busy_thread_s"] / memcpy
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()


if __name__ == "__main__":
    main()

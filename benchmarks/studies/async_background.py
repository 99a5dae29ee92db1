"""Does a background checkpoint slow training? Thread vs persistent worker process.

Runs a CPU training loop (an MLP, forward + backward + step) and measures its step rate
alone and while an async save of a large state uploads to ``rclone serve s3`` on tmpfs:

- thread:  cloudckpt.async_save (snapshot in the caller, serialize + upload on a thread)
- process: the same snapshot into shared-memory buffers, handed to a persistent worker
           process that serializes and uploads (the alternative design)

    .venv/bin/python -m benchmarks.studies.async_background [--state-mib 512] [--reps 3]

Prints a table and writes benchmarks/studies/results/async_background_{s3,file}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cloudckpt
from cloudckpt.engine.staging import Snapshot, StagingPool, snapshot
from cloudckpt.testing import launch, stop


def _shared_buffer(key: tuple[int, bool]) -> torch.UntypedStorage:
    """Staging buffers in shared memory, so a worker process can read them without a copy."""
    return torch.UntypedStorage(key[0]).share_memory_()


def worker(conn) -> None:  # runs in the spawned process
    while True:
        msg = conn.recv()
        if msg is None:
            return
        structure, storages, parts, tensors, nbytes, url, opts = msg
        snap = Snapshot(
            structure=structure,
            storages=storages,
            pinned=[False] * len(storages),
            parts=parts,
            tensors=tensors,
            nbytes=nbytes,
        )
        started = time.perf_counter()
        cloudckpt.save(snap.materialize(), url, storage_options=opts)
        conn.send(time.perf_counter() - started)


def train_while(model, opt, x, y, busy) -> tuple[int, float]:
    """Train until ``busy()`` turns False; returns (steps, seconds)."""
    steps, started = 0, time.perf_counter()
    while busy() or steps == 0:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    return steps, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--target",
        choices=["s3", "file"],
        default="s3",
        help="s3: rclone serve s3 on this machine; file: a tmpfs directory",
    )
    args = p.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    n = args.state_mib * (1 << 20) // 4 // 16
    state = {f"layer{i}": torch.randn(n) for i in range(16)}

    server = launch("rclone") if args.target == "s3" else None
    scratch = Path(tempfile.mkdtemp(prefix="cloudckpt-bench-", dir="/dev/shm"))
    try:
        if server is not None:
            base, opts = f"s3://{server.make_bucket('bench-async')}", server.storage_options()
        else:
            base, opts = str(scratch), {}
        ctx = torch.multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child,), daemon=True)
        proc.start()
        pool = StagingPool(make=_shared_buffer)
        cloudckpt.save({"warm": torch.zeros(1)}, f"{base}/warm.pt", storage_options=opts)

        rows: dict[str, list[float]] = {"baseline": [], "thread": [], "process": []}
        upload: dict[str, list[float]] = {"thread": [], "process": []}
        stall: dict[str, list[float]] = {"thread": [], "process": []}
        for rep in range(args.reps):
            # Baseline: the same loop for about as long as an upload takes.
            horizon = time.perf_counter() + (
                statistics.median(upload["thread"]) if upload["thread"] else 3.0
            )
            steps, secs = train_while(model, opt, x, y, lambda h=horizon: time.perf_counter() < h)
            rows["baseline"].append(steps / secs)

            t0 = time.perf_counter()
            handle = cloudckpt.async_save(state, f"{base}/t{rep}.pt", storage_options=opts)
            stall["thread"].append(time.perf_counter() - t0)
            steps, secs = train_while(model, opt, x, y, lambda h=handle: not h.done())
            handle.result()
            rows["thread"].append(steps / secs)
            upload["thread"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            snap = snapshot(state, pool)
            parent.send(
                (
                    snap.structure,
                    snap.storages,
                    snap.parts,
                    snap.tensors,
                    snap.nbytes,
                    f"{base}/p{rep}.pt",
                    opts,
                )
            )
            stall["process"].append(time.perf_counter() - t0)
            steps, secs = train_while(model, opt, x, y, lambda: not parent.poll())
            parent.recv()
            snap.release(pool)
            rows["process"].append(steps / secs)
            upload["process"].append(time.perf_counter() - t0)
        parent.send(None)
        proc.join(30)
    finally:
        if server is not None:
            stop(server)
        shutil.rmtree(scratch, ignore_errors=True)

    base = statistics.median(rows["baseline"])
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "state_mib": args.state_mib,
        "target": args.target,
        "reps": args.reps,
        "steps_per_s": {k: statistics.median(v) for k, v in rows.items()},
        "slowdown": {k: 1 - statistics.median(rows[k]) / base for k in ("thread", "process")},
        "upload_s": {k: statistics.median(v) for k, v in upload.items()},
        "stall_s": {k: statistics.median(v) for k, v in stall.items()},
        "load_average": os.getloadavg()[0],
    }
    # What a checkpoint costs training: the fraction of steps lost while it runs, times
    # how long it runs (the CPU work itself has to happen in either design).
    result["training_seconds_lost"] = {
        k: result["slowdown"][k] * result["upload_s"][k] for k in ("thread", "process")
    }
    out = Path(__file__).with_name("results") / f"async_background_{args.target}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.target}: state {args.state_mib} MiB, {args.reps} reps, median; "
        f"baseline {base:.1f} steps/s"
    )
    print(f"{'mode':8} {'steps/s':>8} {'slowdown':>9} {'upload s':>9} {'stall s':>8}")
    for k in ("thread", "process"):
        print(
            f"{k:8} {result['steps_per_s'][k]:8.1f} {result['slowdown'][k]:9.1%} "
            f"{result['upload_s'][k]:9.2f} {result['stall_s'][k]:8.3f}"
        )


if __name__ == "__main__":
    main()

"""Tiered checkpoints: blocking time, drain rate and restores of a local tier on tmpfs.

    .venv/bin/python -m benchmarks.studies.tiers [--mib 512] [--tensors 8] [--reps 5]

One process, one single-object state of MiB in a few large fp32 tensors, a
``CheckpointManager`` with ``local_dir`` on ``/dev/shm`` and its bucket on
``rclone serve s3`` on ``/dev/shm`` (``benchmarks/server.py``, DEBUG log for counting).
Each figure is the median of ``--reps`` repetitions, after one untimed warm-up:

- ``save`` / ``async_save`` blocking time (until the call returns) against one warm
  memcpy of the state (target <= 1.5x);
- drain throughput: bytes over the seconds from ``save`` returning (the local commit;
  the drain is queued just before) to ``drain()`` returning (the bucket's marker
  written), against the save ceiling (``systems/ceiling.put`` of the same bytes,
  botocore multipart PUT; target >= 0.9x);
- restore of a step held in both tiers with its local copy valid: the server's log after
  the call gives its requests, the GETs of payload objects and the bytes its file reads
  served (target: 0 payload bytes), and the time against the same restore from the bucket
  (a manager without ``local_dir``; target >= 3x faster);
- restore with the local copy corrupt (4 KiB flipped inside a tensor's record, size
  kept): the
  state must come back equal and a WARNING must name the step (asserted), timed too.

Prints the load average before and after, and one table.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from benchmarks import server
from benchmarks.systems import ceiling
from benchmarks.systems.cloudckpt_async import warm_memcpy_seconds
from benchmarks.systems.common import Ctx
from benchmarks.worker import build_state
from cloudckpt.testing import count_requests

BUCKET = "tiers-study"
PAYLOAD = "state.pt"
#: rclone's DEBUG lines: one per GET, naming the object, and one per read of its file
#: (the length asked of the file, more than a small object holds: an upper bound).
GET_LINE = re.compile(rb"serve s3: GET OBJECT Bucket: \S+ Object: (\S+)")
READ_LINE = re.compile(rb"ChunkedReader\.Read at \d+ length (\d+)")


class _Warnings(logging.Handler):
    """Keeps the messages of the WARNING records the ``cloudckpt`` logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _same(a: dict[str, torch.Tensor], b: Any) -> bool:
    """Whether the restored ``b`` holds exactly ``a``'s tensors (untimed)."""
    return isinstance(b, dict) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _traffic(srv: server.S3Server, since: int) -> dict[str, int]:
    """What the server logged after byte ``since``: requests, payload GETs, bytes read."""
    assert srv.log_path is not None
    with open(srv.log_path, "rb") as f:
        f.seek(since)
        text = f.read()
    gets = GET_LINE.findall(text)
    return {
        "requests": count_requests(srv.log_path, since, server="rclone"),
        "payload_gets": sum(1 for key in gets if key.endswith(PAYLOAD.encode())),
        "bytes_read": sum(int(n) for n in READ_LINE.findall(text)),
    }


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds ``fn(*args)`` took, and what it returned."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _loadavg() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared: say how busy)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _data_offset(path: Path, tensor: torch.Tensor) -> int:
    """Where ``tensor``'s bytes start in the archive at ``path``, plus 1 MiB: a spot
    inside a storage record, which only the record's CRC-32 check can catch."""
    probe = tensor.contiguous().view(-1).view(torch.uint8)[:4096].numpy().tobytes()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        at = m.find(probe)
    if at < 0:
        raise LookupError(f"the tensor's bytes are not in {path}")
    return at + min(1 << 20, tensor.nbytes // 2)


def _corrupt(path: Path, at: int) -> bytes:
    """Flip 4 KiB at ``at`` (size kept); returns the original bytes to put back."""
    with open(path, "r+b") as f:
        f.seek(at)
        original = f.read(4096)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in original))
    return original


def _repair(path: Path, at: int, original: bytes) -> None:
    """Put back the bytes :func:`_corrupt` flipped, for the next repetition."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    reps: int = args.reps

    print(f"load average before: {_loadavg()}")
    state = build_state(args.mib << 20, args.tensors, 0)
    nbytes = ceiling.nbytes(state)
    srv = server.start()
    local_root = Path(tempfile.mkdtemp(prefix="cloudckpt-tiers-", dir="/dev/shm"))
    warnings = _Warnings()
    logging.getLogger("cloudckpt").addHandler(warnings)
    try:
        srv.make_bucket(BUCKET)
        so = srv.storage_options()
        ctx = Ctx(
            endpoint=srv.endpoint_url,
            access_key=srv.access_key_id,
            secret_key=srv.secret_access_key,
            region=srv.region,
            bucket=BUCKET,
            prefix="ceiling",
        )
        figs: dict[str, list[float]] = {}

        def add(name: str, value: float) -> None:
            figs.setdefault(name, []).append(value)

        # The ceiling: botocore's multipart PUT of the same bytes (one warm-up).
        data = ceiling.prepare(state)
        ceiling.warm(state, ctx)
        ceiling.save(data, ctx)
        for _ in range(reps):
            add("ceiling_put_s", _timed(ceiling.save, data, ctx)[0])
        del data
        memcpy = warm_memcpy_seconds(state)

        root = f"s3://{BUCKET}/run"
        manager = cloudckpt.CheckpointManager(
            root,
            keep_last=2,
            local_dir=local_root / "run",
            keep_local=2,
            storage_options=so,
        )
        bucket_only = cloudckpt.CheckpointManager(root, storage_options=so)

        # save and async_save: step 0 and 1 warm up (untimed); then reps of each.
        manager.save(0, state)
        manager.drain()
        manager.async_save(1, state).result()
        manager.drain()
        step = 2
        for _ in range(reps):
            blocking, _info = _timed(manager.save, step, state)
            t_commit = time.perf_counter()
            manager.drain()
            drained = time.perf_counter() - t_commit
            add("save_blocking_s", blocking)
            add("drain_s", drained)
            step += 1
        for _ in range(reps):
            blocking, handle = _timed(manager.async_save, step, state)
            handle.result()
            manager.drain()
            add("async_blocking_s", blocking)
            step += 1
        last = step - 1
        held = manager.info(last)
        assert held.tiers == ("local", "remote"), held.tiers

        # Restores of the last step: from local (valid), from the bucket, local corrupt.
        local_file = local_root / "run" / f"step-{last:09d}" / PAYLOAD
        assert local_file.is_file(), local_file
        traffic: list[dict[str, int]] = []
        bucket_traffic: list[dict[str, int]] = []
        for _ in range(reps):
            off = srv.log_offset()
            seconds, out = _timed(manager.restore, last)
            traffic.append(_traffic(srv, off))
            assert _same(state, out), "restore from the local tier returned other tensors"
            add("restore_local_s", seconds)
            del out
            off = srv.log_offset()
            seconds, out = _timed(bucket_only.restore, last)
            bucket_traffic.append(_traffic(srv, off))
            assert _same(state, out), "restore from the bucket returned other tensors"
            add("restore_bucket_s", seconds)
            del out
        at = _data_offset(local_file, list(state.values())[len(state) // 2])
        for _ in range(reps):
            original = _corrupt(local_file, at)
            warnings.messages.clear()
            try:
                seconds, out = _timed(manager.restore, last)
            finally:
                _repair(local_file, at, original)
            assert _same(state, out), "restore with a corrupt local copy returned other tensors"
            named = [m for m in warnings.messages if m.startswith(f"step {last}:")]
            assert named, f"no WARNING naming step {last}: {warnings.messages}"
            add("restore_corrupt_s", seconds)
            del out
        print(f"corrupt-copy WARNING: {named[0]}")
        manager.drain()
    finally:
        logging.getLogger("cloudckpt").removeHandler(warnings)
        server.stop(srv)
        shutil.rmtree(local_root, ignore_errors=True)

    m = {k: statistics.median(v) for k, v in figs.items()}
    gib = nbytes / 2**30
    ceiling_rate = gib / m["ceiling_put_s"]
    drain_rate = gib / m["drain_s"]
    local_t = {k: statistics.median(t[k] for t in traffic) for k in traffic[0]}
    bucket_t = {k: statistics.median(t[k] for t in bucket_traffic) for k in bucket_traffic[0]}
    rows = [
        ("warm memcpy", f"{memcpy:.3f} s", "", ""),
        (
            "save, blocking",
            f"{m['save_blocking_s']:.3f} s",
            f"{m['save_blocking_s'] / memcpy:.2f}x memcpy",
            _verdict(m["save_blocking_s"] / memcpy <= 1.5, "<= 1.5x"),
        ),
        (
            "async_save, blocking",
            f"{m['async_blocking_s']:.3f} s",
            f"{m['async_blocking_s'] / memcpy:.2f}x memcpy",
            _verdict(m["async_blocking_s"] / memcpy <= 1.5, "<= 1.5x"),
        ),
        ("ceiling PUT", f"{m['ceiling_put_s']:.3f} s", f"{ceiling_rate:.2f} GiB/s", ""),
        (
            "drain (commit -> bucket marker)",
            f"{m['drain_s']:.3f} s",
            f"{drain_rate:.2f} GiB/s = {drain_rate / ceiling_rate:.2f}x ceiling",
            _verdict(drain_rate / ceiling_rate >= 0.9, ">= 0.9x"),
        ),
        (
            "restore, local valid",
            f"{m['restore_local_s']:.3f} s",
            f"{local_t['requests']:.0f} requests, {local_t['payload_gets']:.0f} payload GETs, "
            f"{local_t['bytes_read']:.0f} B asked of its files",
            _verdict(local_t["payload_gets"] == 0, "0 payload bytes"),
        ),
        (
            "restore, bucket",
            f"{m['restore_bucket_s']:.3f} s",
            f"{bucket_t['requests']:.0f} requests, {bucket_t['payload_gets']:.0f} payload GETs, "
            f"{bucket_t['bytes_read'] / 2**20:.1f} MiB asked of its files",
            "",
        ),
        (
            "local vs bucket restore",
            "",
            f"{m['restore_bucket_s'] / m['restore_local_s']:.2f}x faster",
            _verdict(m["restore_bucket_s"] / m["restore_local_s"] >= 3, ">= 3x"),
        ),
        (
            "restore, local corrupt",
            f"{m['restore_corrupt_s']:.3f} s",
            "state equal, WARNING names the step",
            "met (asserted)",
        ),
    ]
    print(
        f"\n{args.mib} MiB in {args.tensors} fp32 tensors ({nbytes} B), median of {reps}; "
        f"load average after: {_loadavg()}\n"
    )
    print("| figure | median | against | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        "\nall repetitions (s): "
        + ", ".join(f"{k}={[round(x, 3) for x in v]}" for k, v in figs.items())
    )


def _verdict(met: bool, target: str) -> str:
    """The table's target column: met or missed, and the target."""
    return f"{'met' if met else 'missed'} ({target})"


if __name__ == "__main__":
    main()

"""Tiered checkpoints: blocking time, drain rate and restores of a local tier on tmpfs.

    .venv/bin/python -m benchmarks.studies.tiers [--mib 512] [--tensors 8] [--reps 5]
        [--out benchmarks/studies/results/tiers.json]

One process, one single-object state of MiB in a few large fp32 tensors, a
``CheckpointManager`` with ``local_dir`` on ``/dev/shm`` and its bucket on
``rclone serve s3`` on ``/dev/shm`` (``benchmarks/server.py``, DEBUG log for counting).
Each figure is the median of ``--reps`` repetitions, after one untimed warm-up:

- ``save`` blocking time (until the call returns) against the floor: writing the
  state's bytes once into a new file on ``/dev/shm`` (``os.write`` from the tensors' own
  memory, then ``fsync``; the tier's save faults in the same new tmpfs pages), target
  <= 1.3x;
- ``async_save`` blocking time against one warm memcpy of the state, timed just before
  each ``async_save`` (target <= 1.5x);
- drain throughput: bytes over the seconds from ``save`` returning (the local commit;
  the drain is queued just before) to ``drain()`` returning (the bucket's marker
  written), against the save ceiling (``systems/ceiling.put`` of the same bytes,
  botocore multipart PUT; target >= 0.9x);
- restore of a step held in both tiers with its local copy valid: the server's log after
  the call gives its requests, the GETs of payload objects and the bytes its file reads
  served (target: 0 payload GETs), and the time against the same restore from the bucket
  (a manager without ``local_dir``; target >= 3x faster);
- restore with the local copy corrupt (4 KiB flipped inside a tensor's record, size
  kept): the state must come back equal and a WARNING must name the step (asserted),
  timed too.

Two figures explain the others: ``cloudckpt.save`` of the state to a new file on
``/dev/shm`` (what a synchronous save writes before it returns: the floor's bytes plus
the archive's headers and CRC-32s) and allocating and filling tensors of the state's
shapes (the fresh memory a restore from the bucket loads into; a restore from local maps
the tier's file instead). The floor, the plain save and the fresh memory are timed
interleaved, one of each per repetition.

:func:`measure` returns every repetition, the medians, the traffic counts, the load
averages before and after and the WARNING seen; the command writes them to ``--out``
(``make bench`` runs it, ``benchmarks/run.py``) and :func:`tiers_section` renders the
"Tiered checkpoints" section of docs/benchmarks.md from that file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.many_ranks import STUDY_RESULTS, part, read_study

if TYPE_CHECKING:
    import torch

    from benchmarks import server

__all__ = ["COMMAND", "RESULTS_NAME", "TARGETS", "measure", "tiers_section", "write"]

BUCKET = "tiers-study"
PAYLOAD = "state.pt"
RESULTS_NAME = "tiers.json"
#: How the results file is made (the page says so when it is missing).
COMMAND = ".venv/bin/python -m benchmarks.studies.tiers"
FINDINGS = "2026-12-06-the-tier-save-against-a-raw-write.md"
#: The targets: ``save`` blocking at most this many raw writes of the state to a new
#: tmpfs file, ``async_save`` at most this many warm memcpys, the drain at least this
#: share of the save ceiling's rate, a local restore this many times faster than the
#: bucket's.
TARGETS = {
    "save_vs_write": 1.3,
    "async_vs_memcpy": 1.5,
    "drain_vs_ceiling": 0.9,
    "local_vs_bucket": 3.0,
}
#: rclone's DEBUG lines: one per GET, naming the object, and one per read of its file
#: (the length asked of the file, more than a small object holds: an upper bound).
GET_LINE = re.compile(rb"serve s3: GET OBJECT Bucket: \S+ Object: (\S+)")
READ_LINE = re.compile(rb"ChunkedReader\.Read at \d+ length (\d+)")
MiB = 1024**2
GiB = 1024**3


class _Warnings(logging.Handler):
    """Keeps the messages of the WARNING records the ``cloudckpt`` logger emits."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _same(a: dict[str, torch.Tensor], b: Any) -> bool:
    """Whether the restored ``b`` holds exactly ``a``'s tensors (untimed)."""
    import torch

    return isinstance(b, dict) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _traffic(srv: server.S3Server, since: int) -> dict[str, int]:
    """What the server logged after byte ``since``: requests, payload GETs, bytes read."""
    from cloudckpt.testing import count_requests

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


def _loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (the machine is shared: say how busy)."""
    return [round(x, 2) for x in os.getloadavg()]


def _data_offset(path: Path, tensor: torch.Tensor) -> int:
    """Where ``tensor``'s bytes start in the archive at ``path``, plus 1 MiB: a spot
    inside a storage record, which only the record's CRC-32 check can catch."""
    import torch

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


def _raw_write_s(state: dict[str, torch.Tensor], path: Path) -> float:
    """Seconds to write the state's tensor bytes once into a new file at ``path``: created,
    ``os.write`` from each tensor's own memory, ``fsync``, closed (the views are made
    before the clock starts). The floor of a synchronous save to a tmpfs tier: the same
    new pages faulted in and filled, with no archive around the bytes."""
    views = [t.contiguous().numpy().data.cast("B") for t in state.values()]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for view in views:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _fresh_memory_s(state: dict[str, torch.Tensor]) -> float:
    """Seconds to allocate tensors of the state's shapes and fill them: the first touch
    of new pages that every restore pays before its bytes arrive."""
    import torch

    t0 = time.perf_counter()
    fresh = [torch.empty_like(t).fill_(0) for t in state.values()]
    seconds = time.perf_counter() - t0
    del fresh
    return seconds


def measure(mib: int = 512, tensors: int = 8, reps: int = 5) -> dict[str, Any]:
    """Run the study once: every repetition of every figure, their medians, the server
    traffic of the restores, the load averages before and after, the WARNING seen.

    Raises ``AssertionError`` when a restore returns other tensors or the corrupt-copy
    restore logs no WARNING naming its step."""
    import cloudckpt
    from benchmarks import server
    from benchmarks.systems import ceiling
    from benchmarks.systems.cloudckpt_async import warm_memcpy_seconds
    from benchmarks.systems.common import Ctx
    from benchmarks.worker import build_state

    load_before = _loadavg()
    state = build_state(mib << 20, tensors, 0)
    nbytes = ceiling.nbytes(state)
    srv = server.start()
    local_root = Path(tempfile.mkdtemp(prefix="cloudckpt-tiers-", dir="/dev/shm"))
    warnings = _Warnings()
    logging.getLogger("cloudckpt").addHandler(warnings)
    figs: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        figs.setdefault(name, []).append(value)

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

        # The ceiling: botocore's multipart PUT of the same bytes (one warm-up).
        data = ceiling.prepare(state)
        ceiling.warm(state, ctx)
        ceiling.save(data, ctx)
        for _ in range(reps):
            add("ceiling_put_s", _timed(ceiling.save, data, ctx)[0])
        del data
        # The save's floor (the state's bytes written once to a new tmpfs file), and what
        # explains the save and the restores: a plain save to new tmpfs pages, and the
        # first touch of fresh memory of the state's size. One untimed warm-up each.
        raw, plain = local_root / "raw.bin", local_root / "plain.pt"
        _raw_write_s(state, raw)
        raw.unlink()
        cloudckpt.save(state, str(plain))
        plain.unlink()
        for _ in range(reps):
            add("raw_write_shm_s", _raw_write_s(state, raw))
            raw.unlink()
            add("plain_save_shm_s", _timed(cloudckpt.save, state, str(plain))[0])
            plain.unlink()
            add("fresh_memory_s", _fresh_memory_s(state))

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
            # The memcpy it is held against, timed beside it (one sample at the start
            # drifted from the copies the saves made minutes later).
            add("memcpy_s", warm_memcpy_seconds(state))
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
        named: list[str] = []
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
        manager.drain()
    finally:
        logging.getLogger("cloudckpt").removeHandler(warnings)
        server.stop(srv)
        shutil.rmtree(local_root, ignore_errors=True)

    def medians(runs: list[dict[str, int]]) -> dict[str, float]:
        return {k: statistics.median(t[k] for t in runs) for k in runs[0]}

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mib": mib,
        "tensors": tensors,
        "bytes": nbytes,
        "reps": reps,
        "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": _loadavg()},
        "memcpy_s": statistics.median(figs["memcpy_s"]),
        "medians": {k: statistics.median(v) for k, v in figs.items()},
        "repetitions": figs,
        "traffic": {
            "local": medians(traffic),
            "bucket": medians(bucket_traffic),
            "local_runs": traffic,
            "bucket_runs": bucket_traffic,
        },
        "corrupt": {"state_equal": True, "warning": named[0] if named else None},
    }


def write(results: dict[str, Any], out: Path) -> None:
    """Write ``results`` (from :func:`measure`) to ``out`` as JSON."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


def _s(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f} s" if isinstance(value, int | float) else "-"


def _ratio(a: Any, b: Any) -> float | None:
    """``a / b`` where both are numbers and ``b`` is not zero."""
    ok = isinstance(a, int | float) and isinstance(b, int | float) and b
    return a / b if ok else None


def _verdict(value: float | None, goal: float, higher: bool) -> str:
    """The table's target column: met, missed or not measured, and the target."""
    target = f"{'>=' if higher else '<='} {goal:g}x"
    if value is None:
        return f"not measured ({target})"
    met = value >= goal if higher else value <= goal
    return f"{'met' if met else '**missed**'} ({target})"


def tiers_section(results: Path = STUDY_RESULTS) -> list[str]:
    """The page's "Tiered checkpoints" section from ``results/tiers.json``: the table of
    figures with each target's verdict computed from the file, and what limits them;
    "No results yet" without the file."""
    lines = ["## Tiered checkpoints", ""]
    data = read_study(results / RESULTS_NAME)
    m = part(data, "medians")
    if data is None or not m:
        return [*lines, f"No results yet: `{COMMAND}` writes `{RESULTS_NAME}`.", ""]
    memcpy = data.get("memcpy_s")
    nbytes = data.get("bytes")
    traffic = part(data, "traffic")
    local, bucket, corrupt = part(traffic, "local"), part(traffic, "bucket"), part(data, "corrupt")
    floor = m.get("raw_write_shm_s")
    save_x = _ratio(m.get("save_blocking_s"), floor)
    save_memcpy = _ratio(m.get("save_blocking_s"), memcpy)
    async_x = _ratio(m.get("async_blocking_s"), memcpy)
    drain_x = _ratio(m.get("ceiling_put_s"), m.get("drain_s"))  # same bytes: rate ratio
    local_x = _ratio(m.get("restore_bucket_s"), m.get("restore_local_s"))

    def rate(seconds: Any) -> str:
        r = _ratio(nbytes / GiB if isinstance(nbytes, int | float) else None, seconds)
        return "-" if r is None else f"{r:.2f} GiB/s"

    def x(value: float | None, what: str) -> str:
        return "-" if value is None else f"{value:.2f}x {what}"

    def count(t: dict[str, Any], key: str) -> str:
        return f"{t[key]:.0f}" if isinstance(t.get(key), int | float) else "-"

    gets = local.get("payload_gets")
    local_ok = {0: "met", None: "not measured"}.get(gets, "**missed**") + " (0 payload GETs)"
    corrupt_ok = corrupt.get("state_equal") is True and bool(corrupt.get("warning"))
    read_mib = bucket.get("bytes_read")
    read = f"{read_mib / MiB:.1f} MiB" if isinstance(read_mib, int | float) else "-"
    loads = part(data, "load_average")
    before, after = loads.get("before"), loads.get("after")
    busy = ""
    if isinstance(before, list) and isinstance(after, list) and before and after:
        busy = f", load average (1 min) {before[0]:.2f} before and {after[0]:.2f} after"
    cpus = f" on {data['cpus']} CPUs" if data.get("cpus") else ""
    lines += [
        f"`benchmarks/studies/tiers.py` (`make bench` runs it; alone: `{COMMAND}`): a "
        "`CheckpointManager` with `local_dir` on `/dev/shm` and its bucket on `rclone serve "
        "s3` on `/dev/shm`, one process, a single-object state of "
        f"{data.get('mib', '-')} MiB in {data.get('tensors', '-')} fp32 tensors, median of "
        f"{data.get('reps', '-')} repetitions after one untimed warm-up. Measured "
        f"{str(data.get('date', '-'))[:10]}{cpus}{busy}; every repetition is in "
        f"`benchmarks/studies/results/{RESULTS_NAME}`. What limits the figures, with "
        f"profiles: [benchmarks/findings/{FINDINGS}](../benchmarks/findings/{FINDINGS}).",
        "",
        "| figure | median | against | target |",
        "|---|---:|---|---|",
        f"| one warm memcpy of the state | {_s(memcpy)} | | |",
        f"| the state's bytes written once to a new file on `/dev/shm` (the floor) "
        f"| {_s(floor)} | {x(_ratio(floor, memcpy), 'memcpy')} | |",
        f"| `save`, blocking | {_s(m.get('save_blocking_s'))} | {x(save_x, 'the floor')}"
        f"{'' if save_memcpy is None else f' ({save_memcpy:.1f}x memcpy)'} "
        f"| {_verdict(save_x, TARGETS['save_vs_write'], False)} |",
        f"| `async_save`, blocking | {_s(m.get('async_blocking_s'))} | {x(async_x, 'memcpy')} "
        f"| {_verdict(async_x, TARGETS['async_vs_memcpy'], False)} |",
        f"| save ceiling (botocore multipart PUT) | {_s(m.get('ceiling_put_s'))} "
        f"| {rate(m.get('ceiling_put_s'))} | |",
        f"| drain, local commit to bucket marker | {_s(m.get('drain_s'))} "
        f"| {rate(m.get('drain_s'))} = {x(drain_x, 'the ceiling')} "
        f"| {_verdict(drain_x, TARGETS['drain_vs_ceiling'], True)} |",
        f"| restore, local copy valid | {_s(m.get('restore_local_s'))} "
        f"| payload GETs: {count(local, 'payload_gets')}; bucket requests: "
        f"{count(local, 'requests')} ({count(local, 'bytes_read')} B asked of its files) "
        f"| {local_ok} |",
        f"| restore of the same step from the bucket | {_s(m.get('restore_bucket_s'))} "
        f"| payload GETs: {count(bucket, 'payload_gets')}; {read} asked of its files | |",
        f"| local vs bucket restore | | {x(local_x, 'faster')} "
        f"| {_verdict(local_x, TARGETS['local_vs_bucket'], True)} |",
        f"| restore, local copy corrupt | {_s(m.get('restore_corrupt_s'))} "
        f"| state equal, WARNING naming the step "
        f"| {'met (asserted)' if corrupt_ok else 'not measured'} |",
        "",
    ]
    plain, fresh = m.get("plain_save_shm_s"), m.get("fresh_memory_s")
    notes = []
    if isinstance(plain, int | float):
        plain_x = _ratio(plain, floor)
        notes.append(
            "The synchronous `save` writes the whole archive into new tmpfs pages before "
            "it returns, as the floor writes its bytes: that write alone (`cloudckpt.save` "
            f"to a new file on `/dev/shm`) took {plain:.3f} s"
            + (f", {plain_x:.2f}x the floor" if plain_x is not None else "")
            + " (the archive's CRC-32s: one more read of the bytes, in memory). After its "
            "local commit a save only uncommits the steps local retention drops and queues "
            "the drain: their files are removed, and the drainer starts, once it has "
            "returned. `async_save` returns once the state is copied to its staging buffers."
        )
    if isinstance(fresh, int | float):
        notes.append(
            "The restore from the bucket loads into fresh memory: allocating and filling "
            f"the state's tensors alone took {fresh:.3f} s in this run (timed apart, under "
            "the same load). The restore from local maps the tier's file instead "
            "(`load(mmap=True)`, copy-on-write) and reads each page once, for the CRC-32 "
            "of every record. This bucket is a tmpfs server over loopback "
            f"({rate(m.get('restore_bucket_s'))} on a restore): the ratio grows with a "
            "slower bucket."
        )
    notes.append("The drain and the ceiling are both bound by this server's multipart writes.")
    warning = corrupt.get("warning")
    if isinstance(warning, str) and warning:
        notes.append(f"The corrupt-copy WARNING read: `{warning}`")
    return [*lines, " ".join(notes), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="state size in MiB (512)")
    parser.add_argument("--tensors", type=int, default=8, help="fp32 tensors (8)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (5)")
    parser.add_argument(
        "--out",
        type=Path,
        default=STUDY_RESULTS / RESULTS_NAME,
        help="results file (benchmarks/studies/results/tiers.json)",
    )
    args = parser.parse_args(argv)
    results = measure(args.mib, args.tensors, args.reps)
    write(results, args.out)
    print("\n".join(tiers_section(args.out.parent) if args.out.name == RESULTS_NAME else []))
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

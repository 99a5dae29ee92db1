"""``cloudckpt bench``: request latency and write/read throughput against one store.

Everything happens under ``URL/.cloudckpt-bench-<id>/`` and is deleted afterwards.
Steps: ``requests`` small PUT/HEAD/GET round trips (latency percentiles); one object
of ``size`` bytes written through the same multipart sink saves use, at each write
concurrency; the same object read back in ``part_size`` ranges at each read
concurrency.

Suggestion: the concurrency with the best throughput (the smallest one within 10% of
it), and the smallest part size that keeps one request's latency under 10% of the
time its bytes take on one stream (clamped to 5 MiB..256 MiB, a power of two in MiB).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..io.scheduler import TransferGroup
from ..io.sink import ObjectSink
from ..options import MIN_PART_SIZE, MiB, TransferOptions
from ..store import Store

__all__ = ["BenchResult", "run_bench", "suggest"]


@dataclass
class BenchResult:
    url: str
    size: int
    part_size: int
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    write_gbps: dict[int, float] = field(default_factory=dict)
    read_gbps: dict[int, float] = field(default_factory=dict)
    suggestion: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "size": self.size,
            "part_size": self.part_size,
            "latency_ms": self.latency_ms,
            "write_GBps": {str(k): v for k, v in self.write_gbps.items()},
            "read_GBps": {str(k): v for k, v in self.read_gbps.items()},
            "suggestion": self.suggestion,
        }


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "p50": round(statistics.median(ordered) * 1000, 2),
        "p95": round(pick(0.95) * 1000, 2),
        "max": round(ordered[-1] * 1000, 2),
    }


def _best(results: dict[int, float]) -> int:
    top = max(results.values())
    return min(c for c, v in results.items() if v >= 0.9 * top)


def suggest(result: BenchResult) -> dict[str, Any]:
    """Part size and concurrencies from the measurements (see the module docstring)."""
    latency = result.latency_ms.get("put", {}).get("p50", 10.0) / 1000
    one_stream = result.write_gbps.get(min(result.write_gbps), 0.1) if result.write_gbps else 0.1
    wanted = 10 * latency * one_stream * 1e9
    part = max(MIN_PART_SIZE, min(256 * MiB, int(wanted)))
    mib = 1 << max(0, (part - 1) // MiB).bit_length()  # next power of two, in MiB
    part = max(MIN_PART_SIZE, mib * MiB)
    return {
        "part_size": part,
        "write_concurrency": _best(result.write_gbps) if result.write_gbps else None,
        "read_concurrency": _best(result.read_gbps) if result.read_gbps else None,
    }


def run_bench(
    store: Store,
    key: str,
    options: TransferOptions,
    *,
    size: int = 32 * MiB,
    part_size: int = 8 * MiB,
    concurrencies: Sequence[int] = (1, 4, 8),
    requests: int = 20,
    report: Callable[[str], None] = lambda s: None,
) -> BenchResult:
    """Measure, clean up, and return the numbers with a suggestion."""
    base = f"{key.strip('/')}/" if key.strip("/") else ""
    base += f".cloudckpt-bench-{uuid.uuid4().hex[:12]}/"
    result = BenchResult(url=store.url(base), size=size, part_size=part_size)
    written: list[str] = []
    try:
        report(f"latency: {requests} small PUT/HEAD/GET round trips")
        small = os.urandom(4096)
        times: dict[str, list[float]] = {"put": [], "head": [], "get": []}
        for i in range(requests):
            k = f"{base}small-{i}"
            for op, fn in (
                ("put", functools.partial(store.put, k, small)),
                ("head", functools.partial(store.head, k)),
                ("get", functools.partial(store.get_range, k, 0, len(small))),
            ):
                t = time.perf_counter()
                fn()
                times[op].append(time.perf_counter() - t)
            written.append(k)
        result.latency_ms = {op: _percentiles(v) for op, v in times.items()}

        payload = memoryview(os.urandom(min(size, 4 * MiB)))
        big = f"{base}object"
        for c in concurrencies:
            report(f"write {size / MiB:.0f} MiB, {c} parts in flight")
            opts = options.replace(part_size=part_size, write_concurrency=c, progress=False)
            sink = ObjectSink(store, big, opts, size_hint=size)
            t = time.perf_counter()
            try:
                left = size
                while left:
                    n = min(left, len(payload))
                    sink.write(payload[:n])
                    left -= n
                sink.commit()
            except BaseException:
                sink.abort()
                raise
            result.write_gbps[c] = round(size / (time.perf_counter() - t) / 1e9, 4)
        written.append(big)

        for c in concurrencies:
            report(f"read {size / MiB:.0f} MiB, {c} ranges in flight")
            group = TransferGroup(options, c)
            buffers = [bytearray(min(part_size, size)) for _ in range(c)]
            t = time.perf_counter()
            for i, start in enumerate(range(0, size, part_size)):
                n = min(part_size, size - start)
                view = memoryview(buffers[i % c])[:n]
                group.submit(
                    functools.partial(store.read_into, big, start, [view]),
                    f"read {store.url(big)} at {start}",
                )
            group.wait()
            result.read_gbps[c] = round(size / (time.perf_counter() - t) / 1e9, 4)
    finally:
        for k in written:
            store.delete(k)
    result.suggestion = suggest(result)
    return result

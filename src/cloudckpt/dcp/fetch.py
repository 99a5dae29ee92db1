"""Ranged reads for a DCP load: coalesced per data object, run concurrently, scattered.

Callers add ``(object, start, destination)`` requests. :meth:`RangeFetcher.run` sorts
each object's requests, joins neighbours (gaps up to ``MAX_GAP`` bytes are read and
dropped) into requests of at most ``read_chunk_size``, splits larger ones into pieces,
and runs them through one :class:`~cloudckpt.engine.scheduler.TransferGroup`
(``read_concurrency`` at once, retried). Each response is read straight into its
destinations with ``Store.read_into``.
"""

from __future__ import annotations

from collections import defaultdict

from ..engine.scheduler import TransferGroup
from .location import CheckpointLocation

__all__ = ["MAX_GAP", "RangeFetcher"]

#: Unneeded bytes between two ranges that are still fetched in one request: on an
#: object store one more request costs more than this many bytes.
MAX_GAP = 64 * 1024


class RangeFetcher:
    """Collects byte ranges to fill, then fetches them all."""

    def __init__(self, location: CheckpointLocation) -> None:
        self.location = location
        self._requests: dict[str, list[tuple[int, memoryview]]] = defaultdict(list)
        #: Requests sent and bytes fetched by :meth:`run` (for tests and benchmarks).
        self.requests = 0
        self.bytes = 0

    def add(self, relative: str, start: int, dest: memoryview) -> None:
        """Fill ``dest`` from byte ``start`` of the data object ``relative``."""
        if len(dest):
            self._requests[relative].append((start, dest))

    def run(self) -> None:
        """Fetch everything added so far; raise the first failure (after retries)."""
        opts = self.location.options
        store = self.location.store
        chunk = opts.read_chunk_size
        pending, self._requests = self._requests, defaultdict(list)
        group = TransferGroup(opts, opts.read_concurrency, prefix=self.location.prefix)

        def submit(key: str, url: str, start: int, buffers: list[memoryview]) -> None:
            size = sum(len(b) for b in buffers)
            self.requests += 1
            self.bytes += size
            group.submit(
                lambda: store.read_into(key, start, buffers),
                f"read {size} bytes at {start} of {url}",
            )

        try:
            for relative, requests in pending.items():
                key, url = self.location.key(relative), self.location.url_of(relative)
                requests.sort(key=lambda r: r[0])
                run: list[memoryview] = []
                run_start = run_end = 0
                for start, dest in requests:
                    n = len(dest)
                    if n > chunk:
                        for pos in range(0, n, chunk):
                            submit(key, url, start + pos, [dest[pos : pos + chunk]])
                        continue
                    gap = start - run_end
                    if run and 0 <= gap <= MAX_GAP and start + n - run_start <= chunk:
                        if gap:
                            run.append(memoryview(bytearray(gap)))
                        run.append(dest)
                    else:
                        if run:
                            submit(key, url, run_start, run)
                        run, run_start = [dest], start
                    run_end = start + n
                if run:
                    submit(key, url, run_start, run)
            group.wait()
        except BaseException:
            group.cancel()
            raise

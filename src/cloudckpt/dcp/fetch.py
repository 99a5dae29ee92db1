"""Ranged reads for a DCP load: coalesced per data object, run concurrently, scattered.

Callers add ``(object, start, buffers, on_done)`` requests: ``buffers`` are filled in
order from byte ``start`` (a scatter list: a checked slice reads a few bytes into small
scratch buffers around its destination tensor), and ``on_done`` runs in the reading
thread once all of the request's bytes have arrived (the checksum check). Its error
fails the fetch like a failed read. Each batch of requests is sorted per object, its
neighbours joined (gaps up to the ``read_gap`` option are read and dropped) into
requests of at most ``read_chunk_size``, larger ones split into pieces, and all of them
run through one :class:`~cloudckpt.engine.scheduler.TransferGroup` (``read_concurrency``
at once, retried). Each response is read straight into its buffers with
``Store.read_into``.

A streaming fetcher sends a batch whenever ``read_chunk_size`` bytes are waiting, so
reads start while the caller is still planning the rest (a rank resharding a large
state plans hundreds of slices; on a busy host that took longer than their first
reads). :meth:`RangeFetcher.run` sends what is left and waits for all of it; after an
error elsewhere, :meth:`RangeFetcher.cancel` stops what was sent.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence

from ..engine.scheduler import TransferGroup
from .location import CheckpointLocation

__all__ = ["RangeFetcher"]


class _Request:
    """Buffers to fill from ``start``; ``on_done`` once every piece of them has arrived."""

    __slots__ = ("buffers", "on_done", "pending", "size", "start")

    def __init__(
        self, start: int, buffers: list[memoryview], on_done: Callable[[], None] | None
    ) -> None:
        self.start = start
        self.buffers = buffers
        self.size = sum(b.nbytes for b in buffers)
        self.on_done = on_done
        self.pending = 0


def _pieces(buffers: list[memoryview], chunk: int) -> list[tuple[int, list[memoryview]]]:
    """Split a scatter list into lists of at most ``chunk`` bytes: (offset, views)."""
    out: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    room, pos, start = chunk, 0, 0
    for buf in buffers:
        used = 0
        while used < buf.nbytes:
            take = min(room, buf.nbytes - used)
            current.append(buf[used : used + take])
            used += take
            room -= take
            pos += take
            if room == 0:
                out.append((start, current))
                current, room, start = [], chunk, pos
    if current:
        out.append((start, current))
    return out


class RangeFetcher:
    """Collects byte ranges to fill, then fetches them all."""

    def __init__(self, location: CheckpointLocation, *, stream: bool = False) -> None:
        self.location = location
        self._requests: dict[str, list[_Request]] = defaultdict(list)
        self._waiting = 0  # bytes added and not yet sent
        self._stream = stream
        self._group: TransferGroup | None = None
        self._lock = threading.Lock()
        #: Requests sent and bytes fetched (for tests and benchmarks).
        self.requests = 0
        self.bytes = 0

    def add(
        self,
        relative: str,
        start: int,
        dest: memoryview | Sequence[memoryview],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Fill ``dest`` (one buffer or a scatter list) from byte ``start`` of ``relative``;
        then call ``on_done`` (in the thread that read the last byte)."""
        buffers = [dest] if isinstance(dest, memoryview) else list(dest)
        request = _Request(start, [b for b in buffers if b.nbytes], on_done)
        if request.size:
            self._requests[relative].append(request)
            self._waiting += request.size
            if self._stream and self._waiting >= self.location.options.read_chunk_size:
                self._send()
        elif on_done is not None:
            on_done()

    def _finish(self, done: list[_Request]) -> None:
        ready = []
        with self._lock:
            for request in done:
                request.pending -= 1
                if request.pending == 0 and request.on_done is not None:
                    ready.append(request.on_done)
        for call in ready:
            call()

    def run(self) -> None:
        """Fetch everything added so far; raise the first failure (after retries)."""
        self._send()
        group, self._group = self._group, None
        if group is not None:
            try:
                group.wait()
            except BaseException:
                group.cancel()
                raise

    def __enter__(self) -> RangeFetcher:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        """Leaving on an error cancels the reads already sent (they fill the caller's
        buffers)."""
        if kind is not None:
            self.cancel()

    def cancel(self) -> None:
        """Stop the reads sent and not finished, and drop those not sent (after an error)."""
        self._requests, self._waiting = defaultdict(list), 0
        group, self._group = self._group, None
        if group is not None:
            group.cancel()

    def _send(self) -> None:
        """Send the waiting requests, joined and split (blocks while the group is full).
        On a failure, everything sent is cancelled before the error is raised."""
        opts = self.location.options
        store = self.location.store
        chunk, max_gap = opts.read_chunk_size, opts.read_gap
        pending, self._requests, self._waiting = self._requests, defaultdict(list), 0
        if self._group is None:
            self._group = TransferGroup(opts, opts.read_concurrency)
        group = self._group

        def submit(
            key: str, url: str, start: int, buffers: list[memoryview], covers: list[_Request]
        ) -> None:
            size = sum(b.nbytes for b in buffers)
            self.requests += 1
            self.bytes += size

            def read() -> None:
                store.read_into(key, start, buffers)
                self._finish(covers)

            group.submit(read, f"read {size} bytes at {start} of {url}")

        try:
            for relative, requests in pending.items():
                key, url = self.location.key(relative), self.location.url_of(relative)
                requests.sort(key=lambda r: r.start)
                run: list[memoryview] = []
                covers: list[_Request] = []
                run_start = run_end = 0
                for request in requests:
                    start, n = request.start, request.size
                    if n > chunk:
                        pieces = _pieces(request.buffers, chunk)
                        request.pending = len(pieces)
                        for pos, views in pieces:
                            submit(key, url, start + pos, views, [request])
                        continue
                    request.pending = 1
                    gap = start - run_end
                    if run and 0 <= gap <= max_gap and start + n - run_start <= chunk:
                        if gap:
                            run.append(memoryview(bytearray(gap)))
                        run += request.buffers
                        covers.append(request)
                    else:
                        if run:
                            submit(key, url, run_start, run, covers)
                        run, covers, run_start = list(request.buffers), [request], start
                    run_end = start + n
                if run:
                    submit(key, url, run_start, run, covers)
        except BaseException:
            self.cancel()
            raise

"""One range planner for every read: sort, join neighbours across small gaps, split large.

Callers add requests ``(key, start, buffers, on_done)`` on one store: ``buffers`` are
filled in order from byte ``start`` (a scatter list: a record's header and its tensor's
memory, or a checked slice with scratch around it), and ``on_done`` runs in the reading
thread once every byte of the request has arrived (the checksum check); its error
fails the read like a failed request. Each batch is sorted per key, neighbours joined
(gaps of up to ``read_gap`` bytes are read and dropped) into reads of at most
``read_chunk_size``, larger requests split into pieces, and every read runs through one
:class:`~cloudckpt.io.scheduler.TransferGroup` (``read_concurrency`` at once), each
straight into its buffers with ``Store.read_into`` (which retries).

A streaming reader sends a batch whenever ``read_chunk_size`` bytes are waiting, so
reads start while the caller is still planning the rest; ``add`` then blocks while the
group is full, which bounds what the caller allocates ahead. :meth:`RangeReader.run`
sends what is left and waits for all of it; leaving its ``with`` block on an error
cancels what was sent. :meth:`RangeReader.start` sends what was added from a thread of
its own instead, so that the caller goes on (a load unpickling while its records
arrive). Used by ``load``, the DCP reader, ``cloudckpt verify`` and
``cloudckpt cp`` (:func:`split`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..options import TransferOptions
from ..store import Store
from ..store.deadline import current_deadline, within
from .scheduler import Cancelled, TransferGroup

__all__ = ["RangeReader", "split"]

_R = TypeVar("_R", bound="RangeReader")


def split(start: int, size: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, start + size)`` as ``(start, size)`` pieces of at most ``chunk`` bytes."""
    return [(start + pos, min(chunk, size - pos)) for pos in range(0, size, chunk)]


class _Request:
    """Buffers to fill from ``start``; ``on_done`` once every piece of them has arrived.
    ``owner`` owns the buffers' memory when they are raw views (a tensor or storage):
    each read sent for the request holds it until that read has ended, so the memory
    outlives a read abandoned at Ctrl-C or a deadline (``TransferGroup.cancel``), which
    may still land in it; the request lets go of it once its reads are sent."""

    __slots__ = ("buffers", "on_done", "owner", "pending", "size", "start")

    def __init__(
        self,
        start: int,
        buffers: list[memoryview],
        on_done: Callable[[], None] | None,
        owner: object = None,
    ) -> None:
        self.start = start
        self.buffers = buffers
        self.size = sum(b.nbytes for b in buffers)
        self.on_done = on_done
        self.owner = owner
        self.pending = 0


def _pieces(buffers: list[memoryview], chunk: int) -> list[tuple[int, list[memoryview]]]:
    """A scatter list as lists of at most ``chunk`` bytes: (offset, views)."""
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


class RangeReader:
    """Collects byte ranges of one store's objects to fill, then reads them all."""

    def __init__(
        self,
        store: Store,
        options: TransferOptions,
        *,
        stream: bool = False,
        advance: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self._requests: dict[str, list[_Request]] = defaultdict(list)
        self._waiting = 0  # bytes added and not yet sent
        self._stream = stream
        self._advance = advance
        self._group: TransferGroup | None = None
        self._lock = threading.Lock()
        self._feeder: threading.Thread | None = None
        self._deadline = current_deadline()  # the operation's, whichever thread sends
        self._feed_error: BaseException | None = None
        self._stopped = False
        #: Reads sent and bytes fetched, gaps included (for tests and benchmarks).
        self.requests = 0
        self.bytes = 0

    def add(
        self,
        key: str,
        start: int,
        dest: memoryview | Sequence[memoryview],
        on_done: Callable[[], None] | None = None,
        owner: object = None,
    ) -> None:
        """Fill ``dest`` (one buffer or a scatter list) from byte ``start`` of ``key``;
        then call ``on_done`` (in the thread that read the last byte). ``owner``: what
        owns ``dest``'s memory when it is a raw view of a tensor or storage (kept alive
        until every read into it has ended, abandoned ones included)."""
        buffers = [dest] if isinstance(dest, memoryview) else list(dest)
        request = _Request(start, [b for b in buffers if b.nbytes], on_done, owner)
        if request.size:
            self._requests[key].append(request)
            self._waiting += request.size
            if self._stream and self._waiting >= self.options.read_chunk_size:
                self._send()
        elif on_done is not None:
            on_done()

    def start(self) -> None:
        """Send what was added so far from a thread of its own and return at once;
        :meth:`run` waits for it (and reads what was added after)."""
        if self._feeder is not None:
            raise RuntimeError("RangeReader.start() called twice")
        group = self._group_for_reads()
        pending, self._requests, self._waiting = self._requests, defaultdict(list), 0

        def feed() -> None:
            try:
                self._send_pending(pending)
            except BaseException as exc:
                self._feed_error = exc
                group.cancel_event.set()

        self._feeder = threading.Thread(target=feed, name="cloudckpt-read-feeder", daemon=True)
        self._feeder.start()

    def _join_feeder(self) -> None:
        feeder, self._feeder = self._feeder, None
        if feeder is not None:
            feeder.join()

    def run(self) -> None:
        """Read everything added so far; raise the first failure (after retries)."""
        self._join_feeder()
        if self._feed_error is not None and not isinstance(self._feed_error, Cancelled):
            self.cancel()
            raise self._feed_error
        self._send()
        group, self._group = self._group, None
        if group is not None:
            try:
                group.wait()
            except BaseException:
                group.cancel()
                raise

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        """Leaving on an error cancels the reads already sent (they fill the caller's
        buffers)."""
        if kind is not None:
            self.cancel()

    def cancel(self) -> None:
        """Stop the reads sent and not finished, and drop those not sent (after an error)."""
        self._requests, self._waiting = defaultdict(list), 0
        self._stopped = True
        if self._group is not None:
            self._group.cancel_event.set()
        self._join_feeder()
        group, self._group = self._group, None
        if group is not None:
            group.cancel()

    def _finish(self, covers: list[_Request]) -> None:
        ready = []
        with self._lock:
            for request in covers:
                request.pending -= 1
                if request.pending == 0 and request.on_done is not None:
                    ready.append(request.on_done)
        for call in ready:
            call()

    def _submit(
        self, key: str, start: int, buffers: list[memoryview], covers: list[_Request], n: int
    ) -> None:
        """One read of ``buffers`` from ``start``; ``n`` of its bytes are requested ones."""
        if self._stopped:
            raise Cancelled()
        group = self._group_for_reads()
        self.requests += 1
        self.bytes += sum(b.nbytes for b in buffers)
        store, advance = self.store, self._advance
        # This read's hold on the memory it fills, let go when it ends however it ends:
        # a failed load's exception (in a cycle with its transfer group until the next
        # full collection) then keeps no tensor alive.
        held = [r.owner for r in covers if r.owner is not None]

        def read() -> None:
            try:
                store.read_into(key, start, buffers)
                if advance is not None:
                    advance(n)
                self._finish(covers)  # the checks read the memory: held until they end
            finally:
                held.clear()

        group.submit(read, f"read {n} bytes at {start} of {store.url(key)}")

    def _group_for_reads(self) -> TransferGroup:
        if self._group is None:
            with within(self._deadline):
                self._group = TransferGroup(self.options, self.options.read_concurrency)
        return self._group

    def _send(self) -> None:
        """Send the waiting requests, joined and split (blocks while the group is full).
        On a failure, everything sent is cancelled before the error is raised."""
        pending, self._requests, self._waiting = self._requests, defaultdict(list), 0
        try:
            self._send_pending(pending)
        except BaseException:
            self.cancel()
            raise

    def _send_pending(self, pending: dict[str, list[_Request]]) -> None:
        chunk, max_gap = self.options.read_chunk_size, self.options.read_gap
        for key, requests in pending.items():
            requests.sort(key=lambda r: r.start)
            run: list[memoryview] = []
            covers: list[_Request] = []
            run_start = run_end = run_bytes = 0
            for request in requests:
                start, n = request.start, request.size
                if n > chunk:
                    pieces = _pieces(request.buffers, chunk)
                    request.pending = len(pieces)
                    for pos, views in pieces:
                        size = sum(v.nbytes for v in views)
                        self._submit(key, start + pos, views, [request], size)
                    continue
                request.pending = 1
                gap = start - run_end
                if run and 0 <= gap <= max_gap and start + n - run_start <= chunk:
                    if gap:
                        run.append(memoryview(bytearray(gap)))
                    run += request.buffers
                    covers.append(request)
                    run_bytes += n
                else:
                    if run:
                        self._submit(key, run_start, run, covers, run_bytes)
                    run, covers = list(request.buffers), [request]
                    run_start, run_bytes = start, n
                run_end = start + n
            if run:
                self._submit(key, run_start, run, covers, run_bytes)
            for request in requests:  # each read sent holds its own reference now
                request.owner = None

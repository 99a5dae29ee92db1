"""A write-only stream that turns bytes into multipart parts as they are produced.

``torch.save`` writes its archive into :class:`ObjectSink`; every ``part_size`` bytes
become one part, uploaded in the background while the next part fills. The sink owns
``write_concurrency`` part buffers and reuses them, so the memory a save adds is at
most ``write_concurrency * part_size`` whatever the checkpoint size. The buffers come
from, and go back to, a process-wide cache (:mod:`.buffers`), so the next save finds
them warm.

Commit rule: nothing is visible at the URL until :meth:`commit` completes the upload
(or, for an object smaller than one part, puts it in one request). :meth:`abort`
discards every stored part; it is what every failure path calls.

Besides ``write``, a caller that has its bytes elsewhere (``cloudckpt cp``: a ranged
read of the source) adds whole parts with :meth:`ObjectSink.add_part`, each filled in
the uploading thread; a resumed copy continues an open upload (``upload=``), adopts the
parts already stored (:meth:`adopt_part`), hears of each new one (``on_part``), and on
failure keeps the upload open for the next try (``abort(keep_upload=True)``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from .._runtime.memview import buffer_address, views_on
from ..errors import StorageError
from ..options import MAX_PART_SIZE, MAX_PARTS, MiB, TransferOptions
from ..store import MultipartUpload, Store, UploadedPart, byte_view
from .buffers import SaveBuffers
from .scheduler import TransferGroup, get_scheduler, run_cleanup

__all__ = [
    "BORROW_MIN",
    "MIN_SHRUNK_PART",
    "BorrowingSink",
    "BorrowingWriter",
    "ObjectSink",
    "choose_part_size",
]

log = logging.getLogger("cloudckpt")


#: Storages at least this large are sent from their own memory by a borrowing save;
#: smaller ones are copied (a part made of many tiny views costs more than the copy).
BORROW_MIN = 64 * 1024
#: Parts are not shrunk below this: smaller requests cost more per byte than they gain.
MIN_SHRUNK_PART = 8 * MiB


def choose_part_size(size_hint: int, part_size: int, streams: int = 1) -> int:
    """The part size for an object of about ``size_hint`` bytes.

    ``part_size``, grown (in whole MiB) so the object fits in ``MAX_PARTS`` parts, or
    shrunk (not below ``MIN_SHRUNK_PART``) so that it spreads over all ``streams``
    upload streams instead of leaving most of them idle.
    """
    if size_hint <= 0:
        return part_size
    # Leave headroom for archive overhead and an imprecise hint.
    padded = size_hint * 1.05
    needed = math.ceil(padded / (MAX_PARTS - 100))
    if needed > part_size:
        return min(math.ceil(needed / MiB) * MiB, MAX_PART_SIZE)
    if streams > 1 and padded < streams * part_size:
        spread = max(math.ceil(padded / streams / MiB) * MiB, MIN_SHRUNK_PART)
        return min(spread, part_size)
    return part_size


class ObjectSink:
    """File-like target for ``torch.save`` that streams into a multipart upload."""

    def __init__(
        self,
        store: Store,
        key: str,
        options: TransferOptions,
        *,
        size_hint: int = 0,
        on_progress: Callable[[int], None] | None = None,
        upload: MultipartUpload | None = None,
        on_part: Callable[[UploadedPart], None] | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.options = options
        self.part_size = choose_part_size(size_hint, options.part_size, options.write_concurrency)
        self._pool = SaveBuffers(options.write_concurrency, self.part_size)
        self._budget = get_scheduler().set_budget(options.max_bytes_in_flight)
        self._group = TransferGroup(options, options.write_concurrency, deadline=options.deadline)
        self._buf: bytearray | None = None
        self._fill = 0
        self._offset = 0  # bytes handed to parts so far
        self._parts: list[UploadedPart] = []
        self._parts_lock = threading.Lock()
        self._upload: MultipartUpload | None = upload
        self._next_part = 1
        self._on_progress = on_progress
        self._on_part = on_part
        self._closed = False
        self.bytes_written = 0
        #: The ETag the store gave the object once committed (None: none given, or not yet).
        self.etag: str | None = None
        #: The failure that stopped writing; torch.save may wrap it, save() re-raises it.
        self.error: BaseException | None = None

    # -- file protocol used by torch.save ------------------------------------------------
    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._guarded(self._write, data)

    def _guarded(self, write: Callable[[memoryview], int], data: Any) -> int:
        """Run one write; the first failure is kept in ``error`` and later writes ignored."""
        if self.error is not None:
            # torch.save writes its end-of-archive record while unwinding; swallow it.
            return len(memoryview(data).cast("B"))
        if self._closed:
            raise ValueError("write to a closed checkpoint sink")
        try:
            return write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        pos = 0
        while pos < total:
            if self._buf is None:
                self._buf = self._acquire_buffer()
                self._fill = 0
            n = min(total - pos, len(self._buf) - self._fill)
            self._buf[self._fill : self._fill + n] = view[pos : pos + n]
            self._fill += n
            pos += n
            if self._fill == len(self._buf):
                self._flush_part()
        self.bytes_written += total
        return total

    def flush(self) -> None:
        """Parts leave on their own schedule; there is nothing to flush early."""

    def tell(self) -> int:
        return self.bytes_written

    # -- parts -----------------------------------------------------------------------------
    def _check_part_count(self) -> None:
        # The part size was grown from the size hint; only a far larger stream gets here.
        if self._next_part > MAX_PARTS:
            raise StorageError(
                f"{self.store.url(self.key)}: the archive needs more than {MAX_PARTS} parts of "
                f"{self.part_size} bytes; pass a larger part_size"
            )

    def _acquire_buffer(self) -> bytearray:
        self._check_part_count()
        buf = self._pool.acquire(self._group.raise_if_failed)
        self._budget.acquire(len(buf), self._group.cancel_event)
        return buf

    def _release_buffer(self, buf: bytearray) -> None:
        self._budget.release(len(buf))
        self._pool.release(buf)

    def _flush_part(self) -> None:
        buf, size = self._buf, self._fill
        assert buf is not None
        self._buf = None
        self._send_part([memoryview(buf)[:size]], size, lambda: self._release_buffer(buf))

    def add_part(self, size: int, fill: Callable[[memoryview], None]) -> None:
        """Add the next part: ``size`` bytes (``part_size`` but for the last part) that
        ``fill`` writes into a part buffer, in the thread that then uploads it."""
        if size > self.part_size or size < 1:
            raise ValueError(f"a part of {size} bytes does not fit parts of {self.part_size}")
        buf = self._acquire_buffer()
        view = memoryview(buf)[:size]
        self._send_part([view], size, lambda: self._release_buffer(buf), fill=fill)
        self.bytes_written += size

    def adopt_part(self, part: UploadedPart) -> None:
        """Count ``part``, stored earlier in the open upload, as the next part."""
        if self._upload is None or part.number != self._next_part:
            raise ValueError(f"part {part.number} is not the next part of an open upload")
        with self._parts_lock:
            self._parts.append(part)
        self._next_part += 1
        self._offset += part.size
        self.bytes_written += part.size

    def _send_part(
        self,
        views: list[memoryview],
        size: int,
        release: Callable[[], None],
        fill: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Upload ``views`` (``size`` bytes, back to back) as the next part; ``release``
        runs once the part is stored or abandoned. ``fill`` first writes the one view,
        in the uploading thread."""
        offset = self._offset
        self._offset += size
        if self._upload is None:
            url = self.store.url(self.key)
            self._upload = self._group.call(
                lambda: self.store.create_multipart(self.key), f"create the upload of {url}"
            )
        upload = self._upload
        number = self._next_part
        self._next_part += 1

        def send() -> None:
            if fill is not None:
                fill(views[0])
            if len(views) == 1:
                part = self.store.upload_part(upload, number, views[0], offset)
            else:
                part = self.store.upload_part_views(upload, number, views, offset)
            with self._parts_lock:
                self._parts.append(part)
            if self._on_part is not None:
                self._on_part(part)
            if self._on_progress is not None:
                self._on_progress(size)

        self._group.submit(
            send, f"upload part {number} of {self.store.url(self.key)}", on_done=release
        )

    # -- commit / abort --------------------------------------------------------------------
    def commit(self) -> int:
        """Store the last bytes and make the object visible; returns its size."""
        self._closed = True
        if self._upload is None:
            data = memoryview(self._buf)[: self._fill] if self._buf is not None else b""
            self._last_request(lambda: self._made(self.store.put(self.key, data)), "put")
            if self._buf is not None:
                self._release_buffer(self._buf)
                self._buf = None
            if self._on_progress is not None:
                self._on_progress(self._fill)
            return self.bytes_written
        if self._buf is not None and self._fill:
            self._flush_part()
        elif self._buf is not None:
            self._release_buffer(self._buf)
            self._buf = None
        self._group.wait()
        parts = sorted(self._parts, key=lambda p: p.number)
        upload = self._upload
        self._last_request(
            lambda: self._made(self.store.complete_multipart(upload, parts)), "complete"
        )
        return self.bytes_written

    def _made(self, etag: str | None) -> None:
        """Note the ETag the store gave the object this sink made (None: none given)."""
        self.etag = etag

    def _last_request(self, request: Callable[[], None], what: str) -> None:
        """The request that makes the object visible, run in the group: the deadline
        bounds it as it bounds the parts."""
        self._group.call(request, f"{what} {self.store.url(self.key)}")

    def abort_after(self, exc: BaseException) -> BaseException:
        """Abort once ``exc`` stopped the write; return the error worth raising: this
        sink's own failure when ``torch.save`` wrapped it while unwinding, else ``exc``.
        A failing abort is logged, not raised: the original failure matters more."""
        try:
            self.abort()
        except Exception as abort_exc:
            log.warning("aborting the upload of %s also failed: %s", self.key, abort_exc)
        if self.error is not None and self.error is not exc:
            return self.error
        return exc

    def abort(self, *, keep_upload: bool = False) -> None:
        """Discard everything stored so far; safe to call more than once. With
        ``keep_upload`` the parts stored stay in the open upload (a resumable copy)."""
        self._closed = True
        self._group.cancel()
        if self._buf is not None:
            self._release_buffer(self._buf)
            self._buf = None
        upload, self._upload = self._upload, None
        if upload is not None and not keep_upload:
            url = self.store.url(upload.key)
            run_cleanup(self.options, lambda: self.store.abort_multipart(upload), f"abort {url}")


class BorrowingSink(ObjectSink):
    """An :class:`ObjectSink` that sends large writes straight from the caller's memory.

    :meth:`write_borrowed` adds a view to the part being built instead of copying it
    into a part buffer; ``owner`` (the tensor the view is in) is kept referenced until
    the part is stored or abandoned, and the caller must not change that memory until
    :meth:`commit` or :meth:`abort` returns. Other writes (zip headers, pickles: a few
    KiB per tensor) are copied into small buffers. A part is sent as a scatter list
    (``Store.upload_part_views``), so a save adds no part buffers and no copy of its
    tensors; parts may exceed ``part_size`` by less than one copied write. At most
    ``write_concurrency`` parts are in flight, and ``max_bytes_in_flight`` counts them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._views: list[memoryview] = []
        self._owners: list[object] = []
        self._small = bytearray()
        self._pending = 0  # bytes of the part being built

    def write_borrowed(self, data: memoryview, owner: object) -> int:
        """Add ``data`` to the object without copying it; ``owner`` keeps it alive."""
        return self._guarded(lambda d: self._borrow(d, owner), data)

    def _borrow(self, data: memoryview, owner: object) -> int:
        view = byte_view(data)
        self._seal_small()
        pos = 0
        while pos < len(view):
            take = min(len(view) - pos, self.part_size - self._pending)
            self._views.append(view[pos : pos + take])
            self._owners.append(owner)
            self._pending += take
            pos += take
            if self._pending >= self.part_size:
                self._cut()
        self.bytes_written += len(view)
        return len(view)

    def _write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._small += view
        self._pending += len(view)
        self.bytes_written += len(view)
        if self._pending >= self.part_size:
            self._cut()
        return len(view)

    def _seal_small(self) -> None:
        if self._small:  # the view pins the bytearray's size; a new one takes the next writes
            self._views.append(memoryview(self._small))
            self._small = bytearray()

    def _cut(self) -> None:
        """Send everything built so far as one part."""
        self._check_part_count()
        self._seal_small()
        views, owners, size = self._views, self._owners, self._pending
        self._views, self._owners, self._pending = [], [], 0
        self._budget.acquire(size, self._group.cancel_event)

        def release() -> None:
            owners.clear()
            views.clear()
            self._budget.release(size)

        self._send_part(views, size, release)

    def commit(self) -> int:
        """Store the last bytes and make the object visible; returns its size."""
        self._closed = True
        if self._upload is None:  # smaller than one part: one PUT of the joined bytes
            self._seal_small()
            data = b"".join(self._views)
            self._views, self._owners, self._pending = [], [], 0
            self._last_request(lambda: self._made(self.store.put(self.key, data)), "put")
            if self._on_progress is not None:
                self._on_progress(len(data))
            return self.bytes_written
        if self._pending:
            self._cut()
        return super().commit()

    def abort(self, *, keep_upload: bool = False) -> None:
        """Discard everything stored so far (and drop the borrowed views)."""
        self._views, self._owners, self._small, self._pending = [], [], bytearray(), 0
        super().abort(keep_upload=keep_upload)


class BorrowingWriter:
    """The file ``torch.save`` writes to when the storages it will write are known.

    A write of one of ``storages`` (same address, same size: torch writes a storage's
    bytes in one call) goes to :meth:`BorrowingSink.write_borrowed` with the storage as
    its owner; everything else is copied. ``storages`` maps address to
    ``(nbytes, storage)`` (:func:`cloudckpt.format.torch.tensors.scan_storages`). A write's
    address is known through a fast path (_runtime/memview.py): with it off, every
    write is copied.
    """

    def __init__(self, sink: BorrowingSink, storages: dict[int, tuple[int, Any]]) -> None:
        self.sink = sink
        self.storages = storages if views_on() else {}
        self._smallest = min((n for n, _ in self.storages.values()), default=0)

    def write(self, data: Any) -> int:
        view = byte_view(data)
        if self._smallest and view.nbytes >= self._smallest:
            hit = self.storages.get(buffer_address(view))
            if hit is not None and hit[0] == view.nbytes:
                return self.sink.write_borrowed(view, hit[1])
        return self.sink.write(view)

    def flush(self) -> None:
        """Parts leave on their own schedule; there is nothing to flush early."""

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.sink.tell()

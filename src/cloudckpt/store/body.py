"""Reading an HTTP answer's body straight into caller buffers, shared by the HTTP stores.

:func:`body_skip` decides what a ranged answer of the wrong length means (the same rule
for S3, GCS and Azure); :func:`read_body_into` fills the caller's buffers from the
socket without an intermediate copy where the body is identity-encoded, and bounds the
whole read: a body that trickles in (each byte resetting the stall timer) is cut once it
runs past its stall timeout plus its size at :data:`MIN_BYTES_PER_SECOND`, and retried
(docs/configuration.md, ``request_timeout``).
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from urllib3.exceptions import HTTPError as URLLib3Error

from ..errors import CorruptCheckpointError, TransientError
from ..redact import redact_text
from .base import byte_view

__all__ = ["MIN_BYTES_PER_SECOND", "body_skip", "content_range_total", "read_body_into"]

#: The slowest a body may arrive on average: a read of ``n`` bytes is cut (its connection
#: shut, the request retried) once it has taken its stall timeout plus ``n`` bytes at this
#: rate. Far below any working link (a 64 MiB part gets 1024 s more), so only a stalled
#: or trickling server meets it; a bound on the whole transfer that a slow link would meet
#: is left to ``deadline``.
MIN_BYTES_PER_SECOND = 64 * 1024


def content_range_total(value: str | None) -> int | None:
    """The object size in a ``Content-Range: bytes a-b/total`` header, if given."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


def body_skip(url: str, start: int, length: int, got: int, total: int | None) -> int:
    """Leading bytes of an answer to drop before ``[start, start + length)`` begins.

    ``got`` is the answer's length, ``total`` the object's size where the answer says
    it. Some servers ignore the range and send the whole object (no total): take our
    slice of it. An object that ends before the range is corrupt (truncated); any other
    short answer is a glitch, retried as a :class:`~cloudckpt.errors.TransientError`.
    """
    if got == length:
        return 0
    if total is None and got >= start + length:
        return start
    size = total if total is not None else got
    if size < start + length:
        raise CorruptCheckpointError(
            f"{url} ends at byte {size}, before the range {start}-{start + length - 1} being read"
        )
    raise TransientError(
        f"reading {url}: asked for {length} bytes at {start}, the answer holds {got}"
    )


def read_body_into(
    stream: Any,
    skip: int,
    buffers: Sequence[memoryview],
    url: str,
    *,
    stall: float | None = None,
) -> None:
    """Read a urllib3 response body into ``buffers`` after dropping ``skip`` bytes.

    urllib3's own ``readinto`` reads into a temporary and copies; for an identity-encoded
    body we read from the underlying ``http.client`` response, which fills our memory
    straight from the socket. Other encodings take the copying path. A body cut short
    is a :class:`~cloudckpt.errors.TransientError`. With ``stall`` (the request's stall
    timeout), the whole read is bounded by ``stall`` plus its bytes at
    :data:`MIN_BYTES_PER_SECOND`: past it the connection is shut and the read fails as
    a :class:`~cloudckpt.errors.TransientError` (retried).
    """
    sock = _socket_of(stream) if stall is not None else None
    limit = 0.0
    token = None
    if sock is not None and stall is not None:
        total = skip + sum(byte_view(b).nbytes for b in buffers)
        limit = stall + total / MIN_BYTES_PER_SECOND
        token = _watchdog().watch(sock, limit)
    try:
        _fill(stream, skip, buffers, url)
    except (http.client.HTTPException, URLLib3Error, OSError, TransientError) as exc:
        stream.close()  # the connection is unusable
        cut, token = token is not None and _watchdog().done(token), None
        if cut:
            raise TransientError(
                f"reading {url}: the body did not arrive within {limit:.0f} s (its stall "
                f"timeout, and its size at {MIN_BYTES_PER_SECOND // 1024} KiB/s); cut"
            ) from None
        if isinstance(exc, TransientError):
            raise
        raise TransientError(
            f"reading {url}: {type(exc).__name__}: {redact_text(str(exc))}"
        ) from None
    finally:
        if token is not None:
            _watchdog().done(token)


def _socket_of(stream: Any) -> socket.socket | None:
    """The socket a urllib3 response reads from (None if it cannot be found)."""
    conn = getattr(stream, "connection", None) or getattr(stream, "_connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        return sock
    raw = getattr(getattr(getattr(stream, "_fp", None), "fp", None), "raw", None)
    sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


class _Watchdog:
    """One thread that shuts the sockets of body reads past their bound: the blocked
    read then ends (a cut body), with no thread abandoned and no buffer written later."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, socket.socket] = {}
        self._fired: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, seconds: float) -> int:
        with self._cond:
            token = next(self._ids)
            self._live[token] = sock
            heapq.heappush(self._heap, (time.monotonic() + seconds, token))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="cloudckpt-body-watchdog", daemon=True
                )
                self._thread.start()
            elif self._heap[0][1] == token:
                self._cond.notify()
            return token

    def done(self, token: int) -> bool:
        """Stop watching ``token``; whether its socket was shut for running past it."""
        with self._cond:
            self._live.pop(token, None)
            fired = token in self._fired
            self._fired.discard(token)
            return fired

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                expires, token = self._heap[0]
                wait = expires - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                sock = self._live.pop(token)
                self._fired.add(token)
            with contextlib.suppress(OSError):  # closed meanwhile: nothing to cut
                sock.shutdown(socket.SHUT_RDWR)


_dog: _Watchdog | None = None
_dog_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    global _dog
    if _dog is None:
        with _dog_lock:
            if _dog is None:
                _dog = _Watchdog()
    return _dog


def _reset_after_fork() -> None:
    global _dog, _dog_lock
    _dog, _dog_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _fill(stream: Any, skip: int, buffers: Sequence[memoryview], url: str) -> None:
    fp = getattr(stream, "_fp", None)
    encoding = (getattr(stream, "headers", None) or {}).get("content-encoding", "identity")
    direct = fp is not None and hasattr(fp, "readinto") and encoding in ("identity", "")
    remaining = skip
    while remaining:
        chunk = stream.read(min(remaining, 1 << 20))
        if not chunk:
            raise TransientError(f"reading {url}: connection closed mid-body")
        remaining -= len(chunk)
    for buf in buffers:
        view = byte_view(buf)
        filled = 0
        while filled < len(view):
            if direct and fp is not None:
                n = fp.readinto(view[filled:])
            else:
                chunk = stream.read(len(view) - filled)
                n = len(chunk)
                view[filled : filled + n] = chunk
            if not n:
                raise TransientError(f"reading {url}: connection closed mid-body")
            filled += n
    if skip:
        stream.close()  # the rest of a whole-object answer is not wanted: drop the connection
    elif direct and hasattr(stream, "release_conn"):
        stream.release_conn()  # the body was read to its end: the connection can be reused

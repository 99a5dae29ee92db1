"""Reading an HTTP answer's body straight into caller buffers, shared by the HTTP stores.

:func:`body_skip` decides what a ranged answer of the wrong length means (the same rule
for S3, GCS and Azure); :func:`read_body_into` fills the caller's buffers from the
socket without an intermediate copy where the body is identity-encoded.
"""

from __future__ import annotations

import http.client
from collections.abc import Sequence
from typing import Any

from urllib3.exceptions import HTTPError as URLLib3Error

from ..errors import CorruptCheckpointError, TransientError
from ..redact import redact_text
from .base import byte_view

__all__ = ["body_skip", "content_range_total", "read_body_into"]


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


def read_body_into(stream: Any, skip: int, buffers: Sequence[memoryview], url: str) -> None:
    """Read a urllib3 response body into ``buffers`` after dropping ``skip`` bytes.

    urllib3's own ``readinto`` reads into a temporary and copies; for an identity-encoded
    body we read from the underlying ``http.client`` response, which fills our memory
    straight from the socket. Other encodings take the copying path. A body cut short
    is a :class:`~cloudckpt.errors.TransientError`.
    """
    try:
        _fill(stream, skip, buffers, url)
    except (http.client.HTTPException, URLLib3Error, ConnectionError, TimeoutError) as exc:
        stream.close()  # the connection is unusable
        raise TransientError(
            f"reading {url}: {type(exc).__name__}: {redact_text(str(exc))}"
        ) from None


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

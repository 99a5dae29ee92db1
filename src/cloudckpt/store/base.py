"""The one interface every backend implements: object put/get/list/delete and multipart.

Call order for a streamed write (the engine follows it, backends may rely on it)::

    upload = store.create_multipart(key)
    store.upload_part(upload, 1, data, offset=0)          # any order, concurrently
    store.upload_part(upload, 2, data, offset=len(part1))
    store.complete_multipart(upload, parts)               # object appears atomically
    # or, on any failure:
    store.abort_multipart(upload)                         # nothing becomes visible

Parts are contiguous: part ``n`` starts where part ``n - 1`` ended, and ``offset``
says where (object stores ignore it; the filesystem writes there). Every part but
the last is at least 5 MiB.

Errors: backends raise the typed errors of :mod:`cloudckpt.errors`, naming the URL;
:class:`~cloudckpt.errors.TransientError` for faults worth retrying. Retrying is the
scheduler's job, not the backend's.
"""

from __future__ import annotations

import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidURLError

__all__ = [
    "MultipartUpload",
    "ObjectInfo",
    "Store",
    "UploadedPart",
    "byte_view",
    "check_key",
    "join_key",
]

Buffer = bytes | bytearray | memoryview


def byte_view(data: Buffer) -> memoryview:
    """A flat byte view of ``data`` without a copy (``len`` is then its size in bytes)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass(frozen=True)
class ObjectInfo:
    """What a head or list returns for one object."""

    key: str
    size: int
    mtime: float | None = None  # seconds since the epoch
    etag: str | None = None


@dataclass
class MultipartUpload:
    """An open multipart upload; ``backend`` is an opaque slot for the store's own data."""

    key: str
    upload_id: str
    initiated: float | None = None
    backend: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class UploadedPart:
    """One part stored by ``upload_part``; passed back to ``complete_multipart``."""

    number: int
    etag: str
    size: int


def check_key(key: str, url: str) -> str:
    """Refuse keys that could escape their prefix: absolute, ``..``, empty or NUL parts."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidURLError(f"refusing unsafe object key {key!r} under {url}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise InvalidURLError(f"refusing unsafe object key {key!r} under {url}")
    return key


def join_key(prefix: str, relative: str, url: str = "") -> str:
    """Join a prefix and a relative key, refusing any relative key that escapes it."""
    check_key(relative, url or prefix)
    joined = posixpath.join(prefix, relative) if prefix else relative
    return joined


class Store(ABC):
    """A bucket (or a filesystem root) addressed by keys with ``/`` separators."""

    #: URL of the store's root, e.g. ``s3://bucket``; used in messages.
    root_url: str

    def url(self, key: str) -> str:
        """The user-facing URL of ``key``."""
        return f"{self.root_url.rstrip('/')}/{key}"

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and metadata of one object; NotFoundError if absent."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object."""

    @abstractmethod
    def read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order from the bytes starting at ``start`` (a scatter read)."""

    @abstractmethod
    def put(self, key: str, data: Buffer, *, if_none_match: bool = False) -> None:
        """Store ``data`` at ``key`` atomically; with ``if_none_match`` only if absent."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; absent objects are not an error."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, recursively, in key order."""

    @abstractmethod
    def create_multipart(self, key: str) -> MultipartUpload:
        """Open a multipart upload to ``key``; nothing is visible until completed."""

    @abstractmethod
    def upload_part(
        self, upload: MultipartUpload, number: int, data: Buffer, offset: int
    ) -> UploadedPart:
        """Store part ``number`` (1-based) of ``upload``."""

    def upload_part_views(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        """Store part ``number`` made of ``views`` back to back (a scatter list).

        This default joins them (one copy); stores that can send a scatter list as it
        is override it.
        """
        return self.upload_part(upload, number, b"".join(views), offset)

    @abstractmethod
    def complete_multipart(self, upload: MultipartUpload, parts: Sequence[UploadedPart]) -> None:
        """Make the object visible, made of ``parts`` in order."""

    @abstractmethod
    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Discard an upload and every part stored for it."""

    @abstractmethod
    def list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        """Open (never completed or aborted) uploads under ``prefix``."""

    def get(self, key: str) -> bytes:
        """A whole object."""
        info = self.head(key)
        return self.get_range(key, 0, info.size) if info.size else b""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store may not be used afterwards."""

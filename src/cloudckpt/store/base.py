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

Every public method does the same four things, here and nowhere else: check the key
(no ``..``, no absolute keys), retry with the store's :class:`~.retry.RetryPolicy`
(transient faults, backoff, the per-prefix rate limit), map a backend failure to the
typed errors of :mod:`cloudckpt.errors` naming the URL, and call one backend primitive
(``_head``, ``_read_into``, ``_put``...). A backend implements only the primitives: each
makes one attempt and raises a typed error (``TransientError`` for faults worth
retrying) or lets its SDK's exception reach :meth:`Store._map_error`. Callers never
retry by hand. docs/architecture.md shows how to add a backend.
"""

from __future__ import annotations

import copy
import posixpath
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import (
    CloudCkptError,
    ConfigError,
    CredentialsError,
    InvalidURLError,
    TransientError,
)
from ..redact import display_url, redact_text
from .retry import Cancelled, RetryPolicy

__all__ = [
    "MultipartUpload",
    "ObjectInfo",
    "Store",
    "UploadedPart",
    "byte_view",
    "check_key",
    "check_storage_options",
    "join_key",
]

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")
#: One page of a listing and the token of the next (``None`` after the last page).
Page = tuple[Sequence["ObjectInfo"], Any]


#: Cache keys of stores whose credentials failed: the next open makes the store again
#: (``cloudckpt.store.open_url``), so what it took from the environment, a profile or
#: the SDKs' credential files is read again.
STALE: set[Any] = set()


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
        raise InvalidURLError(f"refusing unsafe object key {key!r} under {display_url(url)}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise InvalidURLError(f"refusing unsafe object key {key!r} under {display_url(url)}")
    return key


def check_storage_options(
    backend: str, given: Mapping[str, Any], valid: frozenset[str]
) -> dict[str, Any]:
    """``given`` as a dict, or a ConfigError naming the options ``backend`` does not take."""
    unknown = sorted(set(given) - valid)
    if unknown:
        raise ConfigError(
            f"unknown {backend} storage option(s) {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(valid))}"
        )
    return dict(given)


def join_key(prefix: str, relative: str, url: str = "") -> str:
    """Join a prefix and a relative key, refusing any relative key that escapes it."""
    check_key(relative, url or prefix)
    joined = posixpath.join(prefix, relative) if prefix else relative
    return joined


def _transport(exc: Exception) -> bool:
    """Whether ``exc`` is a failure of the connection itself (reset, refused, timed out,
    an answer cut short), whatever HTTP stack raised it: retried as a
    :class:`~cloudckpt.errors.TransientError`. The stacks' modules are looked up, not
    imported: one not loaded raised nothing (a local store's command loads neither)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    for module, name in (("http.client", "HTTPException"), ("urllib3.exceptions", "HTTPError")):
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type) and isinstance(exc, found):
            return True
    return False


#: The requests whose answers are small (no data): each attempt is bounded in all.
_SMALL_OPS = frozenset(
    {
        "head",
        "list",
        "delete",
        "create multipart upload",
        "abort multipart upload",
        "list multipart uploads",
    }
)


class Store(ABC):
    """A bucket (or a filesystem root) addressed by keys with ``/`` separators.

    The public methods are the contract every caller uses; subclasses implement the
    ``_primitives`` below them (one attempt each) and may override :meth:`_map_error`.
    """

    #: URL of the store's root, e.g. ``s3://bucket``; used in messages.
    root_url: str
    #: How failed requests are retried; :meth:`with_retry` gives a copy with another.
    retry: RetryPolicy = RetryPolicy()
    #: The process cache's key for this store (``cloudckpt.store.open_url``), if cached.
    cache_key: Any = None
    #: Each attempt of a small request is bounded in all (``RetryPolicy``'s
    #: ``small_attempt_seconds``): the network stores, whose servers may trickle answers.
    bound_small_requests: bool = False

    def url(self, key: str) -> str:
        """The user-facing URL of ``key``."""
        return f"{self.root_url.rstrip('/')}/{key}"

    def __repr__(self) -> str:
        """The class and root URL only: clients, sessions and credentials stay out of it."""
        return f"{type(self).__name__}({display_url(self.root_url)!r})"

    def follow_environment(self) -> None:  # noqa: B027 - optional hook
        """Make what the store took from the environment again now if the variables it
        reads changed since: a fresh open of a cached store calls it (``open_url``), so
        it never serves settings the environment no longer has (a held copy of the
        store may have followed other values meanwhile)."""

    def with_retry(self, policy: RetryPolicy) -> Store:
        """This store (same connections) retrying by ``policy``."""
        if policy == self.retry:
            return self
        clone = copy.copy(self)
        clone.retry = policy
        return clone

    # -- the one path every request takes ---------------------------------------------------
    def _map_error(self, exc: Exception, key: str | None, op: str) -> Exception:
        """A backend failure as a typed error naming the URL (``exc`` itself if unknown).

        This default knows only the builtin network errors; HTTP backends map their
        SDK's exceptions through :func:`cloudckpt.store.status.error_for`.
        """
        if _transport(exc):
            where = self.url(key) if key is not None else self.root_url
            return TransientError(f"{op} {where}: {type(exc).__name__}: {redact_text(str(exc))}")
        return exc

    def _attempt(self, op: str, key: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except (CloudCkptError, Cancelled):
            raise
        except Exception as exc:
            mapped = self._map_error(exc, key, op)
            if mapped is exc and _transport(exc):
                # A transport failure the backend's mapping missed: still retried, and
                # named, never the HTTP stack's own exception.
                mapped = Store._map_error(self, exc, key, op)
            if mapped is exc:
                raise
            raise mapped from None

    def _retrying(self, op: str, key: str, fn: Callable[..., T], *args: Any) -> T:
        """Run one primitive under the retry policy, its failures mapped to typed errors.

        After a credentials failure the store is not handed out again by the cache
        (``cloudckpt.store.open_url``): the next open resolves its settings anew."""
        scope = f"{self.root_url}|{key.rpartition('/')[0]}"
        small = self.bound_small_requests and op in _SMALL_OPS
        try:
            return self.retry.run(
                lambda: self._attempt(op, key, fn, *args),
                f"{op} {self.url(key)}",
                scope=scope,
                small=small,
            )
        except CredentialsError:
            if self.cache_key is not None:
                STALE.add(self.cache_key)
            raise

    # -- the contract -----------------------------------------------------------------------
    def head(self, key: str) -> ObjectInfo:
        """Size and metadata of one object; NotFoundError if absent."""
        check_key(key, self.root_url)
        return self._retrying("head", key, self._head, key)

    def get(self, key: str) -> bytes:
        """A whole object (small ones: manifests, markers)."""
        check_key(key, self.root_url)
        return self._retrying("read", key, self._get, key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object."""
        check_key(key, self.root_url)
        return self._retrying("read", key, self._get_range, key, start, end)

    def read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order from the bytes starting at ``start`` (a scatter read)."""
        check_key(key, self.root_url)
        views = [byte_view(b) for b in buffers]
        if sum(v.nbytes for v in views):
            self._retrying("read", key, self._read_into, key, start, views)

    def put(self, key: str, data: Buffer, *, if_none_match: bool = False) -> str | None:
        """Store ``data`` at ``key`` atomically; with ``if_none_match`` only if absent.
        Returns the new object's ETag, unquoted, as listings give it (None: the store
        gives none): what tells this write's object from another write of the key."""
        check_key(key, self.root_url)
        return self._retrying("put", key, self._put, key, byte_view(data), if_none_match)

    def delete(self, key: str) -> None:
        """Remove one object; absent objects are not an error."""
        check_key(key, self.root_url)
        self._retrying("delete", key, self._delete, key)

    def remove_prefix_dir(self, prefix: str) -> None:
        """After every object under ``prefix`` is deleted: drop what is left of the
        prefix itself. Nothing in an object store, where a prefix is only a name; the
        filesystem store removes the empty directory."""
        return None

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, recursively, in key order.

        Each page is one request, retried on its own.
        """
        token: Any = None
        while True:
            items, token = self._retrying("list", prefix, self._list_page, prefix, token)
            yield from items
            if token is None:
                return

    def create_multipart(self, key: str) -> MultipartUpload:
        """Open a multipart upload to ``key``; nothing is visible until completed."""
        check_key(key, self.root_url)
        return self._retrying("create multipart upload", key, self._create_multipart, key)

    def upload_part(
        self, upload: MultipartUpload, number: int, data: Buffer, offset: int
    ) -> UploadedPart:
        """Store part ``number`` (1-based) of ``upload``."""
        return self._retrying(
            f"upload part {number} of",
            upload.key,
            self._upload_part,
            upload,
            number,
            byte_view(data),
            offset,
        )

    def upload_part_views(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        """Store part ``number`` made of ``views`` back to back (a scatter list)."""
        flat = [byte_view(v) for v in views]
        return self._retrying(
            f"upload part {number} of",
            upload.key,
            self._upload_part_views,
            upload,
            number,
            flat,
            offset,
        )

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[UploadedPart]
    ) -> str | None:
        """Make the object visible, made of ``parts`` in order; returns its ETag as
        :meth:`put` does (None also when a retry found the first attempt had completed)."""
        return self._retrying(
            "complete multipart upload", upload.key, self._complete_multipart, upload, parts
        )

    def abort_multipart(self, upload: MultipartUpload) -> None:
        """Discard an upload and every part stored for it."""
        self._retrying("abort multipart upload", upload.key, self._abort_multipart, upload)

    def list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        """Open (never completed or aborted) uploads under ``prefix``."""
        yield from self._retrying(
            "list multipart uploads", prefix, lambda: list(self._list_multipart(prefix))
        )

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store may not be used afterwards."""

    # -- backend primitives: one attempt each, keys already checked --------------------------
    @abstractmethod
    def _head(self, key: str) -> ObjectInfo: ...

    def _get(self, key: str) -> bytes:
        """Default: HEAD, then one ranged read of the whole object."""
        size = self._head(key).size
        return self._get_range(key, 0, size) if size else b""

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        """Default: a scatter read into one new buffer."""
        buf = bytearray(end - start)
        if buf:
            self._read_into(key, start, [memoryview(buf)])
        return bytes(buf)

    @abstractmethod
    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        """Fill flat byte ``buffers`` (at least one byte in all) from ``start``."""

    @abstractmethod
    def _put(self, key: str, data: memoryview, if_none_match: bool) -> str | None:
        """Store ``data``; the new object's ETag, unquoted (None: the store gives none)."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove ``key``; an absent object is success."""

    @abstractmethod
    def _list_page(self, prefix: str, token: Any) -> Page:
        """One page of the listing under ``prefix`` from ``token`` (``None``: the first)."""

    def _list_all(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every page of a listing, for primitives that need one (no retries of their own)."""
        token: Any = None
        while True:
            items, token = self._list_page(prefix, token)
            yield from items
            if token is None:
                return

    @abstractmethod
    def _create_multipart(self, key: str) -> MultipartUpload: ...

    @abstractmethod
    def _upload_part(
        self, upload: MultipartUpload, number: int, data: memoryview, offset: int
    ) -> UploadedPart: ...

    def _upload_part_views(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        """Default: join the views (one copy); stores that send a scatter list override it."""
        return self._upload_part(upload, number, memoryview(b"".join(views)), offset)

    @abstractmethod
    def _complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[UploadedPart]
    ) -> str | None:
        """Complete ``upload``; the new object's ETag, unquoted, as :meth:`_put`."""

    @abstractmethod
    def _abort_multipart(self, upload: MultipartUpload) -> None:
        """Discard ``upload``; one already gone is success."""

    @abstractmethod
    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]: ...

"""A read-only view of one checkpoint held in two places: a local copy and a bucket.

A manager's local tier may hold only some of a step's files (each node keeps the files
its own ranks wrote, plus the coordinator's), while a load asks for whatever its plan
needs (another node's files when the world size changed, or a tensor only the
coordinator saved). :class:`OverlayStore` answers each key from the local copy when
that copy holds it (``held``: the names its local marker lists, checked whole), then
from a peer's copy of the same step kept in that directory, and otherwise from the
bucket's committed copy of the same step: a drain copies the files
unchanged, so both hold the same bytes. It counts what the bucket served.

Each tier's own store checks, retries and maps its requests; the view adds a single
attempt around them (retrying it again would multiply the tiers' retries).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..errors import ConfigError, NotFoundError
from .base import MultipartUpload, ObjectInfo, Page, Store, UploadedPart
from .retry import RetryPolicy

__all__ = ["OverlayStore"]


class OverlayStore(Store):
    """Keys are names relative to one step: those in ``held`` are read from ``local``
    under ``local_prefix``, then those ``also`` lists (other prefixes of ``local`` with
    the names each holds whole: the copies of a peer's step), any other from ``remote``
    under ``remote_prefix``. With no ``remote`` (the bucket lacks the step) a name no
    local copy holds is a NotFoundError naming it and ``what`` (the step), followed by
    ``hint``.

    Read-only: every write is refused with ConfigError.
    """

    retry = RetryPolicy(max_attempts=1)  # the tiers' stores retry their own requests

    def __init__(
        self,
        local: Store,
        local_prefix: str,
        held: Collection[str],
        remote: Store | None,
        remote_prefix: str,
        *,
        what: str,
        hint: str = "",
        also: Sequence[tuple[str, Collection[str]]] = (),
    ) -> None:
        self.local, self.local_prefix = local, local_prefix
        self.remote, self.remote_prefix = remote, remote_prefix
        self.held = frozenset(held)
        #: Names held by other local prefixes, each with the first prefix holding it.
        self.elsewhere: dict[str, str] = {}
        for prefix, names in also:
            for name in names:
                if name not in self.held:
                    self.elsewhere.setdefault(name, prefix)
        self.what, self.hint = what, hint
        self.root_url = local.url(local_prefix)
        self._lock = threading.Lock()
        self._remote_files: set[str] = set()
        self._remote_bytes = 0

    # -- where each key lives ------------------------------------------------------------
    def _where(self, key: str) -> tuple[Store, str]:
        """The store and key that serve ``key``; NotFoundError when neither tier can."""
        if key in self.held:
            return self.local, self.local_prefix + key
        if key in self.elsewhere:
            return self.local, self.elsewhere[key] + key
        if self.remote is None:
            raise NotFoundError(
                f"{key} of {self.what} is not in the local copy at "
                f"{self.local.url(self.local_prefix)}, and the bucket has no committed copy "
                f"of {self.what}" + (f"; {self.hint}" if self.hint else "")
            )
        return self.remote, self.remote_prefix + key

    def url(self, key: str) -> str:
        """The URL ``key`` is read from: its local file, or the bucket's object."""
        if key in self.elsewhere:
            return self.local.url(self.elsewhere[key] + key)
        if key in self.held or self.remote is None:
            return self.local.url(self.local_prefix + key)
        return self.remote.url(self.remote_prefix + key)

    def _count(self, key: str, nbytes: int) -> None:
        if key not in self.held and key not in self.elsewhere:
            with self._lock:
                self._remote_files.add(key)
                self._remote_bytes += nbytes

    @property
    def remote_reads(self) -> tuple[int, int]:
        """(files, bytes) the bucket has served so far."""
        with self._lock:
            return len(self._remote_files), self._remote_bytes

    # -- reads: one call of the serving tier's own store ---------------------------------
    def _head(self, key: str) -> ObjectInfo:
        store, inner = self._where(key)
        return replace(store.head(inner), key=key)

    def _get(self, key: str) -> bytes:
        store, inner = self._where(key)
        data = store.get(inner)
        self._count(key, len(data))
        return data

    def _get_range(self, key: str, start: int, end: int) -> bytes:
        store, inner = self._where(key)
        data = store.get_range(inner, start, end)
        self._count(key, len(data))
        return data

    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        store, inner = self._where(key)
        store.read_into(inner, start, buffers)
        self._count(key, sum(b.nbytes for b in buffers))

    def _list_page(self, prefix: str, token: Any) -> Page:
        """Every name under ``prefix`` in either tier (one page), the held ones local."""
        found = {
            o.key[len(self.local_prefix) :]: o
            for o in self.local.list(self.local_prefix + prefix)
            if o.key[len(self.local_prefix) :] in self.held
        }
        for name, where in self.elsewhere.items():
            if name.startswith(prefix) and name not in found:
                found[name] = self.local.head(where + name)
        if self.remote is not None:
            for o in self.remote.list(self.remote_prefix + prefix):
                found.setdefault(o.key[len(self.remote_prefix) :], o)
        return [replace(o, key=k) for k, o in sorted(found.items())], None

    # -- writes: refused -----------------------------------------------------------------
    def _refuse(self, key: str) -> ConfigError:
        return ConfigError(f"{self.url(key)} is read through a read-only view of {self.what}")

    def _put(self, key: str, data: memoryview, if_none_match: bool) -> None:
        raise self._refuse(key)

    def _delete(self, key: str) -> None:
        raise self._refuse(key)

    def _create_multipart(self, key: str) -> MultipartUpload:
        raise self._refuse(key)

    def _upload_part(
        self, upload: MultipartUpload, number: int, data: memoryview, offset: int
    ) -> UploadedPart:
        raise self._refuse(upload.key)

    def _complete_multipart(self, upload: MultipartUpload, parts: Sequence[UploadedPart]) -> None:
        raise self._refuse(upload.key)

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        raise self._refuse(upload.key)

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        return iter(())

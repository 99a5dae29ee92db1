"""Backends behind one :class:`Store` interface, chosen by URL scheme.

:func:`open_target` is the one place a URL and a call's settings (an options object,
keyword overrides, the profile the URL selects) become a store, a key and the options
in force. Stores are cached per process (and per set of storage options and connection
settings) so connections are reused across calls; each call gets a view of the cached
store that retries by its own options.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import InvalidURLError
from ..options import TransferOptions, resolve_options
from ..redact import dataclass_repr, display_url, redact_text
from .base import (
    MultipartUpload,
    ObjectInfo,
    Store,
    UploadedPart,
    byte_view,
    check_key,
    join_key,
)
from .registry import register_store, schemes, store_factory, unsupported
from .retry import RetryPolicy

__all__ = [
    "SUPPORTED_SCHEMES",
    "MultipartUpload",
    "ObjectInfo",
    "RetryPolicy",
    "Store",
    "Target",
    "UploadedPart",
    "byte_view",
    "check_key",
    "join_key",
    "open_target",
    "open_url",
    "register_store",
    "split_url",
]

PROFILE_SCHEME = "profile://"
#: The built-in schemes (third-party stores add theirs: cloudckpt.store.registry).
SUPPORTED_SCHEMES = ("file", "s3", "gs", "az", "abfs", "memory")

_cache: dict[tuple[Any, ...], Store] = {}
_cache_lock = threading.Lock()


def split_url(url: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a URL; plain paths become ``("file", "", abs_path)``."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidURLError(f"expected a URL or path string, got {redact_text(repr(url))}")
    if url.startswith(PROFILE_SCHEME):
        url = str(_profile_for(url).rewrite(url))
    if "://" not in url:
        return "file", "", os.path.abspath(os.path.expanduser(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    shown = display_url(url)  # messages never echo a query string (a SAS) or a password
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidURLError(f"file URLs must be local (file:///path): {shown}")
        return "file", "", os.path.abspath(unquote(parts.path))
    if scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise InvalidURLError(f"missing bucket name in {shown} (expected s3://bucket/key)")
        if parts.query or parts.fragment:
            raise _query_error(shown)
        return "s3", parts.netloc, parts.path.lstrip("/")
    if scheme in ("gs", "gcs", "az", "azure", "abfs", "abfss"):
        canonical = {"gcs": "gs", "azure": "az", "abfss": "abfs"}.get(scheme, scheme)
        if not parts.netloc:
            what = "bucket" if canonical == "gs" else "container"
            raise InvalidURLError(
                f"missing {what} name in {shown} (expected {canonical}://{what}/key)"
            )
        if parts.query or parts.fragment:
            raise _query_error(shown)
        netloc = parts.netloc
        if canonical == "abfs" and "@" in netloc:
            # abfs://container@account.dfs.core.windows.net/key: keep the account name.
            container, _, host = netloc.partition("@")
            netloc = f"{container}@{host.split('.', 1)[0]}"
        elif canonical == "abfs":
            canonical = "az"
        return canonical, netloc, parts.path.lstrip("/")
    if scheme in schemes():  # memory:// and third-party stores: scheme://bucket/key
        if not parts.netloc:
            raise InvalidURLError(
                f"missing bucket name in {shown} (expected {scheme}://bucket/key)"
            )
        return scheme, parts.netloc, parts.path.lstrip("/")
    raise unsupported(scheme, url)


def _query_error(shown: str) -> InvalidURLError:
    """A query or fragment in a store URL, named without it (it may hold a SAS token)."""
    return InvalidURLError(
        f"unexpected query or fragment in {shown}?... (credentials go in storage_options)"
    )


def _freeze(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


def _profile_for(url: str) -> Any:
    from ..profiles import find_profile

    return find_profile(url)


def open_url(url: str | os.PathLike[str], options: TransferOptions) -> tuple[Store, str]:
    """The (cached) store serving ``url`` with ``options``, and the key of ``url`` in it.

    ``options`` are taken as resolved (profiles applied): callers with a URL and a
    call's settings use :func:`open_target`, which resolves them once.
    """
    scheme, bucket, key = split_url(url)
    factory = store_factory(scheme)
    if factory is None:  # pragma: no cover - split_url refuses unknown schemes
        raise unsupported(scheme, str(url))
    if scheme == "file":
        bucket, key = "", key.lstrip("/")
    store_key = (
        os.getpid(),
        scheme,
        bucket,
        _freeze(options.storage_options),
        options.connect_timeout,
        options.request_timeout,
        options.connection_pool_size,
    )
    with _cache_lock:
        store = _cache.get(store_key)
    if store is None:
        made = factory(bucket, options)
        with _cache_lock:
            store = _cache.setdefault(store_key, made)
        if store is not made:
            made.close()
    return store.with_retry(RetryPolicy.from_options(options)), key


@dataclass(frozen=True)
class Target:
    """Where a URL lives: the store (retrying by ``options``), the key in it, the options."""

    url: str
    store: Store
    key: str
    options: TransferOptions

    def __repr__(self) -> str:
        """The dataclass repr with the options' secrets masked (cloudckpt.redact)."""
        return dataclass_repr(self)


def open_target(
    url: str | os.PathLike[str], options: TransferOptions | None = None, **overrides: Any
) -> Target:
    """Resolve a call's settings for ``url`` and open its store: the one place that does.

    Precedence: keyword ``overrides`` > ``options`` > the profile ``url`` selects >
    :func:`cloudckpt.configure` (see :func:`cloudckpt.options.resolve_options`).
    """
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    resolved = resolve_options(options, url=text, **overrides)
    store, key = open_url(text, resolved)
    return Target(str(text), store, key, resolved)

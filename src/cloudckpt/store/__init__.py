"""Backends behind one :class:`Store` interface, chosen by URL scheme.

``open_url(url)`` returns the store and the key inside it. Stores are cached per
process (and per set of storage options) so connections are reused across calls.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import InvalidURLError
from ..options import TransferOptions
from .base import (
    MultipartUpload,
    ObjectInfo,
    Store,
    UploadedPart,
    byte_view,
    check_key,
    join_key,
)

__all__ = [
    "SUPPORTED_SCHEMES",
    "MultipartUpload",
    "ObjectInfo",
    "Store",
    "UploadedPart",
    "byte_view",
    "check_key",
    "join_key",
    "open_url",
    "split_url",
]

PROFILE_SCHEME = "profile://"
SUPPORTED_SCHEMES = ("file", "s3", "gs", "az", "abfs")

_cache: dict[tuple[Any, ...], Store] = {}
_cache_lock = threading.Lock()


def split_url(url: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a URL; plain paths become ``("file", "", abs_path)``."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidURLError(f"expected a URL or path string, got {url!r}")
    if url.startswith(PROFILE_SCHEME):
        url = str(_profile_for(url).rewrite(url))
    if "://" not in url:
        return "file", "", os.path.abspath(os.path.expanduser(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidURLError(f"file URLs must be local (file:///path): {url}")
        return "file", "", os.path.abspath(unquote(parts.path))
    if scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise InvalidURLError(f"missing bucket name in {url} (expected s3://bucket/key)")
        if parts.query or parts.fragment:
            raise InvalidURLError(f"unexpected query or fragment in {url}")
        return "s3", parts.netloc, parts.path.lstrip("/")
    if scheme in ("gs", "gcs", "az", "azure", "abfs", "abfss"):
        canonical = {"gcs": "gs", "azure": "az", "abfss": "abfs"}.get(scheme, scheme)
        if not parts.netloc:
            what = "bucket" if canonical == "gs" else "container"
            raise InvalidURLError(
                f"missing {what} name in {url} (expected {canonical}://{what}/key)"
            )
        if parts.query or parts.fragment:
            raise InvalidURLError(f"unexpected query or fragment in {url}")
        netloc = parts.netloc
        if canonical == "abfs" and "@" in netloc:
            # abfs://container@account.dfs.core.windows.net/key: keep the account name.
            container, _, host = netloc.partition("@")
            netloc = f"{container}@{host.split('.', 1)[0]}"
        elif canonical == "abfs":
            canonical = "az"
        return canonical, netloc, parts.path.lstrip("/")
    raise InvalidURLError(
        f"unsupported URL scheme {scheme!r} in {url}; supported: "
        + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        + " and plain paths"
    )


def _freeze(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


def _profile_for(url: str) -> Any:
    from ..profiles import find_profile

    return find_profile(url)


def open_url(url: str | os.PathLike[str], options: TransferOptions) -> tuple[Store, str]:
    """The (cached) store serving ``url`` and the key of ``url`` inside it.

    A ``profile://NAME/...`` URL, or one under a profile's ``match`` prefix, takes the
    profile's storage options under the call's own (see cloudckpt.profiles).
    """
    scheme, bucket, key = split_url(url)
    profile = _profile_for(url) if isinstance(url, str) and "://" in url else None
    if profile is not None and profile.storage_options:
        options = options.replace(
            storage_options={**profile.storage_options, **options.storage_options}
        )
    storage_options = options.storage_options
    if scheme == "file":
        from .local import LocalStore

        if storage_options:
            from ..errors import ConfigError

            given = ", ".join(sorted(storage_options))
            raise ConfigError(f"the filesystem takes no storage options (got {given})")
        store_key: tuple[Any, ...] = (os.getpid(), "file")
        with _cache_lock:
            store = _cache.get(store_key)
            if store is None:
                store = _cache[store_key] = LocalStore("/")
        return store, key.lstrip("/")
    store_key = (
        os.getpid(),
        scheme,
        bucket,
        _freeze(storage_options),
        options.connect_timeout,
        options.request_timeout,
    )
    with _cache_lock:
        store = _cache.get(store_key)
        if store is None:
            store = _cache[store_key] = _make_store(scheme, bucket, options)
    return store, key


def _make_store(scheme: str, bucket: str, options: TransferOptions) -> Store:
    """A new store for ``scheme``; cloud SDKs are imported only when their scheme is used."""
    connect, read = options.connect_timeout, options.request_timeout
    if scheme == "gs":
        from .gcs import GCSStore

        return GCSStore(bucket, options.storage_options, connect_timeout=connect, read_timeout=read)
    if scheme in ("az", "abfs"):
        from .azure import AzureStore

        container, _, account = bucket.partition("@")
        return AzureStore(
            container,
            options.storage_options,
            account=account or None,
            connect_timeout=connect,
            read_timeout=read,
        )
    from .s3 import S3Store

    return S3Store(bucket, options.storage_options, connect_timeout=connect, read_timeout=read)

"""URL schemes and the stores that serve them: the built-ins, and third-party stores.

A store is made by a factory ``factory(bucket, options) -> Store`` (``bucket`` is the
URL's netloc; ``options`` the call's resolved :class:`~cloudckpt.options.TransferOptions`,
whose ``storage_options`` hold the backend's settings). Third-party packages add a
scheme without touching cloudckpt, with an entry point in the group
:data:`ENTRY_POINT_GROUP` named for the scheme::

    [project.entry-points."cloudckpt.stores"]
    myfs = "mypackage.store:make_store"

or at run time with :func:`register_store`. Cloud SDKs are imported only when their
scheme is first used. docs/architecture.md has a worked example.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, InvalidURLError
from ..options import TransferOptions
from ..redact import display_url
from .base import Store

__all__ = ["ENTRY_POINT_GROUP", "StoreFactory", "register_store", "schemes", "store_factory"]

#: Entry-point group that third-party stores register their schemes in.
ENTRY_POINT_GROUP = "cloudckpt.stores"

StoreFactory = Callable[[str, TransferOptions], Store]


def _refuse_storage_options(what: str, options: TransferOptions) -> None:
    """A ConfigError naming the storage options given to a store that takes none."""
    if options.storage_options:
        given = ", ".join(sorted(options.storage_options))
        raise ConfigError(f"{what} takes no storage options (got {given})")


def _file(bucket: str, options: TransferOptions) -> Store:
    from .local import LocalStore

    _refuse_storage_options("the filesystem", options)
    return LocalStore("/")


def _connections(options: TransferOptions) -> dict[str, Any]:
    """The connection settings every HTTP backend takes, from the call's options."""
    return {
        "connect_timeout": options.connect_timeout,
        "read_timeout": options.request_timeout,
        "max_connections": options.connection_pool_size,
    }


def _s3(bucket: str, options: TransferOptions) -> Store:
    from .s3 import S3Store

    return S3Store(bucket, options.storage_options, **_connections(options))


def _gcs(bucket: str, options: TransferOptions) -> Store:
    from .gcs import GCSStore

    return GCSStore(bucket, options.storage_options, **_connections(options))


def _azure(bucket: str, options: TransferOptions) -> Store:
    from .azure import AzureStore

    container, _, account = bucket.partition("@")
    connections = _connections(options)
    return AzureStore(container, options.storage_options, account=account or None, **connections)


def _memory(bucket: str, options: TransferOptions) -> Store:
    from .memory import MemoryStore

    _refuse_storage_options("the in-memory store", options)
    return MemoryStore(bucket)


_BUILTIN: dict[str, StoreFactory] = {
    "file": _file,
    "s3": _s3,
    "gs": _gcs,
    "az": _azure,
    "abfs": _azure,
    "memory": _memory,
}
_registered: dict[str, StoreFactory] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Serve ``scheme://bucket/key`` URLs with stores made by ``factory``."""
    scheme = scheme.lower()
    if not scheme.isidentifier() or scheme in _BUILTIN:
        raise ConfigError(f"cannot register the URL scheme {scheme!r}")
    with _lock:
        _registered[scheme] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in found:
        if ep.name.lower() in _BUILTIN or ep.name.lower() in _registered:
            continue
        try:
            factory = ep.load()
        except Exception as exc:  # a broken plugin must not break the built-in schemes
            raise ConfigError(
                f"the store for {ep.name}:// ({ep.value}) failed to load: {exc}"
            ) from exc
        register_store(ep.name, factory)


def store_factory(scheme: str) -> StoreFactory | None:
    """The factory serving ``scheme``, or None if no store is known for it."""
    factory = _BUILTIN.get(scheme) or _registered.get(scheme)
    if factory is None:
        _load_entry_points()
        factory = _registered.get(scheme)
    return factory


def schemes() -> tuple[str, ...]:
    """Every scheme a URL may use: the built-in ones, then registered ones."""
    _load_entry_points()
    return (*_BUILTIN, *sorted(_registered))


def unsupported(scheme: str, url: str) -> InvalidURLError:
    """The error for a URL whose scheme no store serves."""
    return InvalidURLError(
        f"unsupported URL scheme {scheme!r} in {display_url(url)}; supported: "
        + ", ".join(f"{s}://" for s in schemes())
        + " and plain paths"
    )

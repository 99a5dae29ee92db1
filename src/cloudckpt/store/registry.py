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

__all__ = [
    "ALIASES",
    "ENTRY_POINT_GROUP",
    "PROFILE",
    "StoreFactory",
    "closest_scheme",
    "register_store",
    "scheme_names",
    "schemes",
    "store_factory",
    "suggest_url",
]

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
    # A key is a whole path the user named: its directories are followed as the
    # filesystem resolves them (writes into a directory of its own check below it:
    # LocalStore.checked, store/local.py).
    return LocalStore("/", checked_below=None)


def _connections(options: TransferOptions) -> dict[str, Any]:
    """The connection settings every HTTP backend takes, from the call's options."""
    return {
        "connect_timeout": options.connect_timeout,
        "read_timeout": options.request_timeout,
        "metadata_timeout": min(options.metadata_timeout, options.request_timeout),
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
#: Other names of built-in schemes, as other tools spell them -> the built-in scheme.
ALIASES = {"s3a": "s3", "gcs": "gs", "azure": "az", "abfss": "abfs"}
#: ``profile://NAME/key``: a URL through a named profile (cloudckpt.profiles).
PROFILE = "profile"
_registered: dict[str, StoreFactory] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register_store(scheme: str, factory: StoreFactory) -> None:
    """Serve ``scheme://bucket/key`` URLs with stores made by ``factory``."""
    scheme = scheme.lower()
    if not scheme.isidentifier() or scheme in _BUILTIN or scheme in (*ALIASES, PROFILE):
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


def scheme_names() -> tuple[str, ...]:
    """Every word a URL may start with: the schemes, their aliases and ``profile``.

    Names are case-insensitive (``S3://`` is ``s3://``), as RFC 3986 has them.
    """
    return (*schemes(), *ALIASES, PROFILE)


def _distance(a: str, b: str) -> int:
    """The edit distance of two words (insertions, deletions, substitutions)."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def closest_scheme(word: str) -> str | None:
    """The known scheme ``word`` is most likely a typo of (one edit away, two for
    words of four letters or more), or None when none is that close."""
    word = word.lower()
    limit = 1 if len(word) <= 3 else 2
    best = min(scheme_names(), key=lambda name: _distance(word, name))
    return best if 0 < _distance(word, best) <= limit else None


def suggest_url(scheme: str, rest: str) -> str:
    """The URL ``scheme`` + ``rest`` most likely meant: ``rest`` after ``scheme://``
    (``file:///`` for a file URL, whose host part is empty)."""
    rest = rest.lstrip("/")
    return f"file:///{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"


def unsupported(scheme: str, url: str) -> InvalidURLError:
    """The error for a URL whose scheme no store serves: the known schemes, and the
    URL with the closest one when there is one."""
    closest = closest_scheme(scheme)
    hint = ""
    if closest is not None:
        guess = suggest_url(closest, url.partition(":")[2])
        hint = f"; did you mean {display_url(guess)!r}?"
    return InvalidURLError(
        f"unsupported URL scheme {scheme!r} in {display_url(url)}; supported: "
        + ", ".join(f"{s}://" for s in schemes())
        + " and plain paths"
        + hint
    )

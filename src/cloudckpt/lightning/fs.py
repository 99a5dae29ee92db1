"""A small fsspec filesystem over cloudckpt's stores, for the parts of Lightning that use fsspec.

Lightning's ``ModelCheckpoint`` and its ``ckpt_path="last"`` lookup talk to storage
through fsspec (and fail on ``s3://`` without s3fs). :class:`CloudFileSystem` answers
them with cloudckpt's own stores and credentials. It is registered under the protocol
``cloudckpt``, so a path ``cloudckpt://s3://bucket/key`` resolves to it; plain
``s3://`` paths are never claimed from other fsspec implementations.

The store settings each path uses are registered by URL prefix
(:func:`register_options`); :func:`remote_dirpath` and :func:`setup_remote_dirpath`
are what a ``ModelCheckpoint`` subclass (Lightning's, NeMo's) does to take a URL as its
``dirpath``.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import threading
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from ..format.commit import DCP_MARKER
from ..io.bulk import delete_keys
from ..options import TransferOptions
from ..store import Settings, Store, Target, join_key
from ..store.paths import children, classify, dir_prefix

__all__ = [
    "PROTOCOL",
    "CloudFileSystem",
    "is_remote",
    "register_options",
    "register_settings",
    "remote_dirpath",
    "settings_for",
    "setup_remote_dirpath",
    "target_for",
    "unwrap",
    "wrap",
]

PROTOCOL = "cloudckpt"
_PREFIX = PROTOCOL + "://"

#: URL prefix -> the settings given for the paths under it.
_settings: dict[str, Settings] = {}
_settings_lock = threading.Lock()


def register_options(
    url_prefix: str, options: TransferOptions | None = None, **overrides: Any
) -> None:
    """Use these settings (credentials, endpoint, knobs) for paths under ``url_prefix``.

    They are checked here and resolved per URL (cloudckpt.store.Settings), so a profile
    that a URL selects still applies beneath them.
    """
    register_settings(url_prefix, Settings(options, dict(overrides)))


def register_settings(url_prefix: str, settings: Settings) -> None:
    """:func:`register_options` for settings already checked."""
    with _settings_lock:
        _settings[url_prefix.rstrip("/")] = settings


def settings_for(url: str) -> Settings:
    """The registered settings with the longest prefix matching ``url`` (else none)."""
    with _settings_lock:
        matches = [p for p in _settings if url == p or url.startswith(p + "/") or p == ""]
        best = max(matches, key=len, default=None)
        return _settings[best] if best is not None else Settings()


def target_for(url: str) -> Target:
    """The store, key and options for ``url``: :func:`settings_for` it, resolved once
    for this URL."""
    return settings_for(url).open(url)


def is_remote(path: Any) -> bool:
    """True for object-store URLs (anything with a scheme other than ``file``)."""
    text = unwrap(path) if path is not None else ""
    return "://" in text and not text.startswith("file://")


def remote_dirpath(
    dirpath: Any,
    options: TransferOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """A checkpoint callback's ``dirpath`` as a store URL when it names an object store
    (None: a local one, which the callback's base class handles).

    The settings given to the callback are checked here (a bad one fails when the
    callback is made, not at its first save) and, if any, registered for the URL; with
    none, what the checkpoint I/O registered (or a profile) applies.
    """
    settings = Settings(options, {"storage_options": storage_options} if storage_options else {})
    if not is_remote(dirpath):
        return None
    url = unwrap(os.fspath(dirpath) if isinstance(dirpath, os.PathLike) else dirpath)
    url = url.rstrip("/")
    if options is not None or storage_options:
        register_settings(url, settings)
    return url


def setup_remote_dirpath(callback: Any, trainer: Any) -> None:
    """The ``setup`` of a checkpoint callback whose ``dirpath`` is a URL: no links on a
    store, rank 0's ``dirpath`` on every rank, a fresh filesystem view."""
    if callback.save_last == "link":
        raise ValueError(
            f"save_last='link' needs a local dirpath; {callback.dirpath} is an object store"
        )
    callback.dirpath = trainer.strategy.broadcast(callback.dirpath)
    callback._fs = CloudFileSystem()


class _WrappedPath(str):
    """A wrapped path (``cloudckpt://s3://b/k``) that messages show as the URL the user
    wrote (``s3://b/k``).

    Lightning passes the paths a ``ModelCheckpoint`` finds for ``ckpt_path="last"`` to
    fsspec through ``str(path)``, so their value must be the wrapped one; it then logs
    the chosen one ("Restoring states from the checkpoint path at ...") with an
    f-string. Formatting and ``repr`` give the user's URL; ``str()``, comparisons and
    hashing keep the wrapped value (every cloudckpt entry point unwraps it)."""

    __slots__ = ()

    def __format__(self, spec: str) -> str:
        return format(unwrap(self), spec)

    def __repr__(self) -> str:
        return repr(unwrap(self))


def wrap(url: str) -> str:
    """``s3://b/k`` -> ``cloudckpt://s3://b/k`` (a path fsspec resolves to this
    filesystem, shown in messages as ``s3://b/k``)."""
    return _WrappedPath(url if url.startswith(_PREFIX) else _PREFIX + url)


def unwrap(path: Any) -> str:
    """The store URL inside a wrapped path; other paths unchanged."""
    text = str(path)
    return text[len(_PREFIX) :] if text.startswith(_PREFIX) else text


class _Writer(io.BytesIO):
    """Buffers a small write (Lightning's ``best_k_models.yaml``) and stores it on close."""

    def __init__(self, store: Store, key: str) -> None:
        super().__init__()
        self._store, self._key = store, key

    def close(self) -> None:
        if not self.closed:
            self._store.put(self._key, self.getvalue())
        super().close()


class CloudFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """fsspec view of cloudckpt stores; paths are store URLs (optionally ``cloudckpt://``-wrapped)."""

    protocol = PROTOCOL
    root_marker = ""
    cachable = False

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        return unwrap(path).rstrip("/")

    def _store(self, path: str) -> tuple[Store, str]:
        where = target_for(unwrap(path))
        return where.store, where.key

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        url = unwrap(path).rstrip("/")
        store, key = self._store(url)
        entry = classify(store, key)
        if entry.info is not None:
            return {"name": url, "size": entry.info.size, "type": "file", "mtime": entry.info.mtime}
        if entry.kind == "prefix":
            return {"name": url, "size": 0, "type": "directory"}
        raise FileNotFoundError(url)

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def modified(self, path: str) -> dt.datetime:
        """When ``path`` was written; for a sharded (DCP) checkpoint's prefix, when its
        commit marker was, so the newest of several ``last`` checkpoints can be told."""
        url = unwrap(path).rstrip("/")
        store, key = self._store(url)
        entry = classify(store, key)
        if entry.kind == "missing":
            raise FileNotFoundError(url)
        if entry.kind == "prefix":
            entry = classify(store, join_key(key, DCP_MARKER))
        mtime = entry.info.mtime if entry.info is not None else None
        return dt.datetime.fromtimestamp(mtime or 0.0, tz=dt.timezone.utc)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        url = unwrap(path).rstrip("/")
        store, key = self._store(url)
        below = children(store, key)
        entries: list[dict[str, Any]] = [
            {"name": f"{url}/{n}", "size": 0, "type": "directory"}
            for n in below.dirs
            if n not in below.files  # an object and a prefix of one name: the object
        ]
        entries += [
            {"name": f"{url}/{n}", "size": o.size, "type": "file", "mtime": o.mtime}
            for n, o in below.files.items()
        ]
        items = sorted(entries, key=lambda e: e["name"])
        return items if detail else [e["name"] for e in items]

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        store, key = self._store(path)
        if "w" in mode:
            return _Writer(store, key)
        return io.BytesIO(store.get(key))

    def rm_file(self, path: str) -> None:
        store, key = self._store(path)
        store.delete(key)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for p in [path] if isinstance(path, str) else path:
            if not recursive:
                self.rm_file(p)
                continue
            where = target_for(unwrap(p))
            keys = [o.key for o in where.store.list(dir_prefix(where.key))]
            if where.key.strip("/"):  # the root of a store is no object
                keys.append(where.key)
            delete_keys(where.store, keys, where.options)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Object stores have no directories; nothing to create."""

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Object stores have no directories; nothing to create."""


fsspec.register_implementation(PROTOCOL, CloudFileSystem, clobber=True)

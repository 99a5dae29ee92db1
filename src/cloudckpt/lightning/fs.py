"""A small fsspec filesystem over cloudckpt's stores, for the parts of Lightning that use fsspec.

Lightning's ``ModelCheckpoint`` and its ``ckpt_path="last"`` lookup talk to storage
through fsspec (and fail on ``s3://`` without s3fs). :class:`CloudFileSystem` answers
them with cloudckpt's own stores and credentials. It is registered under the protocol
``cloudckpt``, so a path ``cloudckpt://s3://bucket/key`` resolves to it; plain
``s3://`` paths are never claimed from other fsspec implementations.
"""

from __future__ import annotations

import datetime as dt
import io
import threading
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from ..errors import NotAnObjectError, NotFoundError
from ..options import TransferOptions
from ..store import Store, Target, open_target

__all__ = ["PROTOCOL", "CloudFileSystem", "register_options", "target_for", "unwrap", "wrap"]

PROTOCOL = "cloudckpt"
_PREFIX = PROTOCOL + "://"

#: URL prefix -> the settings given for it: an options object (or None) and overrides.
_settings: dict[str, tuple[TransferOptions | None, Mapping[str, Any]]] = {}
_settings_lock = threading.Lock()


def register_options(
    url_prefix: str, options: TransferOptions | None = None, **overrides: Any
) -> None:
    """Use these settings (credentials, endpoint, knobs) for paths under ``url_prefix``.

    They are resolved per URL (cloudckpt.store.open_target), so a profile that a URL
    selects still applies beneath them.
    """
    with _settings_lock:
        _settings[url_prefix.rstrip("/")] = (options, dict(overrides))


def target_for(url: str) -> Target:
    """The store, key and options for ``url``: the registered settings with the longest
    prefix matching it (else none), resolved for this URL."""
    with _settings_lock:
        matches = [p for p in _settings if url == p or url.startswith(p + "/") or p == ""]
        best = max(matches, key=len, default=None)
        options, overrides = _settings[best] if best is not None else (None, {})
    return open_target(url, options, **overrides)


def wrap(url: str) -> str:
    """``s3://b/k`` -> ``cloudckpt://s3://b/k`` (a path fsspec resolves to this filesystem)."""
    return url if url.startswith(_PREFIX) else _PREFIX + url


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
        try:
            obj = store.head(key)
            return {"name": url, "size": obj.size, "type": "file", "mtime": obj.mtime}
        except (NotFoundError, NotAnObjectError):
            if next(iter(store.list(key + "/")), None) is not None:
                return {"name": url, "size": 0, "type": "directory"}
            raise FileNotFoundError(url) from None

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def modified(self, path: str) -> dt.datetime:
        mtime = self.info(path).get("mtime") or 0.0
        return dt.datetime.fromtimestamp(mtime, tz=dt.timezone.utc)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        url = unwrap(path).rstrip("/")
        store, key = self._store(url)
        prefix = key + "/" if key else ""
        entries: dict[str, dict[str, Any]] = {}
        for obj in store.list(prefix):
            rest = obj.key[len(prefix) :]
            name = rest.split("/", 1)[0]
            child = f"{url}/{name}"
            if "/" in rest:
                entries.setdefault(child, {"name": child, "size": 0, "type": "directory"})
            else:
                entries[child] = {
                    "name": child,
                    "size": obj.size,
                    "type": "file",
                    "mtime": obj.mtime,
                }
        items = sorted(entries.values(), key=lambda e: e["name"])
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
            if recursive:
                store, key = self._store(p)
                for obj in store.list(key.rstrip("/") + "/"):
                    store.delete(obj.key)
            self.rm_file(p)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Object stores have no directories; nothing to create."""

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Object stores have no directories; nothing to create."""


fsspec.register_implementation(PROTOCOL, CloudFileSystem, clobber=True)

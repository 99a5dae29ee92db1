"""Where a DCP checkpoint lives: its URL, transfer options, and a store opened on demand.

Writers and readers are pickled by ``dcp.async_save`` in process mode and sent to a
fresh process, so they hold only what ``cloudckpt.store.resolve`` found (the URL, the
store URL it names, the options); the store (and its HTTP client) is opened lazily in
the process that uses it and never pickled. A location made from a ``Target`` (an
opened URL, such as a manager's view of a step held partly in its local tier) uses
that Target's store in this process, and opens its URL afresh in another.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import AlreadyExistsError
from ..options import TransferOptions
from ..store import (
    Resolved,
    Store,
    Target,
    join_key,
    locate,
    open_url,
    resolve,
    split_url,
)
from ..store.paths import exists

__all__ = ["CheckpointLocation", "LocatedCheckpoint", "url_string"]


def url_string(url: str | os.PathLike[str]) -> str:
    """The URL as a string, checked (unsupported schemes raise InvalidURLError)."""
    text = os.fspath(url)
    split_url(text)
    return text


class CheckpointLocation:
    """A checkpoint prefix: ``relative`` names inside it map to store keys and URLs."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        options: TransferOptions,
        *,
        location: str | None = None,
    ) -> None:
        """``url`` whose ``options`` are resolved already; ``location`` is the store URL
        it names (looked up from ``url`` when not given)."""
        self.url = os.fspath(url)
        self.options = options
        self.location = locate(self.url) if location is None else location
        self._opened: tuple[Store, str] | None = None
        self._pid = -1
        self._target: Target | None = None

    @classmethod
    def resolve(
        cls, url: str | os.PathLike[str], options: TransferOptions | None = None, **overrides: Any
    ) -> CheckpointLocation:
        """``url`` with the call's options resolved once (``cloudckpt.store.resolve``:
        keywords > ``options`` > profile > defaults), as every DCP and Megatron entry
        point takes them; a URL resolved already is used as it is, and an opened one
        (a ``Target``) keeps its store in this process."""
        found = resolve(url, options, **overrides)
        where = cls(found.url, found.options, location=found.location)
        if isinstance(url, Target):
            where._target = url
            where._opened, where._pid = (url.store, url.key.rstrip("/")), os.getpid()
        return where

    @property
    def resolved(self) -> Resolved:
        """What this location was made from, to hand to another entry point (a writer
        or reader for the same URL) without resolving it again."""
        return Resolved(self.url, self.location, self.options)

    @property
    def source(self) -> Resolved | Target:
        """What to hand another entry point for the same URL: the Target this location
        was opened from (its store used as is), else :attr:`resolved`."""
        if self._target is not None and self._pid == os.getpid():
            return self._target
        return self.resolved

    def target_of(self, relative: str) -> Target:
        """One object inside the checkpoint, opened on this location's store (for an
        entry point that reads one object, such as ``load``)."""
        return Target(self.url_of(relative), self.store, self.key(relative), self.options)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_opened"] = None  # never ship a client to another process
        state["_target"] = None
        return state

    def _open(self) -> tuple[Store, str]:
        if self._opened is None or self._pid != os.getpid():
            store, key = open_url(self.location, self.options)
            self._opened, self._pid = (store, key.rstrip("/")), os.getpid()
        return self._opened

    @property
    def store(self) -> Store:
        """The store holding the checkpoint, opened on first use in this process."""
        return self._open()[0]

    @property
    def root_key(self) -> str:
        """The checkpoint prefix's own key (without a trailing ``/``)."""
        return self._open()[1]

    def key(self, relative: str) -> str:
        """Store key of ``relative`` (refusing names that escape the prefix)."""
        return join_key(self._open()[1], relative, self.url)

    def url_of(self, relative: str) -> str:
        """User-facing URL of ``relative``."""
        return self.store.url(self.key(relative))

    def clear_marker(self, name: str, overwrite: bool) -> None:
        """Remove the commit marker ``name`` before anything is rewritten; with
        ``overwrite=False`` refuse a URL that holds one (AlreadyExistsError)."""
        if not self.exists(name):
            return
        if not overwrite:
            raise AlreadyExistsError(
                # "Checkpoint already exists" is the phrase torch's FileSystemWriter uses
                # (and its own tests match): same words, same meaning.
                f"Checkpoint already exists at {self.url} ({self.url_of(name)}) and "
                "overwrite=False: pass overwrite=True or save to a new URL"
            )
        self.store.delete(self.key(name))

    def exists(self, relative: str) -> bool:
        """Whether ``relative`` is an object (one HEAD, retried by the store)."""
        return exists(self.store, self.key(relative))


class LocatedCheckpoint:
    """Identity shared by the writer and the reader: the URL DCP calls checkpoint_id."""

    location: CheckpointLocation

    @property
    def url(self) -> str:
        """The checkpoint's URL (its prefix)."""
        return self.location.url

    @property
    def checkpoint_id(self) -> str:
        """The URL, as DCP names a checkpoint."""
        return self.location.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for any URL or path cloudckpt supports."""
        from ..errors import InvalidURLError

        try:
            url_string(checkpoint_id)
        except (InvalidURLError, TypeError):
            return False
        return True

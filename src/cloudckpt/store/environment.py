"""Which environment variables each built-in store reads its settings from, a digest of
them, and :class:`Held`: what a store made from them, made again when they change or
after a credentials failure (docs/configuration.md, "When settings are read").

A store made under another digest was made from other settings: ``open_url`` makes a new
store then, and a store already held (a manager's, a Lightning plugin's) makes its
clients again through its :class:`Held`. A store found in the cache was keyed by the
digest it was opened under, and may have followed other values since: ``open_url``
has it look at the environment at once (:meth:`Held.current`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from ..errors import CredentialsError

__all__ = ["CHECK_SECONDS", "ENVIRONMENT_PREFIXES", "Held", "environment"]


#: The environment variables each built-in store reads its settings from (names
#: starting with these): credentials, endpoint, region, profile, emulator host.
ENVIRONMENT_PREFIXES: dict[str, tuple[str, ...]] = {
    "s3": ("AWS_",),
    "gs": ("GOOGLE_", "CLOUDSDK_", "STORAGE_EMULATOR_HOST"),
    "az": ("AZURE_",),
    "abfs": ("AZURE_",),
}

#: Seconds between two looks at the environment from a held store's request path.
CHECK_SECONDS = 1.0

T = TypeVar("T")
R = TypeVar("R")


def environment(scheme: str) -> str | None:
    """A digest of the environment variables the store of ``scheme`` reads (None: it
    reads none, or none is set): a store made under another digest was made from other
    settings. A digest, so no secret is kept by it."""
    prefixes = ENVIRONMENT_PREFIXES.get(scheme)
    if not prefixes:
        return None
    found = sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))
    if not found:
        return None
    return hashlib.sha256(repr(found).encode()).hexdigest()


class Held(Generic[T]):
    """What one store made from its settings and the environment (its clients, its
    session), shared by the store's copies (``with_retry``).

    ``make`` is called again when the variables of ``scheme`` change (looked at from
    the request path at most every :data:`CHECK_SECONDS`, so a store held for long
    follows them) and by :meth:`call` after a credentials failure (the SDK's files read
    again too). ``identity`` says who a made object acts as (endpoint, where the
    credentials came from, a digest of static ones; never a secret): after a
    credentials failure the request is sent once more only when the object made again
    acts as someone else. Objects already handed to a request are left to it.
    """

    def __init__(
        self,
        scheme: str,
        make: Callable[[], T],
        identity: Callable[[T], Hashable],
        *,
        refused: tuple[type[Exception], ...] = (CredentialsError,),
    ) -> None:
        self._scheme = scheme
        self._make = make
        self._identity = identity
        self._refused = refused
        self._lock = threading.Lock()
        self._env = environment(scheme)
        self.made = make()
        self._checked = time.monotonic()

    def get(self) -> T:
        """The object made from the settings as the environment has them now."""
        made = self.made
        now = time.monotonic()
        if now - self._checked < CHECK_SECONDS:
            return made
        self._checked = now
        return made if self._env == environment(self._scheme) else self.renew(made)

    def current(self) -> T:
        """:meth:`get` without waiting for :data:`CHECK_SECONDS`: what a fresh open of
        the store checks (``open_url`` keyed it by the environment as it is now, and the
        held store may have followed other values since)."""
        made = self.made
        self._checked = time.monotonic()
        return made if self._env == environment(self._scheme) else self.renew(made)

    def renew(self, seen: T) -> T:
        """The object made again, unless another thread did since ``seen`` was current."""
        with self._lock:
            if self.made is seen:
                env = environment(self._scheme)  # before make: a change during it shows
                self.made = self._make()
                self._env = env
            return self.made

    def call(self, send: Callable[[T], R]) -> R:
        """``send(made)``; after a credentials failure (``refused``: a
        :class:`CredentialsError` unless the store says otherwise) the object is made
        again and, when it now acts as someone else (a corrected secret, rotated keys,
        another endpoint), ``send`` runs once more with it. With the same identity the
        error stands."""
        made = self.get()
        try:
            return send(made)
        except self._refused:
            renewed = self.renew(made)
            if self._identity(renewed) == self._identity(made):
                raise
            return send(renewed)

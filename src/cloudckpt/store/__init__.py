"""Backends behind one :class:`Store` interface, chosen by URL scheme.

:func:`resolve` is the one place a URL and a call's settings (an options object,
keyword overrides, the profile the URL selects) become the store URL it names and the
options in force; the profile is looked up once, for both. :func:`open_target` opens
what it resolved (:func:`object_url` first where the URL must name one object, not
a prefix), and :class:`Settings` holds settings given once for many URLs (an
integration's, a command's) and resolves them for each. Stores are cached per process
(and per set of storage options and connection settings) so connections are reused
across calls; each call gets a view of the cached store that retries by its own options.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError, InvalidURLError
from ..options import TransferOptions, apply_profile, resolve_options
from ..redact import dataclass_repr, display_url, redact_text
from .base import (
    STALE,
    MultipartUpload,
    ObjectInfo,
    Store,
    UploadedPart,
    byte_view,
    check_key,
    join_key,
)
from .environment import environment
from .registry import (
    ALIASES,
    PROFILE,
    closest_scheme,
    register_store,
    scheme_names,
    schemes,
    store_factory,
    suggest_url,
    unsupported,
)
from .retry import RetryPolicy

__all__ = [
    "SUPPORTED_SCHEMES",
    "MultipartUpload",
    "ObjectInfo",
    "Resolved",
    "RetryPolicy",
    "Settings",
    "Store",
    "Target",
    "UploadedPart",
    "byte_view",
    "check_key",
    "join_key",
    "locate",
    "object_url",
    "open_target",
    "open_url",
    "register_store",
    "resolve",
    "split_url",
]

PROFILE_SCHEME = "profile://"
#: The built-in schemes (third-party stores add theirs: cloudckpt.store.registry).
SUPPORTED_SCHEMES = ("file", "s3", "gs", "az", "abfs", "memory")

_cache: dict[tuple[Any, ...], Store] = {}
#: A URL in any form an entry point takes.
_URL = TypeVar("_URL", bound="str | os.PathLike[str]")
_cache_lock = threading.Lock()


#: A URL's scheme and its colon (RFC 3986: a letter, then letters, digits, ``+-.``).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def split_url(url: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of a URL; plain paths become ``("file", "", abs_path)``.

    Checked here, before any I/O: a known scheme without its ``//`` (``s3:/b/k``,
    ``s3:b/k``, also as the first part of a relative path) and an unknown scheme
    (``s4://b/k``) are refused with the URL most likely meant (docs/stores.md, URLs).
    """
    pathlike = isinstance(url, os.PathLike)
    if pathlike:
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise InvalidURLError(f"expected a URL or path string, got {redact_text(repr(url))}")
    if url.startswith(PROFILE_SCHEME):
        url = str(_profile_for(url).rewrite(url))
    head = _SCHEME.match(url)
    if head is None or not url.startswith("//", head.end()):
        _check_local_path(url, pathlike)
        return "file", "", os.path.abspath(os.path.expanduser(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    shown = display_url(url)  # messages never echo a query string (a SAS) or a password
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            host = parts.netloc.rpartition("@")[2]  # never echo a user or password
            guess = display_url(suggest_url("file", f"{host}{parts.path}"))
            raise InvalidURLError(
                f"file URLs must be local (file:///path): {shown}; did you mean {guess!r}?"
            )
        return "file", "", os.path.abspath(unquote(parts.path))
    if scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise InvalidURLError(
                f"missing bucket name in {shown} (expected s3://bucket/key)"
                + _did_you_mean(scheme, parts.path)
            )
        if parts.query or parts.fragment:
            raise _query_error(shown)
        return "s3", parts.netloc, parts.path.lstrip("/")
    if scheme in ("gs", "gcs", "az", "azure", "abfs", "abfss"):
        canonical = ALIASES.get(scheme, scheme)
        if not parts.netloc:
            what = "bucket" if canonical == "gs" else "container"
            raise InvalidURLError(
                f"missing {what} name in {shown} (expected {canonical}://{what}/key)"
                + _did_you_mean(scheme, parts.path)
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
                + _did_you_mean(scheme, parts.path)
            )
        return scheme, parts.netloc, parts.path.lstrip("/")
    if scheme == PROFILE:  # profile:// in another case: profile names are exact
        raise InvalidURLError(
            f"{head.group(1)}://: write profile:// in lower case"
            + _did_you_mean(PROFILE, url[head.end() :])
        )
    raise unsupported(scheme, url)


def _did_you_mean(scheme: str, rest: str) -> str:
    """``; did you mean '...'?`` with ``rest`` after ``scheme://``; "" when it is empty."""
    guess = suggest_url(scheme, rest)
    return f"; did you mean {display_url(guess)!r}?" if rest.strip("/") else ""


def _check_local_path(path: str, pathlike: bool) -> None:
    """Refuse a path that is a URL with a typo: a relative path whose first part is a
    known scheme and a colon (``s3:/b/k``, ``s3:b``), or any ``word:`` alone
    (``s4:/b/k``). An absolute path, or one starting ``./``, is taken as it is."""
    first = path.partition("/")[0]
    head = _SCHEME.match(first)
    if head is None:
        if first == ":":
            raise InvalidURLError(f"{path!r} has no scheme before its ':' (expected s3://...)")
        if path.startswith(f"{first}//") and first.lower() in scheme_names():
            # s3//bucket/key: the colon left out; as a path, ./s3/bucket/key.
            rest = path[len(first) :]
            shown = first + "//" + display_url(f"{first}://{rest.lstrip('/')}").partition("://")[2]
            raise InvalidURLError(
                f"{shown!r} lacks the ':' after '{first}'{_did_you_mean(first, rest)} "
                f"(a local path starting '{first}//' is written ./{shown})"
            )
        return
    word, rest = head.group(1), path[head.end() :]
    # Shown as display_url shows URLs: no query (a signature), user or password.
    after = rest.lstrip("/")
    slashes = rest[: len(rest) - len(after)]
    shown = f"{word}:{slashes}" + display_url(f"{word}://{after}").partition("://")[2]
    local = f" (a local path starting '{word}:' is written ./{shown})"
    folded = "; a pathlib path folds '//' into '/': pass URLs as strings" if pathlike else ""
    if word.lower() in scheme_names():
        guess = _did_you_mean(word, rest) or f"; expected {suggest_url(word, 'bucket/key')}"
        raise InvalidURLError(f"{shown!r} lacks the '//' after '{word}:'{guess}{folded}{local}")
    if head.end() == len(first):  # word: and nothing else in the first part
        closest = closest_scheme(word)
        guess = _did_you_mean(closest, rest) if closest else ""
        raise InvalidURLError(
            f"{shown!r} looks like a URL, but {word!r} is no known scheme (known: "
            + ", ".join(f"{s}://" for s in schemes())
            + f"){guess}{folded}{local}"
        )


def _query_error(shown: str) -> InvalidURLError:
    """A query or fragment in a store URL, named without it (it may hold a SAS token)."""
    return InvalidURLError(
        f"unexpected query or fragment in {shown}?... (credentials go in storage_options)"
    )


def _freeze(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, repr(v)) for k, v in options.items()))


def _profile_for(url: Any) -> Any:
    """The profile ``url`` selects (None for a plain path): the one look-up per URL."""
    from ..profiles import find_profile

    return find_profile(url)


def locate(url: str | os.PathLike[str]) -> str:
    """The store URL ``url`` names (a ``profile://`` URL rewritten by its profile), checked.

    For a URL whose options are resolved already; :func:`resolve` does both at once.
    """
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if isinstance(text, str) and text.startswith(PROFILE_SCHEME):
        profile = _profile_for(text)
        if profile is not None:
            text = str(profile.rewrite(text))
    split_url(text)
    return text


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
        # What the store reads from the environment (credentials, endpoint, region): a
        # change makes a new store rather than reuse one made from the old values.
        environment(scheme),
        options.connect_timeout,
        options.request_timeout,
        options.metadata_timeout,
        options.connection_pool_size,
    )
    with _cache_lock:
        store = _cache.get(store_key)
        if store is not None and store_key in STALE:  # its credentials failed: resolve anew
            del _cache[store_key]
            STALE.discard(store_key)
            store = None
    if store is None:
        made = factory(bucket, options)
        with contextlib.suppress(AttributeError):  # a store class without the slot
            made.cache_key = store_key
        with _cache_lock:
            store = _cache.setdefault(store_key, made)
        if store is not made:
            made.close()
    else:
        # Cached under the environment it was opened in, but a held copy may have made
        # its clients again for other values since (and they may have changed back):
        # the fresh open gets the clients of the environment as it is now.
        store.follow_environment()
    return store.with_retry(RetryPolicy.from_options(options)), key


@dataclass(frozen=True)
class Resolved:
    """A URL with a call's settings resolved for it: what its store is opened from.

    It holds no client, so it can be pickled to another process and opened there. It
    is path-like (``os.fspath`` gives the URL as given), so the entry points that take
    a URL (``save``, ``async_save``, ``load``, the DCP writer and reader, the Megatron
    loads) take one too and use it as resolved, never resolving it again.
    """

    #: The URL as given (a ``profile://`` URL kept): what messages show.
    url: str
    #: The store URL it names: a ``profile://`` URL rewritten by its profile.
    location: str
    options: TransferOptions

    def __repr__(self) -> str:
        """The dataclass repr with the options' secrets masked (cloudckpt.redact)."""
        return dataclass_repr(self)

    def __fspath__(self) -> str:
        return self.url

    def open(self) -> Target:
        """The store serving this URL (cached per process), retrying by its options."""
        store, key = open_url(self.location, self.options)
        return Target(self.url, store, key, self.options, self.location)


@dataclass(frozen=True)
class Target:
    """Where a URL lives: the store (retrying by ``options``), the key in it, the options.

    Path-like, as :class:`Resolved`: an entry point given a Target uses its store as is.
    """

    url: str
    store: Store
    key: str
    options: TransferOptions
    #: The store URL ``url`` names ("": ``url`` itself).
    location: str = ""

    def __repr__(self) -> str:
        """The dataclass repr with the options' secrets masked (cloudckpt.redact)."""
        return dataclass_repr(self)

    def __fspath__(self) -> str:
        return self.url

    @property
    def resolved(self) -> Resolved:
        """The picklable form: the URL and its options, without the store."""
        return Resolved(self.url, self.location or self.url, self.options)


def _already(url: Resolved | Target, options: Any, overrides: Mapping[str, Any]) -> Resolved:
    """A URL resolved before: taken as it is; settings given with it are refused, since
    applying them would resolve it a second time."""
    if options is not None or overrides:
        raise ConfigError(
            f"{display_url(url.url)} is resolved already: give its settings when it is "
            "resolved, not again with it"
        )
    return url if isinstance(url, Resolved) else url.resolved


def _resolve(
    url: str | os.PathLike[str],
    options: TransferOptions | None,
    overrides: Mapping[str, Any],
    *,
    shared: bool = False,
) -> Resolved:
    """:func:`resolve`; ``shared``: the settings were given for many URLs at once, so a
    local path takes none of their storage options (they are the object stores')."""
    if isinstance(url, (Resolved, Target)):
        return _already(url, options, overrides)
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    profile = _profile_for(text)  # once, for both the location and the options
    location = str(profile.rewrite(text)) if profile is not None else text
    scheme = split_url(location)[0]
    call = dict(overrides)
    if shared and scheme == "file":
        call.pop("storage_options", None)
        if options is not None and options.storage_options:
            options = options.replace(storage_options={})
    return Resolved(str(text), location, apply_profile(options, profile, **call))


def resolve(
    url: str | os.PathLike[str], options: TransferOptions | None = None, **overrides: Any
) -> Resolved:
    """Resolve a call's settings for ``url``: the one place that does.

    Precedence: keyword ``overrides`` > ``options`` > the profile ``url`` selects >
    :func:`cloudckpt.configure` (see :func:`cloudckpt.options.resolve_options`). The
    profile is looked up once, for both the URL (``profile://NAME/...``) and the
    options. A :class:`Resolved` or :class:`Target` is returned as it is.
    """
    return _resolve(url, options, overrides)


def open_target(
    url: str | os.PathLike[str], options: TransferOptions | None = None, **overrides: Any
) -> Target:
    """:func:`resolve` ``url`` with a call's settings and open its store.

    A :class:`Target` (an opened URL) is returned as it is, a :class:`Resolved` opened.
    """
    if isinstance(url, Target) and options is None and not overrides:
        return url
    return _resolve(url, options, overrides).open()


#: A URL naming a bucket alone: ``scheme://bucket``.
_BUCKET_ONLY = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://[^/?#]+")


def object_url(url: _URL) -> _URL:
    """``url``, checked to name one object (``save``, ``load``...), before it is resolved
    or its store opened: returned as it is, or refused (InvalidURLError).

    A URL ending in ``/`` names a prefix: refused, for local paths as for object
    stores, rather than written as an object named ``e/`` or a file named for the
    folder; so is a URL naming a bucket alone. Where a prefix is meant (a manager root,
    a DCP checkpoint) a trailing ``/`` is fine: those do not call this.
    """
    text: Any = url
    given = os.fspath(text) if isinstance(text, (str, os.PathLike)) else None
    if isinstance(text, (Resolved, Target)) and text.location.endswith("/"):
        given = text.location  # the store URL a profile's URL names
    if not isinstance(given, str):
        return url  # not a URL: resolve says so
    if given.endswith("/"):
        shown = display_url(given)
        stripped = shown.rstrip("/")
        example = f"{stripped}/model.pt"
        name = stripped.rpartition("/")[2]
        keyed = "/" in stripped.partition("://")[2] if "://" in stripped else bool(stripped)
        if keyed and "." in name.strip("."):  # "x.pt/": the object is most likely "x.pt"
            example = stripped
        raise InvalidURLError(f"{shown} ends in '/': name the object, e.g. {example}")
    bucket = _BUCKET_ONLY.fullmatch(given)
    if bucket is not None and bucket.group(1).lower() not in ("file", PROFILE):
        shown = display_url(given)
        raise InvalidURLError(
            f"{shown} names a bucket, not an object: name the object, e.g. {shown}/model.pt"
        )
    return url


@dataclass(frozen=True)
class Settings:
    """Settings given once for many URLs (an integration's constructor arguments, a
    command's flags): checked here, resolved for each URL by :meth:`resolve` so the
    profile a URL selects applies beneath them. A local path takes none of their
    storage options, which are the object stores'.
    """

    options: TransferOptions | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        resolve_options(self.options, **self.overrides)  # a bad setting fails here

    def __repr__(self) -> str:
        """The dataclass repr with secret storage options masked (cloudckpt.redact)."""
        return dataclass_repr(self)

    def resolve(self, url: str | os.PathLike[str], **extra: Any) -> Resolved:
        """``url`` with these settings resolved, ``extra`` (a call's own) over them; a
        URL resolved already is used as it is."""
        if isinstance(url, (Resolved, Target)) and not extra:
            return _already(url, None, {})
        return _resolve(url, self.options, {**self.overrides, **extra}, shared=True)

    def open(self, url: str | os.PathLike[str], **extra: Any) -> Target:
        """:meth:`resolve`, and the store opened."""
        if isinstance(url, Target) and not extra:
            return url
        return self.resolve(url, **extra).open()

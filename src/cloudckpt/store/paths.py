"""File-system verbs on store keys, written once: is it an object, a prefix, neither."""

from __future__ import annotations

from ..errors import BucketNotFoundError, NotAnObjectError, NotFoundError
from .base import ObjectInfo, Store

__all__ = ["head_object"]


def head_object(store: Store, key: str) -> ObjectInfo:
    """``Store.head``, with errors that say a bucket is missing or a URL is a prefix."""
    url = store.url(key)
    try:
        return store.head(key)
    except BucketNotFoundError:
        raise BucketNotFoundError(f"bucket does not exist: {store.root_url} (for {url})") from None
    except NotFoundError:
        # An object store has no directories: say so if the URL is really a prefix.
        try:
            first = next(iter(store.list(key.rstrip("/") + "/")), None)
        except BucketNotFoundError:
            raise BucketNotFoundError(
                f"bucket does not exist: {store.root_url} (for {url})"
            ) from None
        if first is not None:
            raise NotAnObjectError(
                f"{url} is a prefix holding other objects, not a checkpoint object"
            ) from None
        raise

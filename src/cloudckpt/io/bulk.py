"""Requests sent many at once on the process's I/O threads: deleting a set of keys, or
a checkpoint's whole prefix with its commit file first."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from ..options import TransferOptions
from ..store import ObjectInfo, Store
from .scheduler import TransferGroup

__all__ = ["delete_keys", "delete_prefix"]


def delete_keys(store: Store, keys: Iterable[str], options: TransferOptions) -> None:
    """Delete ``keys`` (at most ``write_concurrency`` at once); an absent key is success."""
    group = TransferGroup(options, options.write_concurrency)
    for key in keys:
        group.submit(functools.partial(store.delete, key), f"delete {store.url(key)}")
    group.wait()


def delete_prefix(
    store: Store,
    prefix: str,
    options: TransferOptions,
    first: Sequence[str] = (),
    objects: Iterable[ObjectInfo] | None = None,
) -> int:
    """Delete every object under ``prefix`` (ending in ``/``): the names in ``first``
    (a checkpoint's commit file) one by one before the rest, so an interrupted delete
    never leaves a checkpoint that looks committed with files missing; then what is
    left of the prefix itself (a filesystem's empty folder). Returns the objects deleted.
    ``objects``: the prefix's listing, when the caller has it."""
    if objects is None:
        objects = list(store.list(prefix))
    keys = [o.key for o in objects]
    total = len(keys)
    for name in first:
        if prefix + name in keys:
            store.delete(prefix + name)
            keys.remove(prefix + name)
    delete_keys(store, keys, options)
    store.remove_prefix_dir(prefix)
    return total

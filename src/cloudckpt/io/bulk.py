"""Requests sent many at once on the process's I/O threads: deleting a set of keys.
(Removing a checkpoint, its commit markers first, is ``engine/remove.py``, over this.)"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from ..options import TransferOptions
from ..store import Store
from .scheduler import TransferGroup

__all__ = ["delete_keys"]


def delete_keys(store: Store, keys: Iterable[str], options: TransferOptions) -> None:
    """Delete ``keys`` (at most ``write_concurrency`` at once); an absent key is success."""
    group = TransferGroup(options, options.write_concurrency)
    for key in keys:
        group.submit(functools.partial(store.delete, key), f"delete {store.url(key)}")
    group.wait()

"""Fetching a stored archive's zip directory: one ranged read of the tail, usually.

Shared by ``load``, and by the command line's ``info`` and ``verify``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from ..format.zipdir import (
    LOCAL_HEADER_SIZE,
    TAIL_PROBE,
    Directory,
    _NeedMore,
    local_header_size,
    parse_directory,
)
from ..options import TransferOptions
from ..store import Store
from .scheduler import call_with_retries

__all__ = ["DirectoryRead", "read_directory"]

#: First tail read: the EOCD records plus room for a directory of ~5,000 records.
TAIL_READ = 512 * 1024


@dataclass
class DirectoryRead:
    """The parsed directory and the tail bytes it was read from (small records may sit there)."""

    directory: Directory
    tail: bytes
    tail_start: int


def read_directory(store: Store, key: str, size: int, options: TransferOptions) -> DirectoryRead:
    """The zip directory of the ``size``-byte object at ``key``, every local header located.

    Raises CorruptCheckpointError when the object is not a zip archive or is damaged.
    """
    url = store.url(key)
    start = max(0, size - max(TAIL_READ, TAIL_PROBE))
    tail = call_with_retries(
        functools.partial(store.get_range, key, start, size), options, f"read {url}"
    )
    while True:
        try:
            directory = parse_directory(tail, start, size, url)
            break
        except _NeedMore as more:
            if more.start >= start or more.start < 0:
                raise CorruptCheckpointError(f"{url}: damaged zip directory") from None
            lo, hi = more.start, start
            head = call_with_retries(
                functools.partial(store.get_range, key, lo, hi), options, f"read {url}"
            )
            tail, start = head + tail, lo
    for e in directory.entries.values():
        if e.local_header_size < 0:  # not inferable from the layout: read the header
            fixed = call_with_retries(
                functools.partial(
                    store.get_range, key, e.header_offset, e.header_offset + LOCAL_HEADER_SIZE
                ),
                options,
                f"read {url}",
            )
            e.local_header_size = local_header_size(fixed)
    return DirectoryRead(directory, tail, start)

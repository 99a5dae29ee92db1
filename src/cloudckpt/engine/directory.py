"""Fetching a stored archive's zip directory: one ranged read of the tail, usually.

Shared by ``load``, and by the command line's ``info`` and ``verify``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from ..format.torch.zipdir import (
    LOCAL_HEADER_SIZE,
    TAIL_PROBE,
    Directory,
    NeedMoreBytes,
    local_header_size,
    parse_directory,
)
from ..store import Store

__all__ = ["DirectoryRead", "read_directory"]

#: First tail read: the EOCD records plus room for a directory of ~5,000 records.
TAIL_READ = 512 * 1024


@dataclass
class DirectoryRead:
    """The parsed directory and the tail bytes it was read from (small records may sit there)."""

    directory: Directory
    tail: bytes
    tail_start: int


def read_directory(store: Store, key: str, size: int) -> DirectoryRead:
    """The zip directory of the ``size``-byte object at ``key``, every local header located.

    Raises CorruptCheckpointError when the object is not a zip archive or is damaged.
    """
    url = store.url(key)
    start = max(0, size - max(TAIL_READ, TAIL_PROBE))
    tail = store.get_range(key, start, size)
    while True:
        try:
            directory = parse_directory(tail, start, size, url)
            break
        except NeedMoreBytes as more:
            if more.start >= start or more.start < 0:
                raise CorruptCheckpointError(f"{url}: damaged zip directory") from None
            lo, hi = more.start, start
            head = store.get_range(key, lo, hi)
            tail, start = head + tail, lo
    for e in directory.entries.values():
        if e.local_header_size < 0:  # not inferable from the layout: read the header
            end = e.header_offset + LOCAL_HEADER_SIZE
            fixed = store.get_range(key, e.header_offset, end)
            e.local_header_size = local_header_size(fixed)
    return DirectoryRead(directory, tail, start)

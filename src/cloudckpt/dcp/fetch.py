"""Ranged reads for a DCP load: the engine's range reader, addressed by relative names.

A DCP reader names data objects by their path inside the checkpoint (``__0_0.distcp``,
``d03/__1_0.distcp``); :class:`RangeFetcher` maps each to its store key and hands the
request to :class:`~cloudckpt.io.ranges.RangeReader`, the planner every read
shares (neighbours joined across ``read_gap``, large requests split at
``read_chunk_size``, ``read_concurrency`` reads at once, ``on_done`` checks in the
reading thread, streaming while the caller plans).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..io.ranges import RangeReader
from .location import CheckpointLocation

__all__ = ["RangeFetcher"]


class RangeFetcher(RangeReader):
    """Collects byte ranges of a checkpoint's data objects to fill, then reads them all."""

    def __init__(self, location: CheckpointLocation, *, stream: bool = False) -> None:
        super().__init__(location.store, location.options, stream=stream)
        self.location = location
        self._keys: dict[str, str] = {}  # each name checked once, not once per range

    def add(
        self,
        relative: str,
        start: int,
        dest: memoryview | Sequence[memoryview],
        on_done: Callable[[], None] | None = None,
        owner: object = None,
    ) -> None:
        """Fill ``dest`` from byte ``start`` of the data object ``relative`` (a name that
        escapes the checkpoint's prefix is refused)."""
        key = self._keys.get(relative)
        if key is None:
            key = self._keys[relative] = self.location.key(relative)
        super().add(key, start, dest, on_done, owner)

"""Part buffers kept warm between saves.

A fresh 64 MiB ``bytearray`` costs a zero-fill pass over cold pages (one page fault per
4 KiB) before the first serialized byte lands in it: profiled, that was half of a sync
save's CPU. Every save of a training run uses the same part size, so the buffers one
save used are kept for the next one.

What is kept is bounded: idle buffers of one size only (a save with another part size
drops them), and no more than the largest ``write_concurrency`` a save asked for. So
the memory held between saves is at most what one save used at its peak.
:func:`release_buffers` hands it all back (part buffers and async staging buffers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["PartBufferCache", "SaveBuffers", "get_cache", "register_pool", "release_buffers"]


class PartBufferCache:
    """The process's idle part buffers: one size, at most ``keep`` of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._size = 0
        self._keep = 0
        self._idle: list[bytearray] = []
        #: Buffers created (not taken from the cache) since the process started.
        self.created = 0

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes: a kept one if there is one, else a new one."""
        with self._lock:
            if size == self._size and self._idle:
                return self._idle.pop()
            self.created += 1
        return bytearray(size)

    def give_back(self, buf: bytearray, keep: int) -> None:
        """Keep ``buf`` for a later save (at most ``keep`` buffers of its size)."""
        size = len(buf)
        with self._lock:
            if size != self._size:
                self._size, self._idle, self._keep = size, [], 0
            self._keep = max(self._keep, keep)
            if len(self._idle) < self._keep:
                self._idle.append(buf)

    def clear(self) -> None:
        """Drop every idle buffer."""
        with self._lock:
            self._idle = []
            self._size = self._keep = 0

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._size * len(self._idle)


_cache = PartBufferCache()


def get_cache() -> PartBufferCache:
    """The process's part buffer cache."""
    return _cache


#: What each pool of memory kept between saves frees when asked (see register_pool).
_releasers: list[Callable[[], int]] = []


def register_pool(release: Callable[[], int]) -> None:
    """Have :func:`release_buffers` call ``release`` (it frees a pool, returns bytes)."""
    _releasers.append(release)


def _release_part_buffers() -> int:
    released = _cache.idle_bytes
    _cache.clear()
    return released


register_pool(_release_part_buffers)


def release_buffers() -> int:
    """Free the memory cloudckpt keeps between saves; returns the bytes released.

    That is the idle part buffers and archive chunks of sync saves and the staging
    buffers of async saves (every pool registered with :func:`register_pool`).
    The next save allocates (and page-faults) its buffers again.
    """
    return sum(release() for release in _releasers)


class SaveBuffers:
    """One save's part buffers: at most ``count`` in use, drawn from the process cache."""

    def __init__(self, count: int, size: int, cache: PartBufferCache | None = None) -> None:
        self.size = size
        self._cache = cache or _cache
        self._count = count
        self._in_use = 0
        self._cond = threading.Condition()

    def acquire(self, check: Callable[[], None]) -> bytearray:
        """A buffer, waiting while ``count`` are in use; ``check`` raises to stop waiting."""
        with self._cond:
            while self._in_use >= self._count:
                self._cond.wait(0.5)
                check()
            self._in_use += 1
        try:
            return self._cache.take(self.size)
        except BaseException:
            with self._cond:
                self._in_use -= 1
                self._cond.notify()
            raise

    def release(self, buf: bytearray) -> None:
        """Return ``buf`` (to the process cache, for this save and later ones)."""
        self._cache.give_back(buf, self._count)
        with self._cond:
            self._in_use -= 1
            self._cond.notify()

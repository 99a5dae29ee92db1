"""Memory kept warm between saves: one pool class, and the part buffers built on it.

A fresh 64 MiB ``bytearray`` costs a zero-fill pass over cold pages (one page fault per
4 KiB) before the first serialized byte lands in it: profiled, that was half of a sync
save's CPU. Every save of a training run uses the same sizes, so the buffers one save
used are kept for the next one.

:class:`BufferPool` is every such pool: idle buffers on free lists keyed by what a
buffer is (its size, and for staging whether it is pinned), under one lock, with an
optional bound on what stays idle. What differs between pools is a parameter: how a
buffer is made and sized, the bound, and whether buffers are given back or handed out
again once nothing but the pool refers to them (a ``reusable`` predicate, such as
:func:`unshared`). Each pool registers with :func:`release_buffers` when made.

The part buffers of a save (:class:`PartBufferCache`) are bounded: idle buffers of one
size only (a save with another part size drops them), and no more than the largest
``write_concurrency`` a save asked for. So the memory held between saves is at most
what one save used at its peak. :func:`release_buffers` hands back every pool's memory
(part buffers, archive chunks, async staging buffers).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from ..errors import CloudCkptError

__all__ = [
    "BufferPool",
    "PartBufferCache",
    "SaveBuffers",
    "get_cache",
    "register_pool",
    "release_buffers",
    "unshared",
]

K = TypeVar("K", bound=Hashable)
B = TypeVar("B")

#: Every pool alive (weakly held: a pool nobody uses any more has nothing to free).
_pools: weakref.WeakSet[BufferPool[Any, Any]] = weakref.WeakSet()
_pools_lock = threading.Lock()


class BufferPool(Generic[K, B]):
    """Buffers reused across saves, on free lists keyed by ``K``, under one lock.

    ``make(key)`` makes a buffer (outside the lock: a large one takes a while) and
    ``nbytes(key)`` says its size, for the accounting. Two ways to reuse:

    - given back (the default): :meth:`take` pops an idle buffer of the key, or makes
      one; :meth:`give_back` keeps it for the next :meth:`take`, at most ``keep`` of a
      key, and with ``one_key`` only the key given back last (another key drops the
      idle ones: a pool of one size, never a mix);
    - ``reusable``: the pool keeps every buffer it makes, and :meth:`take` hands one
      out again once ``reusable(buffer)`` says so (:func:`unshared`: once nothing but
      the pool refers to it); nothing is given back.

    The pool registers with :func:`release_buffers`, which calls :meth:`clear`.
    """

    def __init__(
        self,
        make: Callable[[K], B],
        nbytes: Callable[[K], int],
        *,
        one_key: bool = False,
        reusable: Callable[[B], bool] | None = None,
    ) -> None:
        self._make = make
        self._nbytes = nbytes
        self._one_key = one_key
        self._reusable = reusable
        self._lock = threading.Lock()
        #: Idle buffers by key (with ``reusable``: every buffer the pool keeps).
        self._free: dict[K, list[B]] = {}
        #: The bound on idle buffers of each key: the largest ``keep`` given back.
        self._keep: dict[K, int] = {}
        #: Buffers made (not taken from the pool) since the pool was made.
        self.created = 0
        #: Bytes of the buffers made and not yet let go of (idle or in use).
        self.allocated_bytes = 0
        with _pools_lock:
            _pools.add(self)

    def take(self, key: K) -> B:
        """A buffer for ``key``: an idle (or reusable) one if there is one, else a new one."""
        reusable = self._reusable
        with self._lock:
            free = self._free.get(key)
            if free:
                if reusable is None:
                    return free.pop()
                for buf in free:
                    if reusable(buf):
                        return buf
            self.created += 1
            self.allocated_bytes += self._nbytes(key)
        buf = self._make(key)
        if reusable is not None:
            with self._lock:
                self._free.setdefault(key, []).append(buf)
        return buf

    def give_back(self, buf: B, key: K, keep: int | None = None) -> None:
        """Keep ``buf`` (made for ``key``) for a later :meth:`take`.

        ``keep`` bounds the idle buffers of ``key`` (the largest bound given since the
        key's idle ones were last dropped); None leaves the bound as it is (no bound
        where none was given: every buffer is kept).
        """
        if self._reusable is not None:
            raise CloudCkptError(
                "give_back on a pool with a reusable predicate: it hands its buffers out "
                "again by itself once they are reusable"
            )
        with self._lock:
            free = self._free.get(key)
            if free is None:
                if self._one_key:  # another key: the idle ones of the last go
                    self.allocated_bytes -= self._drop_all()
                free = self._free[key] = []
            if keep is not None:
                self._keep[key] = max(self._keep.get(key, 0), keep)
            bound = self._keep.get(key)
            if bound is not None and len(free) >= bound:
                self.allocated_bytes -= self._nbytes(key)  # over the bound: let go of it
                return
            free.append(buf)

    def clear(self) -> int:
        """Let go of every buffer the pool holds (those in use live on with their users);
        returns their bytes."""
        with self._lock:
            dropped = self._drop_all()
            self.allocated_bytes -= dropped
        return dropped

    def _drop_all(self) -> int:
        """Empty the free lists and bounds (under the lock); the bytes they held."""
        dropped = sum(self._nbytes(key) * len(free) for key, free in self._free.items())
        self._free, self._keep = {}, {}
        return dropped

    @property
    def idle_bytes(self) -> int:
        """Bytes the pool holds for reuse (with ``reusable``: every buffer it keeps)."""
        with self._lock:
            return sum(self._nbytes(key) * len(free) for key, free in self._free.items())


def _calibrate_free_refs() -> int:
    """References to a buffer nobody else holds, as a ``reusable`` predicate counts them."""
    counts: list[int] = []

    def count(buf: bytearray) -> bool:
        counts.append(sys.getrefcount(buf))
        return False

    pool: BufferPool[int, bytearray] = BufferPool(bytearray, int, reusable=count)
    pool.take(0)  # made, and dropped at once by this caller
    pool.take(0)  # counts the first one's references: the pool's alone
    return counts[0]


_FREE_REFS = _calibrate_free_refs()


def unshared(buf: Any) -> bool:
    """True once nothing but the pool refers to ``buf`` (a ``reusable`` predicate): no
    view, owner or caller holds it, so its bytes can be written again."""
    return sys.getrefcount(buf) <= _FREE_REFS


class PartBufferCache(BufferPool[int, bytearray]):
    """The process's idle part buffers: ``bytearray`` of one size, at most ``keep``."""

    def __init__(self) -> None:
        super().__init__(bytearray, int, one_key=True)


_cache = PartBufferCache()


def get_cache() -> PartBufferCache:
    """The process's part buffer cache."""
    return _cache


#: Other memory kept between saves, freed when asked (see register_pool).
_releasers: list[Callable[[], int]] = []


def register_pool(release: Callable[[], int]) -> None:
    """Have :func:`release_buffers` call ``release`` (it frees memory, returns bytes).

    A :class:`BufferPool` registers itself; this is for memory kept some other way.
    """
    _releasers.append(release)


def release_buffers() -> int:
    """Free the memory cloudckpt keeps between saves; returns the bytes released.

    That is the idle part buffers and archive chunks of sync saves and the staging
    buffers of async saves (every :class:`BufferPool`, and whatever was registered
    with :func:`register_pool`). The next save allocates (and page-faults) its buffers
    again.
    """
    with _pools_lock:
        pools = list(_pools)
    return sum(pool.clear() for pool in pools) + sum(release() for release in _releasers)


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
        self._cache.give_back(buf, self.size, self._count)
        with self._cond:
            self._in_use -= 1
            self._cond.notify()

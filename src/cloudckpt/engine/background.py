"""The one starter of background saves: a line per key, the next save after the previous.

Every save that runs in the background starts here: ``cloudckpt.async_save`` (one line
for the process, at most ``max_in_flight`` saves on it), Megatron's asynchronous save
(a line per group of ranks: two saves' collectives on one group would interleave),
Accelerate's ``save_state(async_save=True)`` (a line per run URL) and the manager's
DCP and Megatron saves (a line per manager: their commits share the checkpoint group).

The call order, on the caller's thread::

    line.make_room(key)              # 1. wait for the saves before it (their outcome
                                     #    stays their handles'), or let the thread wait:
    previous = line.add(handle, key) # 2. last on the line, and in the process registry
    line.start(handle, work, name=..., after=previous)  # 3. work() on a new thread

:meth:`SaveLine.start` runs ``work`` on its thread (after ``after`` is done, when given)
and finishes the handle with what it returns or raises; :meth:`SaveLine.run` does the
same on the caller's thread (a synchronous save that keeps its place in the line).
A handle leaves its line once done. Registered handles are those of
``engine/handle.in_flight``: a failure nobody looked at is raised by the next save,
by ``wait_all`` and at exit; the threads are joined at exit (``InFlight.add_worker``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .handle import SaveHandle, in_flight

__all__ = ["SaveLine"]

T = TypeVar("T")


class SaveLine:
    """Background saves in lines, one per key (a run, a group of ranks, ``None``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[Hashable, list[SaveHandle[Any]]] = {}

    def pending(self, key: Hashable = None) -> list[SaveHandle[Any]]:
        """The saves on ``key``'s line not yet done, oldest first."""
        with self._lock:
            return [h for h in self._lines.get(key, ()) if not h.done()]

    def make_room(self, key: Hashable = None, limit: int = 1) -> None:
        """Block until fewer than ``limit`` saves on ``key``'s line are running, waiting
        for the oldest first. Does not raise: each save's outcome is its own handle's."""
        while True:
            running = self.pending(key)
            if len(running) < limit:
                return
            running[0].wait()

    def add(self, handle: SaveHandle[Any], key: Hashable = None) -> SaveHandle[Any] | None:
        """Put ``handle`` last on ``key``'s line and in the process's registry; returns
        the save before it while that one is still running (to wait for), else None."""
        with self._lock:
            line = [h for h in self._lines.get(key, ()) if not h.done()]
            previous = line[-1] if line else None
            self._lines[key] = [*line, handle]
        handle.add_done_callback(lambda done: self._drop(key, done))
        in_flight.add(handle)
        return previous

    def _drop(self, key: Hashable, handle: SaveHandle[Any]) -> None:
        with self._lock:
            line = self._lines.get(key, [])
            if handle in line:
                line.remove(handle)
            if not line:
                self._lines.pop(key, None)

    @staticmethod
    def run(
        handle: SaveHandle[T], work: Callable[[], T], after: SaveHandle[Any] | None = None
    ) -> None:
        """On this thread: wait for ``after`` (if given), call ``work()``, then finish
        ``handle`` with its result or its error (never raised here)."""
        if after is not None:
            after.wait()  # its outcome is its own handle's
        try:
            result = work()
        except BaseException as exc:
            handle.finish(None, exc)
            return
        handle.finish(result, None)

    @classmethod
    def start(
        cls,
        handle: SaveHandle[T],
        work: Callable[[], T],
        *,
        name: str,
        after: SaveHandle[Any] | None = None,
        daemon: bool = True,
    ) -> threading.Thread:
        """:meth:`run` on a new thread named ``name``, joined at exit (and noted as one
        that may run collectives on cloudckpt's groups); returns the started thread.
        ``daemon=False``: the interpreter joins it too (a save whose collectives must
        end before the process groups are destroyed)."""
        thread = threading.Thread(
            target=cls.run, args=(handle, work, after), name=name, daemon=daemon
        )
        in_flight.add_worker(thread)
        thread.start()
        return thread

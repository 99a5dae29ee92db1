"""The cyclic garbage collector paused around the library's own work, at its entry points.

Unpickling a checkpoint's structure (or DCP's ``.metadata``) allocates a few objects per
tensor; every 700 of them set off a collection, and the older generations' collections
walk every object alive, the state already loaded included. With 10,000 tensors that is
most of the time, and it grows faster than the count (``.metadata`` of 32,000 items:
2.3 s with the collector, 0.36 s without). Nothing these steps build is cyclic, so the
collector is paused around them and resumed after.

Only the public entry points pause (``save``, ``async_save``'s snapshot, ``load``, the
safetensors save and load, the DCP writer's and reader's calls, Megatron's save and
load, the manager's DCP calls), never a layer below them. Pauses nest and may overlap
across threads: the first to begin disables the collector if it was running, the last
to end enables it again. The state found is the state left: a program that disabled
its collector finds it disabled, and thresholds and frozen objects are not touched.
With the fast paths off (switch.py) nothing is paused.

What a pause built and keeps (a loaded state: tens of thousands of tensors and
containers) is still walked by the next collections of the young generations, about
10 us per tensor, more than building it took. With ``CLOUDCKPT_GC_FREEZE=1`` (or
``set_gc_freeze(True)``) a pause marked ``kept`` moves every tracked object into the
oldest generation when the collector resumes, with ``gc.freeze()`` then
``gc.unfreeze()`` (two list splices, no walk), as surviving two collections would.
That moves the program's own young objects too, so it is done only when asked. It is
skipped where anything is frozen already (``unfreeze`` would thaw what the program
froze); asking that (``gc.get_freeze_count()``) walks every frozen object, 23 ms for
665,000 of them here, so a pause that left few new objects (under ``FEW``) is not
moved, and a frozen heap, once seen, is taken as still frozen for ``RECHECK`` seconds.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

from .switch import fast_paths, gc_freeze

__all__ = ["FEW", "RECHECK", "paused_gc"]

#: A kept pause that left fewer new tracked objects than this is not moved.
FEW = 2000
#: Seconds a frozen heap, once seen, is taken as still frozen (not asked again).
RECHECK = 600.0

_lock = threading.Lock()
_depth = 0  # pauses under way, in every thread
_resume = False  # whether the first of them found the collector running
_kept = False  # whether one of them keeps what it built
_frozen_until = 0.0  # monotonic time until which the heap is taken as frozen


@contextlib.contextmanager
def paused_gc(*, kept: bool = False) -> Iterator[None]:
    """Pause the cyclic collector inside the block (if it was running), resume after;
    a decorator too. ``kept``: what the block builds is kept (a loaded state), moved to
    the oldest generation on resuming if the program opted in (see the module)."""
    if not fast_paths():
        yield
        return
    _begin(kept)
    try:
        yield
    finally:
        _end()


def _begin(kept: bool) -> None:
    global _depth, _resume, _kept
    with _lock:
        if not _depth:
            _resume, _kept = gc.isenabled(), False
            if _resume:
                gc.disable()
        _depth += 1
        _kept = _kept or kept


def _end() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth or not _resume:
            return
        if _kept and gc_freeze() and gc.get_count()[0] >= FEW:
            _to_oldest()
        gc.enable()


def _to_oldest() -> None:
    """Move every tracked object to the oldest generation, unless the program froze
    some (an unfreeze would thaw them). Called with ``_lock`` held."""
    global _frozen_until
    now = time.monotonic()
    if now < _frozen_until:
        return
    if gc.get_freeze_count():  # a walk of the frozen objects: once per RECHECK
        _frozen_until = now + RECHECK
        return
    gc.freeze()
    gc.unfreeze()

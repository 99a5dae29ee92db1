"""The cyclic garbage collector paused while thousands of objects are built at once.

Unpickling a checkpoint's structure (or DCP's ``.metadata``) allocates a few objects per
tensor; every 700 of them set off a collection, and the older generations' collections
walk every object alive, the state already loaded included. With 10,000 tensors that is
most of the time, and it grows faster than the count (``.metadata`` of 32,000 items:
2.3 s with the collector, 0.36 s without). Nothing these steps build is cyclic, so the
collector is paused around them and resumed after, as it was.

What such a block builds and keeps (a loaded state: tens of thousands of tensors and
containers) would still be walked by the next collections of the young generations,
about 10 us per tensor, more than building it took. ``kept=True`` moves every object
into the oldest generation when the collector resumes, with ``gc.freeze()`` then
``gc.unfreeze()`` (two list splices, no walk), as surviving two collections would; the
full collections that come later see them as they see any old object. It is skipped
where anything is frozen already: ``unfreeze`` would thaw what the program froze.

Asking whether anything is frozen (``gc.get_freeze_count()``) walks every frozen object:
23 ms for 665,000 of them here. A program that froze its heap after building its model
(as large training jobs do, and as forked ranks inherit it) paid that at every kept
block, five of them in a Megatron load. So a block that built few objects (under
``FEW``, which a young collection walks in well under a millisecond) is not moved at
all, and a frozen heap, once seen, is taken as still frozen for ``RECHECK`` seconds.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

__all__ = ["FEW", "RECHECK", "paused_gc"]

#: A kept block that left fewer new tracked objects than this is not moved.
FEW = 2000
#: Seconds a frozen heap, once seen, is taken as still frozen (not asked again).
RECHECK = 600.0

_lock = threading.Lock()
_frozen_until = 0.0  # monotonic time until which the heap is taken as frozen


@contextlib.contextmanager
def paused_gc(*, kept: bool = False) -> Iterator[None]:
    """Pause the cyclic collector inside the block (if it was running); resume after.
    ``kept``: what the block built is kept, so it goes straight to the oldest generation."""
    running = gc.isenabled()
    if running:
        gc.disable()
    try:
        yield
    finally:
        if running:
            if kept and gc.get_count()[0] >= FEW:
                _to_oldest()
            gc.enable()


def _to_oldest() -> None:
    """Move every tracked object to the oldest generation, unless the program froze
    some (an unfreeze would thaw them)."""
    global _frozen_until
    with _lock:
        now = time.monotonic()
        if now < _frozen_until:
            return
        if gc.get_freeze_count():  # a walk of the frozen objects: once per RECHECK
            _frozen_until = now + RECHECK
            return
        gc.freeze()
        gc.unfreeze()

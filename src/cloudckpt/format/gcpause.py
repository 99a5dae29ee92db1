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
where anything is frozen already (``gc.get_freeze_count()``): ``unfreeze`` would thaw
what the program froze.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


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
            if kept and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()

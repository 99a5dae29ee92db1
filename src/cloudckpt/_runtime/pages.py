"""Destination memory faulted in by the thread that plans a read, before bytes land in it.

A tensor made by ``torch.empty`` (or ``to_empty`` after a meta-device init) has no
pages yet: each is allocated and zeroed by the kernel on first write. When that first
write is a ``recv`` into thousands of small destinations, the faults happen one page at
a time inside the reading threads' calls, while the planning thread and the server
share the cores; measured on the 2-core development machine, a DCP load of 10,000
tensors of 16 KiB into fresh memory waited 0.1-0.45 s for its reads after planning,
against 0.05-0.1 s once the pages were faulted in beforehand (docs/dcp.md, "Fresh
destination memory"). :func:`populate` asks the kernel for the pages of a range in one
call (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+): no byte is written or read, pages
already there are left as they are.

Its check (``madvise_populate``, probes.py) finds libc's ``madvise`` and has it populate
a fresh page, which also says the kernel knows ``MADV_POPULATE_WRITE``; where that
fails (another OS, an older kernel), or with the fast paths off, :func:`populate` does
nothing and the pages fault in as they are written.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

from . import probes
from .memview import buffer_address

__all__ = ["populate", "populate_on"]

_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE

#: libc's ``madvise``, once its check found that it populates pages here.
_call: list[Callable[[int, int, int], int]] = []


def _check() -> None:
    """Find libc's ``madvise`` and populate one fresh page with it."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"MADV_POPULATE_WRITE is Linux's; this is {sys.platform}")
    # PyDLL: the call keeps the GIL (a few microseconds), so a reading thread does
    # not take it from the planner at every destination (see _runtime/memview.py).
    fn = ctypes.PyDLL(None, use_errno=True).madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    page = mmap.mmap(-1, _PAGE)
    try:
        if fn(buffer_address(page), _PAGE, _MADV_POPULATE_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) was refused")
        if page[:] != bytes(_PAGE):
            raise ValueError("populating a page changed its bytes")
    finally:
        page.close()
    _call[:] = [fn]


probes.register("madvise_populate", _check)


def populate_on() -> bool:
    """Whether :func:`populate` asks the kernel for pages here."""
    return probes.on("madvise_populate")


def populate(address: int, nbytes: int) -> None:
    """Fault in the pages under ``[address, address + nbytes)`` for writing, if the
    kernel can; a range it refuses (not ordinary memory) is left to fault as before."""
    if nbytes > 0 and probes.on("madvise_populate"):
        start = address - address % _PAGE
        _call[0](start, address + nbytes - start, _MADV_POPULATE_WRITE)

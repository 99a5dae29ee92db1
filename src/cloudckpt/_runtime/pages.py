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
already there are left as they are. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

from .memview import buffer_address

__all__ = ["POPULATE", "populate"]

_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, where this kernel knows MADV_POPULATE_WRITE; else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # PyDLL: the call keeps the GIL (a few microseconds), so a reading thread does
        # not take it from the planner at every destination (see _runtime/memview.py).
        fn = ctypes.PyDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    probe = mmap.mmap(-1, _PAGE)
    try:
        works = fn(buffer_address(probe), _PAGE, _MADV_POPULATE_WRITE) == 0
    finally:
        probe.close()
    return fn if works else None


_CALL = _madvise()

#: Whether :func:`populate` does anything here (Linux 5.14+).
POPULATE = _CALL is not None


def populate(address: int, nbytes: int) -> None:
    """Fault in the pages under ``[address, address + nbytes)`` for writing, if the
    kernel can; a range it refuses (not ordinary memory) is left to fault as before."""
    call = _CALL
    if call is not None and nbytes > 0:
        start = address - address % _PAGE
        call(start, address + nbytes - start, _MADV_POPULATE_WRITE)

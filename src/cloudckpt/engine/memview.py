"""Writable views of tensor memory, so network reads land in it without a copy."""

from __future__ import annotations

import ctypes

__all__ = ["writable_view"]

_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def writable_view(address: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` at ``address``; the caller keeps the owner alive.

    Made by ``PyMemoryView_FromMemory`` rather than a ctypes array type: a new array type
    per size would sit in reference cycles until the garbage collector runs.
    """
    if nbytes == 0:
        return memoryview(bytearray(0))
    view: memoryview = _from_memory(address, nbytes, _PYBUF_WRITE)
    return view

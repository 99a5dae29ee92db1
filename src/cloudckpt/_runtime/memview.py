"""Views of tensor memory: writable ones, so network reads land in it without a copy, and
the address behind a view, so a write can tell it is handed a tensor's own memory."""

from __future__ import annotations

import ctypes

__all__ = ["buffer_address", "copy_memory", "writable_view"]

_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200

#: ``memmove(dst, src, nbytes)`` between addresses, keeping the GIL. ``ctypes.memmove``
#: releases it around every call: with any other Python thread running (a data loader,
#: a logger), the caller then waits up to the switch interval (5 ms) to get it back, for
#: a copy of a few KiB. Measured on 10,000 tensors of 16 KiB with one busy thread: a
#: snapshot took 4.1 s that way, 0.17 s keeping the GIL (docs/async.md).
copy_memory = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value or 0
)


def writable_view(address: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` at ``address``; the caller keeps the owner alive.

    Made by ``PyMemoryView_FromMemory`` rather than a ctypes array type: a new array type
    per size would sit in reference cycles until the garbage collector runs.
    """
    if nbytes == 0:
        return memoryview(bytearray(0))
    view: memoryview = _from_memory(address, nbytes, _PYBUF_WRITE)
    return view


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable layout since Python 3.3)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.restype = ctypes.c_int
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.restype = None
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)


def buffer_address(obj: object) -> int:
    """The address of the first byte of a contiguous buffer (read-only ones too)."""
    info = _PyBuffer()
    _get_buffer(obj, ctypes.byref(info), 0)  # raises BufferError when it has none
    try:
        return int(info.buf or 0)
    finally:
        _release_buffer(ctypes.byref(info))

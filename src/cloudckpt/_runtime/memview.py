"""Views of tensor memory: writable ones, so network reads land in it without a copy, the
address behind a view, so a write can tell it is handed a tensor's own memory, and a
copy between addresses that keeps the GIL.

Two checks (probes.py) guard them: ``memory_views`` (:func:`writable_view` and
:func:`buffer_address` agree with a ``bytearray`` written through them) and
``gil_held_copy`` (:data:`copy_memory` copies exactly and keeps the GIL). Callers ask
:func:`views_on` / :func:`copy_on`; :func:`storage_view` and :func:`tensor_view` choose
by themselves. Their plain path, with the fast paths off, makes the view through the
DLPack protocol (numpy's ``from_dlpack``; a ``ctypes`` array where numpy is not
installed), with no call into CPython's C API.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

from . import probes

if TYPE_CHECKING:
    import torch

__all__ = [
    "buffer_address",
    "copy_memory",
    "copy_on",
    "storage_view",
    "tensor_view",
    "views_on",
    "writable_view",
]

log = logging.getLogger("cloudckpt")

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


# --- the checks, and who may use what ---------------------------------------------------


def _check_views() -> None:
    """Bytes written through a view made from an address land in the buffer there."""
    data = bytearray(64)
    writable_view(buffer_address(data) + 8, 16)[:] = bytes(range(1, 17))
    if data != bytes(8) + bytes(range(1, 17)) + bytes(40):
        raise ValueError("a view made from a buffer's address wrote elsewhere")
    if buffer_address(memoryview(data)[5:]) != buffer_address(data) + 5:
        raise ValueError("the address of a sliced view is not its first byte's")


def _check_copy() -> None:
    """:data:`copy_memory` keeps the GIL and copies exactly the bytes asked for."""
    if not getattr(copy_memory, "_flags_", 0) & ctypes._FUNCFLAG_PYTHONAPI:  # type: ignore[attr-defined]
        raise ValueError("the copy would release the GIL")
    if not views_on():
        raise ValueError("it is checked through buffer addresses, which are off")
    source = bytes(range(256)) * 16
    target = bytearray(len(source) + 2)
    copy_memory(buffer_address(target) + 1, buffer_address(source), len(source))
    if target[1:-1] != source or target[0] or target[-1]:
        raise ValueError("the copy wrote other bytes than memmove would")


probes.register("memory_views", _check_views)
probes.register("gil_held_copy", _check_copy)


def views_on() -> bool:
    """Whether :func:`writable_view` and :func:`buffer_address` may be used."""
    return probes.on("memory_views")


def copy_on() -> bool:
    """Whether :data:`copy_memory` may be used (else copy with torch or memoryviews)."""
    return probes.on("gil_held_copy")


# --- views of tensors and storages: the trick, or the plain path -------------------------


def storage_view(storage: torch.UntypedStorage) -> memoryview:
    """A writable byte view of a CPU storage's memory (no copy); the caller keeps the
    storage alive."""
    if views_on():
        return writable_view(storage.data_ptr(), storage.nbytes())
    import torch

    return _plain_view(torch.empty(0, dtype=torch.uint8).set_(storage))


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's elements (no copy); the caller
    keeps the tensor alive."""
    if views_on():
        return writable_view(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    import torch

    return _plain_view(tensor.detach().reshape(-1).view(torch.uint8))


_numpy: list[Any] = []  # numpy's from_dlpack where it gives writable arrays, else None


def _plain_view(flat: torch.Tensor) -> memoryview:
    """A writable view of a 1-D ``uint8`` CPU tensor through the DLPack protocol (numpy's
    ``from_dlpack``; the array holds the tensor, and unlike ``Tensor.numpy()`` it leaves
    the storage resizable); a ctypes array over it where numpy cannot."""
    if not _numpy:
        _numpy.append(_dlpack_importer())
    from_dlpack = _numpy[0]
    if from_dlpack is not None:
        return memoryview(from_dlpack(flat))
    nbytes = flat.numel()
    if not nbytes:
        return memoryview(bytearray(0))
    array = (ctypes.c_uint8 * nbytes).from_address(flat.data_ptr())
    array._owner = flat  # type: ignore[attr-defined]  # the view keeps the tensor alive
    return memoryview(array).cast("B")


def _dlpack_importer() -> Any:
    """numpy's ``from_dlpack``, where it makes writable arrays of torch tensors; else None."""
    try:
        import numpy
        import torch

        probe = numpy.from_dlpack(torch.zeros(1, dtype=torch.uint8))
        if probe.flags.writeable:
            return numpy.from_dlpack
        reason = "its arrays are read-only"
    except Exception as exc:  # no numpy, or one without DLPack
        reason = f"{type(exc).__name__}: {exc}"
    log.debug("cloudckpt: plain views of tensor memory are ctypes arrays (numpy: %s)", reason)
    return None

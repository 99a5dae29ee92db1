"""Unpickling a ``torch.save`` archive's ``data.pkl`` with our own storage loader.

``weights_only=True`` (the default, as in ``torch.load``) uses torch's restricted
unpickler, which only builds tensors, containers and allow-listed globals; anything
else raises :class:`~cloudckpt.errors.UnsafeCheckpointError`. ``weights_only=False``
is an explicit opt-in to full pickle for trusted files.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CloudCkptError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["StorageRef", "parse_persistent_id", "unpickle"]


class StorageRef:
    """What ``data.pkl`` says about one storage record."""

    __slots__ = ("dtype", "key", "location", "nbytes")

    def __init__(self, key: str, dtype: torch.dtype, location: str, nbytes: int) -> None:
        self.key = key
        self.dtype = dtype
        self.location = location
        self.nbytes = nbytes


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


_dtypes: dict[Any, torch.dtype | None] = {torch.UntypedStorage: torch.uint8}


def _storage_dtype(storage_type: Any) -> torch.dtype | None:
    """The element type of a storage class (legacy classes warn on ``.dtype``; ask once)."""
    try:
        return _dtypes[storage_type]
    except (KeyError, TypeError):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = getattr(storage_type, "dtype", None)
    found = found if isinstance(found, torch.dtype) else None
    with contextlib.suppress(TypeError):  # unhashable: not a storage class anyway
        _dtypes[storage_type] = found
    return found


def parse_persistent_id(saved_id: Any, url: str) -> StorageRef:
    """Decode ``('storage', storage_type, key, location, numel)``."""
    if not isinstance(saved_id, tuple) or len(saved_id) != 5 or _text(saved_id[0]) != "storage":
        raise CorruptCheckpointError(f"{url}: unexpected persistent id {saved_id!r} in data.pkl")
    _, storage_type, key, location, numel = saved_id
    found = _storage_dtype(storage_type)
    if not isinstance(found, torch.dtype):
        raise CorruptCheckpointError(f"{url}: unknown storage type {storage_type!r}")
    dtype: torch.dtype = found
    if not isinstance(numel, int) or numel < 0:
        raise CorruptCheckpointError(f"{url}: bad element count {numel!r} for storage {key!r}")
    return StorageRef(_text(key), dtype, _text(location), numel * dtype.itemsize)


class _FullUnpickler(pickle.Unpickler):
    """Plain pickle, with torch's renames of moved modules (as ``torch.load`` applies)."""

    def find_class(self, module: str, name: str) -> Any:
        mapping = getattr(torch.serialization, "load_module_mapping", {})
        return super().find_class(mapping.get(module, module), name)


def _refused(url: str, exc: BaseException) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{url} holds objects that weights_only loading does not allow: {exc}. If you "
        "trust this file, pass weights_only=False; to allow a specific class, use "
        "torch.serialization.add_safe_globals([...])."
    )


def unpickle(
    data: bytes | bytearray | memoryview,
    persistent_load: Callable[[Any], Any],
    *,
    weights_only: bool,
    url: str,
) -> Any:
    """Run the unpickler over ``data`` with ``persistent_load`` supplying storages."""
    stream = io.BytesIO(data)
    if weights_only:
        from torch import _weights_only_unpickler

        unpickler: Any = _weights_only_unpickler.Unpickler(stream, encoding="utf-8")
    else:
        unpickler = _FullUnpickler(stream, encoding="utf-8")
    unpickler.persistent_load = persistent_load
    try:
        result = unpickler.load()
    except pickle.UnpicklingError as exc:
        if not weights_only or isinstance(exc, UnsafeCheckpointError):
            raise CorruptCheckpointError(f"{url}: data.pkl cannot be unpickled: {exc}") from exc
        raise _refused(url, exc) from exc
    except RuntimeError as exc:
        # torch before 2.5 raises RuntimeError("Unsupported global: ...") where later
        # releases raise UnpicklingError; our own errors pass through.
        if not weights_only or isinstance(exc, CloudCkptError):
            raise
        raise _refused(url, exc) from exc
    except (EOFError, ValueError, IndexError, struct.error) as exc:
        raise CorruptCheckpointError(f"{url}: data.pkl is damaged: {exc}") from exc
    torch._utils._validate_loaded_sparse_tensors()
    return result

"""Unpickling a ``torch.save`` archive's ``data.pkl`` with our own storage loader.

``weights_only=True`` (the default, as in ``torch.load``) allows exactly the globals
torch's weights-only loader allows (its built-in list and what the user added with
``torch.serialization.add_safe_globals`` / ``safe_globals``); any other global raises
:class:`~cloudckpt.errors.UnsafeCheckpointError` with torch's message. It runs that
allow-list as the ``find_class`` of the C unpickler rather than through torch's
pure-Python one: every global a pickle can reach, and so every callable ``REDUCE``,
``NEWOBJ`` or ``BUILD`` can run, comes through ``find_class`` (docs/format.md, "Safety",
says what that does and does not cover). ``weights_only=False`` is an explicit opt-in to
full pickle for trusted files.

Plain CPU tensors are rebuilt by the function :func:`_rebuilder` makes, which does what
``torch._utils._rebuild_tensor_v2`` does without its per-tensor fake-mode lookup (made
once per load instead); everything else goes through torch's own rebuild functions.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import warnings
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CloudCkptError, CorruptCheckpointError, UnsafeCheckpointError
from .gcpause import paused_gc

__all__ = ["StorageRef", "parse_persistent_id", "typed_storage", "unpickle"]


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
    if type(saved_id) is tuple and len(saved_id) == 5:  # as torch writes it: checked fast
        tag, storage_type, key, location, numel = saved_id
        if (
            tag == "storage"
            and type(key) is str
            and type(location) is str
            and type(numel) is int
            and numel >= 0
        ):
            try:
                known = _dtypes.get(storage_type)
            except TypeError:  # unhashable: the full decode below names it
                known = None
            if known is not None:
                return StorageRef(key, known, location, numel * known.itemsize)
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


_TypedStorage = torch.storage.TypedStorage
_new_object = object.__new__
_fast_typed: list[bool] = []


def typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> Any:
    """``TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)``, a third of
    the cost: its ``__init__`` only checks its arguments and sets these two attributes.
    The first call compares the result with the constructor's; if they differ, the
    constructor is used from then on."""
    if not _fast_typed:
        slow = _TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        fast = _new_object(_TypedStorage)
        fast.dtype, fast._untyped_storage = dtype, storage
        _fast_typed.append(
            vars(slow).keys() == vars(fast).keys()
            and all(vars(slow)[k] is vars(fast)[k] for k in vars(slow))
        )
    if _fast_typed[0]:
        typed = _new_object(_TypedStorage)
        typed.dtype = dtype
        typed._untyped_storage = storage
        return typed
    return _TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


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


class _Refused(pickle.UnpicklingError):
    """A global the weights-only allow-list does not hold."""


class _TorchUnpicklerNeeded(Exception):
    """A global whose weights-only handling only torch's own unpickler has."""


def _needs_torch(full_path: str, found: Any) -> bool:
    """A global torch's weights-only unpickler treats specially (legacy sparse tensor
    classes, which it records for validation): the load falls back to that unpickler."""
    return found in torch._tensor_classes and "sparse" in full_path


def _unsupported(module: str, name: str) -> _Refused:
    """The error torch's weights-only unpickler raises for a global it does not allow."""
    full_path = f"{module}.{name}"
    if full_path.startswith(("torch.nested._internal.", "torch._dynamo.decorators._DimRange")):
        return _Refused(
            "``torch.nested`` and ``torch._dynamo`` must be imported to load nested jagged "
            "tensors (NJTs)"
        )
    if full_path.startswith("torch.distributed.") and (
        "tensor" in full_path or "device_mesh" in full_path
    ):
        return _Refused("``torch.distributed.tensor`` must be imported to load DTensors")
    shown = name if module == "builtins" else full_path
    return _Refused(
        f"Unsupported global: GLOBAL {shown} was not an allowed global by default. Please "
        f"use `torch.serialization.add_safe_globals([{shown}])` or the "
        f"`torch.serialization.safe_globals([{shown}])` context manager to allowlist this "
        "global if you trust this class/function."
    )


def _rebuilder(spares: dict[int, torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch._utils._rebuild_tensor_v2`` for CPU storages with no fake mode active.

    ``spares`` maps ``id(storage)`` to a fresh tensor of the storage's dtype that nothing
    else refers to: the first tensor over that storage is that one, ``set_`` to its
    place (one torch call instead of two). A closure over it, not a ``partial``: the
    pickle calls this once per tensor."""
    pop = spares.pop
    typed_class = torch.storage.TypedStorage
    new_empty = torch.empty

    def rebuild(
        storage: Any,
        storage_offset: int,
        size: Any,
        stride: Any,
        requires_grad: bool,
        backward_hooks: Any,
        metadata: Any = None,
    ) -> torch.Tensor:
        spare = pop(id(storage), None)
        if spare is None:  # (a spare is only made for a plain CPU storage)
            if type(storage) is not typed_class or storage._untyped_storage.device.type != "cpu":
                return _torch_rebuild_v2(
                    storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata
                )
            spare = new_empty((0,), dtype=storage.dtype)
        tensor = spare.set_(storage._untyped_storage, storage_offset, size, stride)
        if requires_grad:
            tensor.requires_grad = True
        if metadata:
            torch._utils.set_tensor_metadata(tensor, metadata)
        tensor._backward_hooks = backward_hooks
        return tensor

    return rebuild


_torch_rebuild_v2 = torch._utils._rebuild_tensor_v2


def _allowed_globals(spares: dict[int, torch.Tensor] | None = None) -> dict[str, Any] | None:
    """What torch's weights-only loader allows right now (its list, then the user's),
    or None where this torch does not expose them (then torch's unpickler is used)."""
    try:
        from torch import _weights_only_unpickler as wo

        allowed = dict(wo._get_allowed_globals())
        allowed.update(wo._get_user_allowed_globals())
        blocked = tuple(getattr(wo, "_blocklisted_modules", ()))
    except (ImportError, AttributeError):
        return None
    for module in blocked:
        for path in [p for p in allowed if p.split(".", 1)[0] == module]:
            del allowed[path]
    if allowed.get("torch._utils._rebuild_tensor_v2") is _torch_rebuild_v2:
        from torch._guards import detect_fake_mode

        if detect_fake_mode(None) is None:
            rebuild = _rebuilder({} if spares is None else spares)
            allowed["torch._utils._rebuild_tensor_v2"] = rebuild
    return allowed


class _AllowListUnpickler(pickle.Unpickler):
    """The C unpickler, with ``find_class`` limited to the weights-only allow-list."""

    def __init__(self, file: Any, allowed: dict[str, Any], *, encoding: str) -> None:
        super().__init__(file, encoding=encoding)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names, as torch's unpickler maps them (torch.save writes protocol 2,
        # so ``builtins.set`` is stored as ``__builtin__.set``).
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        full_path = f"{module}.{name}"
        found = self._allowed.get(full_path)
        if found is None:
            raise _unsupported(module, name)
        if _needs_torch(full_path, found):
            raise _TorchUnpicklerNeeded(full_path)
        return found


def _unpickler(
    data: bytes | bytearray | memoryview, weights_only: bool, allowed: dict[str, Any] | None
) -> Any:
    stream = io.BytesIO(data)
    if not weights_only:
        return _FullUnpickler(stream, encoding="utf-8")
    if allowed is not None:
        return _AllowListUnpickler(stream, allowed, encoding="utf-8")
    from torch import _weights_only_unpickler

    return _weights_only_unpickler.Unpickler(stream, encoding="utf-8")


def unpickle(
    data: bytes | bytearray | memoryview,
    persistent_load: Callable[[Any], Any],
    *,
    weights_only: bool,
    url: str,
    spares: dict[int, torch.Tensor] | None = None,
) -> Any:
    """Run the unpickler over ``data`` with ``persistent_load`` supplying storages
    (``persistent_load`` must return the same object when asked for a storage again:
    a pickle torch's own unpickler must handle is read a second time by it).

    ``spares``: tensors the first rebuild over a storage may take (see
    :func:`_rebuilder`); ``persistent_load`` may add to it as it goes."""
    allowed = _allowed_globals(spares) if weights_only else None
    try:
        return _run(_unpickler(data, weights_only, allowed), persistent_load, weights_only, url)
    except (_TorchUnpicklerNeeded, MemoryError):
        if allowed is None:
            raise
        # MemoryError: the C unpickler sizes its memo by the largest index a pickle names,
        # so a forged LONG_BINPUT asks for gigabytes; torch's unpickler keeps a dict.
        return _run(_unpickler(data, weights_only, None), persistent_load, weights_only, url)


def _run(
    unpickler: Any, persistent_load: Callable[[Any], Any], weights_only: bool, url: str
) -> Any:
    unpickler.persistent_load = persistent_load
    try:
        with paused_gc(kept=True):
            result = unpickler.load()
    except _TorchUnpicklerNeeded:
        raise
    except pickle.UnpicklingError as exc:
        # The C unpickler's own errors are damage; torch's unpickler raises the same
        # class for a refused global and for damage alike, and is taken at its word.
        damaged = isinstance(unpickler, _AllowListUnpickler) and not isinstance(exc, _Refused)
        if not weights_only or damaged or isinstance(exc, UnsafeCheckpointError):
            raise CorruptCheckpointError(f"{url}: data.pkl cannot be unpickled: {exc}") from exc
        raise _refused(url, exc) from exc
    except RuntimeError as exc:
        # torch before 2.5 raises RuntimeError("Unsupported global: ...") where later
        # releases raise UnpicklingError; our own errors pass through.
        if not weights_only or isinstance(exc, CloudCkptError):
            raise
        raise _refused(url, exc) from exc
    except (EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{url}: data.pkl is damaged: {exc}") from exc
    except (OverflowError, struct.error) as exc:
        raise CorruptCheckpointError(f"{url}: data.pkl is damaged: {exc}") from exc
    torch._utils._validate_loaded_sparse_tensors()
    return result

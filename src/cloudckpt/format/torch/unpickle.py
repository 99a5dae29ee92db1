"""Torch archives through the trust boundary: ``data.pkl`` and whole archives in memory.

Every ``weights_only=True`` unpickle of a torch archive runs the restricted pickle
machine (format/torch/restricted_pickle.py) under :func:`weights_only_policy`: exactly the
globals ``torch.load(weights_only=True)`` allows at that moment (its list, then the
user's ``add_safe_globals``/``safe_globals``), with torch's opcode set. This module adds
what is particular to torch archives: persistent ids naming storages, the fast rebuild
of plain CPU tensors, :func:`load_torch_bytes` for an archive held in memory, the error
for a device that is not there, and the switch.

The switch: ``CLOUDCKPT_UNPICKLER=torch`` (or :func:`set_unpickler`) sends every
weights-only unpickle of a torch archive through torch's own weights-only unpickler
instead (slower; the reference itself). ``weights_only=False`` is an explicit opt-in to
full pickle for files you trust.

Plain CPU tensors are rebuilt by the function :func:`_rebuilder` makes, which does what
``torch._utils._rebuild_tensor_v2`` does without its per-tensor fake-mode lookup (made
once per load instead); everything else goes through torch's own rebuild functions.
That, and :func:`typed_storage`'s shortcut, are fast paths: each checks itself against
torch's own function once (``fast_rebuild``, ``typed_storage``: _runtime/probes.py), and
with the fast paths off torch's functions do all the work.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._runtime import probes
from ..._runtime.memview import storage_view
from ...errors import CloudCkptError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from .restricted_pickle import (
    TORCH_OPCODES,
    Policy,
    Refused,
    as_text,
    check_extent,
    check_materialised,
    run_restricted,
    short,
    sparse_queue,
    validate_sparse,
)
from .storages import fixed_storage

__all__ = [
    "StorageRef",
    "StorageStandIn",
    "byte_order",
    "load_torch_bytes",
    "parse_persistent_id",
    "rebuilds_mapped",
    "set_unpickler",
    "typed_storage",
    "unpickle",
    "unpickler_choice",
    "weights_only_policy",
]


# --- persistent ids -----------------------------------------------------------------


class StorageRef:
    """What ``data.pkl`` says about one storage record."""

    __slots__ = ("dtype", "key", "location", "nbytes")

    def __init__(self, key: str, dtype: torch.dtype, location: str, nbytes: int) -> None:
        self.key = key
        self.dtype = dtype
        self.location = location
        self.nbytes = nbytes


def _storage_classes() -> dict[Any, torch.dtype]:
    """Every storage class a persistent id may name, and its element type: a fixed
    table made once at import, so nothing read from a file is ever added to it."""
    import warnings

    table: dict[Any, torch.dtype] = {torch.UntypedStorage: torch.uint8}
    with warnings.catch_warnings():  # legacy classes warn on ``.dtype``
        warnings.simplefilter("ignore")
        for module in (torch, getattr(torch, "cuda", None)):
            for name in dir(module):
                if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                    cls = getattr(module, name, None)
                    dtype = getattr(cls, "dtype", None) if isinstance(cls, type) else None
                    if isinstance(dtype, torch.dtype):
                        table[cls] = dtype
    return table


_STORAGE_DTYPES = _storage_classes()
_StorageType = getattr(torch.serialization, "StorageType", None)


class StorageStandIn:
    """A storage class as a pickle that builds no tensor names it: its element type,
    and nothing to call (the DCP layout parse, format/dcp/archive.py)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def parse_persistent_id(saved_id: Any, url: str) -> StorageRef:
    """Decode ``('storage', storage_type, key, location, numel)``; anything else is
    damage (the restricted machine has already refused ids of other kinds)."""
    if type(saved_id) is not tuple or len(saved_id) != 5:
        raise CorruptCheckpointError(f"{url}: unexpected persistent id in data.pkl")
    tag, storage_type, key, location, numel = saved_id
    try:
        dtype = _STORAGE_DTYPES.get(storage_type)
    except TypeError:  # unhashable: not a storage class
        dtype = None
    if dtype is None and type(storage_type) is StorageStandIn:
        dtype = storage_type.dtype
    if dtype is None and type(storage_type) is _StorageType:
        # torch's allow-list names legacy storage classes by these stand-ins
        found = storage_type.dtype
        dtype = found if isinstance(found, torch.dtype) else None
    if dtype is None or as_text(tag) != "storage":
        raise CorruptCheckpointError(
            f"{url}: a persistent id in data.pkl names {type(storage_type).__name__}, "
            "not a storage class"
        )
    key_text, location_text = as_text(key), as_text(location)
    if key_text is None or location_text is None:
        raise CorruptCheckpointError(f"{url}: malformed storage reference in data.pkl")
    if type(numel) is not int or numel < 0:
        count = repr(numel) if type(numel) is int else type(numel).__name__  # no repr of a storage
        raise CorruptCheckpointError(f"{url}: bad element count {count} for storage {key_text!r}")
    return StorageRef(key_text, dtype, location_text, numel * dtype.itemsize)


_TypedStorage = torch.storage.TypedStorage
_new_object = object.__new__


def _check_typed() -> None:
    """The shortcut makes what the constructor makes (the same attributes, the same
    objects in them)."""
    storage = torch.UntypedStorage(8)
    slow = _TypedStorage(wrap_storage=storage, dtype=torch.float16, _internal=True)
    fast = _new_object(_TypedStorage)
    fast.dtype, fast._untyped_storage = torch.float16, storage
    if vars(slow).keys() != vars(fast).keys() or any(
        vars(slow)[k] is not vars(fast)[k] for k in vars(slow)
    ):
        raise ValueError("TypedStorage's constructor sets other attributes")


probes.register("typed_storage", _check_typed)


def typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> Any:
    """``TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)``, a third of
    the cost: its ``__init__`` only checks its arguments and sets these two attributes.
    Checked once against the constructor (``typed_storage``, _runtime/probes.py); the
    constructor is used where that failed or the fast paths are off."""
    if probes.on("typed_storage"):
        typed = _new_object(_TypedStorage)
        typed.dtype = dtype
        typed._untyped_storage = storage
        return typed
    return _TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


# --- the policy of torch's weights-only load ----------------------------------------------


def _unsupported(module: str, name: str) -> Refused:
    """The error torch's weights-only unpickler raises for a global it does not allow."""
    full_path = f"{module}.{name}"
    if full_path.startswith(("torch.nested._internal.", "torch._dynamo.decorators._DimRange")):
        return Refused(
            "``torch.nested`` and ``torch._dynamo`` must be imported to load nested jagged "
            "tensors (NJTs)"
        )
    if full_path.startswith("torch.distributed.") and (
        "tensor" in full_path or "device_mesh" in full_path
    ):
        return Refused("``torch.distributed.tensor`` must be imported to load DTensors")
    shown = name if module == "builtins" else full_path
    return Refused(
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
    checked_v2 = _bounded(_torch_rebuild_v2)
    quantized = _QUANTIZED

    def rebuild(
        storage: Any,
        storage_offset: int,
        size: Any,
        stride: Any,
        requires_grad: bool,
        backward_hooks: Any,
        metadata: Any = None,
    ) -> torch.Tensor:
        if type(storage) is not typed_class or storage._untyped_storage.device.type != "cpu":
            return checked_v2(
                storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata
            )
        dtype = storage.dtype
        if dtype in quantized:
            return checked_v2(  # refuses it
                storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata
            )
        untyped = storage._untyped_storage
        check_extent(untyped.nbytes(), storage_offset, size, stride, dtype.itemsize)
        spare = pop(id(storage), None)
        if spare is None:  # (a spare is only made for a plain CPU storage)
            spare = new_empty((0,), dtype=dtype)
        tensor = spare.set_(untyped, storage_offset, size, stride)
        if requires_grad is not False:
            tensor.requires_grad = requires_grad  # torch's check: a bool
        if metadata:
            torch._utils.set_tensor_metadata(tensor, metadata)
        tensor._backward_hooks = backward_hooks
        return tensor

    return rebuild


_torch_rebuild_v2 = torch._utils._rebuild_tensor_v2
_torch_rebuild_qtensor = torch._utils._rebuild_qtensor
#: Quantized dtypes: a tensor of one without a quantizer crashes what reads it.
_QUANTIZED = frozenset(
    getattr(torch, n)
    for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, n)
)


def _bounded(rebuild: Callable[..., Any], dtype_at: int | None = None) -> Callable[..., Any]:
    """``rebuild`` (torch's ``(storage, storage_offset, size, stride, ...)``), after a
    check that the view lies inside the storage (``dtype_at``: the argument holding the
    dtype, where the storage is untyped)."""

    plain = rebuild is not _torch_rebuild_qtensor

    def checked(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        dtype = rest[dtype_at - 4] if dtype_at is not None else storage.dtype
        if plain and dtype in _QUANTIZED:
            raise Refused(
                f"a plain tensor over a {dtype} storage (torch.save writes those "
                "with _rebuild_qtensor, which gives them their quantizer)"
            )
        check_extent(storage.nbytes(), storage_offset, size, stride, dtype.itemsize)
        if not plain:  # allocates a quantized tensor of ``size``, then sets it over storage
            check_materialised(storage, dtype, size)
        return rebuild(storage, storage_offset, size, stride, *rest)

    return checked


def _check_rebuild() -> None:
    """The fast rebuild makes the tensor ``torch._utils._rebuild_tensor_v2`` makes, over
    the same storage, for the cases a load meets."""
    storage = torch.arange(24, dtype=torch.float32).untyped_storage()
    rebuild = _rebuilder({})
    cases = [(0, (2, 3), (3, 1), False), (5, (3, 2), (1, 4), True), (24, (0,), (1,), False)]
    for offset, size, stride, grad in cases:
        hooks: dict[Any, Any] = collections.OrderedDict()
        theirs = _torch_rebuild_v2(
            typed_storage(storage, torch.float32), offset, size, stride, grad, hooks
        )
        ours = rebuild(typed_storage(storage, torch.float32), offset, size, stride, grad, hooks)
        layout = (ours.dtype, ours.shape, ours.stride(), ours.storage_offset())
        same = (
            type(ours) is type(theirs)
            and layout == (theirs.dtype, theirs.shape, theirs.stride(), theirs.storage_offset())
            and ours.requires_grad == theirs.requires_grad
            and ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr()
            and ours._backward_hooks is theirs._backward_hooks
            and torch.equal(ours.detach(), theirs.detach())
        )
        if not same:
            raise ValueError(f"a tensor at {offset}, {size}, {stride} differs from torch's")


probes.register("fast_rebuild", _check_rebuild)


#: torch's rebuild functions over a storage, by name: the one whose dtype argument says
#: how to read an untyped storage gives its position.
_OVER_A_STORAGE = {
    "torch._utils._rebuild_tensor": None,
    "torch._utils._rebuild_tensor_v2": None,
    "torch._utils._rebuild_tensor_v3": 6,
    "torch._utils._rebuild_qtensor": None,
}


def _torch_allowed() -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """torch's weights-only allow-list right now (its own, then the user's) and its
    blocked modules, or None where this torch does not expose them."""
    try:
        from torch import _weights_only_unpickler as wo

        # torch looks in its own list first: a user entry under the same name loses
        allowed = dict(wo._get_user_allowed_globals())
        allowed.update(wo._get_allowed_globals())
        blocked = tuple(getattr(wo, "_blocklisted_modules", ()))
    except (ImportError, AttributeError):
        return None
    return allowed, blocked


def weights_only_policy(spares: dict[int, torch.Tensor] | None = None) -> Policy | None:
    """The policy of ``torch.load(weights_only=True)`` as it stands now (the user's
    allowed globals are read at each load, as torch reads them), or None where this
    torch does not expose its list (then torch's own unpickler is used)."""
    found = _torch_allowed()
    if found is None:
        return None
    allowed, blocked = found
    for path in [p for p in allowed if p.split(".", 1)[0] in blocked]:
        del allowed[path]
    calls: dict[int, Callable[..., Any]] = {}
    for path, dtype_at in _OVER_A_STORAGE.items():
        if path in allowed:
            calls[id(allowed[path])] = _bounded(allowed[path], dtype_at)
    if allowed.get("torch._utils._rebuild_tensor_v2") is _torch_rebuild_v2 and probes.on(
        "fast_rebuild"
    ):
        from torch._guards import detect_fake_mode

        if detect_fake_mode(None) is None:
            calls[id(_torch_rebuild_v2)] = _rebuilder({} if spares is None else spares)
    return Policy(globals=allowed, opcodes=TORCH_OPCODES, refuse_global=_unsupported, calls=calls)


# --- the switch -------------------------------------------------------------------------

_CHOICES = ("cloudckpt", "torch")
_choice: list[str] = []


def set_unpickler(name: str | None) -> None:
    """Which weights-only unpickler reads torch archives: ``"cloudckpt"`` (the default),
    ``"torch"`` (torch's own, slower), or None to follow ``CLOUDCKPT_UNPICKLER`` again."""
    if name is not None and name not in _CHOICES:
        raise ConfigError(f"unpickler must be one of {_CHOICES}, not {name!r}")
    _choice[:] = [] if name is None else [name]


def unpickler_choice() -> str:
    """The unpickler in force: :func:`set_unpickler`'s, else ``CLOUDCKPT_UNPICKLER``'s."""
    if _choice:
        return _choice[0]
    name = os.environ.get("CLOUDCKPT_UNPICKLER", "cloudckpt").strip().lower() or "cloudckpt"
    if name not in _CHOICES:
        raise ConfigError(f"CLOUDCKPT_UNPICKLER must be one of {_CHOICES}, not {name!r}")
    return name


# --- entry points -----------------------------------------------------------------------


class _FullUnpickler(pickle.Unpickler):
    """Plain pickle, with torch's renames of moved modules (as ``torch.load`` applies)."""

    def find_class(self, module: str, name: str) -> Any:
        mapping = getattr(torch.serialization, "load_module_mapping", {})
        return super().find_class(mapping.get(module, module), name)


def _torch_unpickle(
    data: bytes | bytearray | memoryview, persistent_load: Callable[[Any], Any], url: str
) -> Any:
    """torch's own weights-only unpickler (the switch, or a torch with no list)."""
    from torch import _weights_only_unpickler

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        return unpickler.load()
    except CloudCkptError:
        raise
    except pickle.UnpicklingError as exc:  # torch's refusal
        raise UnsafeCheckpointError(f"{url}: data.pkl is refused by torch: {exc}") from None
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{url}: data.pkl is not a valid pickle ({type(exc).__name__}: {short(exc)})"
        ) from None


def _full_unpickle(
    data: bytes | bytearray | memoryview, persistent_load: Callable[[Any], Any], url: str
) -> Any:
    """Full pickle (``weights_only=False``: the caller trusts the file)."""
    unpickler = _FullUnpickler(io.BytesIO(data), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    try:
        return unpickler.load()
    except CloudCkptError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{url}: data.pkl cannot be unpickled ({type(exc).__name__}: {short(exc)})"
        ) from None


def unpickle(
    data: bytes | bytearray | memoryview,
    persistent_load: Callable[[Any], Any],
    *,
    weights_only: bool,
    url: str,
    spares: dict[int, torch.Tensor] | None = None,
    sparse: list[Any] | None = None,
    map_location: Any = None,
    settle: Callable[[], None] | None = None,
) -> Any:
    """Unpickle a torch archive's ``data.pkl``, ``persistent_load`` supplying storages
    (it must return the same object when asked for a storage again).

    ``spares``: tensors the first rebuild over a storage may take (see
    :func:`_rebuilder`); ``persistent_load`` may add to it as it goes. ``sparse``: where
    the storages' bytes are still being read, a list that receives the sparse tensors
    built, for the caller to check with ``validate_sparse`` once the bytes are in (else
    they are checked before this returns, as ``torch.load`` checks them).
    ``map_location``: the load's, for torch's rebuilds that place a tensor on a device
    themselves (``torch.load`` hands it to them the same way, in its thread state)."""
    with rebuilds_mapped(map_location):
        return _unpickle(data, persistent_load, weights_only, url, spares, sparse, settle)


@contextlib.contextmanager
def rebuilds_mapped(map_location: Any) -> Iterator[None]:
    """While it lasts, torch's rebuilds that place a tensor on a device themselves
    (``_rebuild_device_tensor_from_cpu_tensor``...) map it by ``map_location``, as under
    ``torch.load``, which hands it to them in its thread state. None: left as it is."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if tls is None or map_location is None:
        yield
        return
    before = getattr(tls, "map_location", None)
    tls.map_location = map_location
    try:
        yield
    finally:
        tls.map_location = before


def _unpickle(
    data: bytes | bytearray | memoryview,
    persistent_load: Callable[[Any], Any],
    weights_only: bool,
    url: str,
    spares: dict[int, torch.Tensor] | None,
    sparse: list[Any] | None,
    settle: Callable[[], None] | None,
) -> Any:
    policy = None
    if weights_only and unpickler_choice() == "cloudckpt":
        policy = weights_only_policy(spares)
    if policy is not None:
        return run_restricted(data, policy, persistent_load, url, sparse=sparse, settle=settle)
    if settle is not None:  # torch's unpickler, or full pickle, may touch any tensor
        settle()
    queue = sparse_queue()
    try:
        if weights_only:
            result = _torch_unpickle(data, persistent_load, url)
        else:
            result = _full_unpickle(data, persistent_load, url)
        built = list(queue)
    finally:
        queue.clear()
    if sparse is None:
        validate_sparse(built, url)
    else:
        sparse.extend(built)
    return result


def load_torch_bytes(
    data: bytes | bytearray | memoryview,
    *,
    map_location: Any = None,
    weights_only: bool = True,
    url: str = "<bytes>",
) -> Any:
    """Load a whole ``torch.save`` archive held in memory (a DCP byte item, a test's
    file) through the boundary: every record checked by its CRC-32 first."""
    from .zipdir import check_records, inflate

    view = memoryview(data)
    directory = check_records(view, url)
    entries = directory.entries
    names = [n for n in entries if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(names) != 1:
        raise CorruptCheckpointError(f"{url} is not a torch archive (no single data.pkl)")
    prefix = names[0][: -len("data.pkl")]

    def record(name: str) -> memoryview | None:
        """A record's bytes (inflated where deflated; check_records checked both)."""
        entry = entries.get(name)
        if entry is None:
            return None
        stored = view[entry.data_offset : entry.end]
        return stored if entry.method == 0 else memoryview(inflate(stored, entry.size))

    swap = byte_order(record(prefix + "byteorder"), url) != sys.byteorder
    restore = torch.serialization._get_restore_location(map_location)
    loaded: dict[str, Any] = {}

    def persistent_load(saved_id: Any) -> Any:
        ref = parse_persistent_id(saved_id, url)
        found = loaded.get(ref.key)
        if found is not None:
            return found
        raw = record(f"{prefix}data/{ref.key}")
        if raw is None or len(raw) != ref.nbytes:
            raise CorruptCheckpointError(
                f"{url}: storage record data/{ref.key} is missing or not {ref.nbytes} bytes"
            )
        storage = fixed_storage(ref.nbytes)
        if ref.nbytes:  # (the record may be read-only: copied, never wrapped)
            storage_view(storage)[:] = raw
        if swap:
            storage.byteswap(ref.dtype)
        storage = restore_location(restore, storage, ref.location, map_location, url)
        found = torch.storage.TypedStorage(wrap_storage=storage, dtype=ref.dtype, _internal=True)
        if ref.nbytes:  # as torch.load: an empty storage is made anew at each reference
            loaded[ref.key] = found
        return found

    pkl = record(names[0])
    assert pkl is not None
    return unpickle(
        pkl, persistent_load, weights_only=weights_only, url=url, map_location=map_location
    )


def byte_order(record: bytes | bytearray | memoryview | None, url: str) -> str:
    """The byte order a ``byteorder`` record names (``"little"`` where there is none, as
    torch reads archives written before it); anything but ``little`` or ``big`` is
    damage, as ``torch.load`` refuses it ("Unknown endianness type")."""
    if record is None:
        return "little"
    found = bytes(record)
    if found not in (b"little", b"big"):
        raise CorruptCheckpointError(
            f"{url}: its byteorder record says {found[:32]!r}, neither 'little' nor 'big'"
        )
    return found.decode()


def restore_location(
    restore: Callable[[Any, str], Any], storage: Any, location: str, map_location: Any, url: str
) -> Any:
    """``restore(storage, location)``, where a device that is not there is a clear
    :class:`ConfigError` naming it and ``map_location`` (not a refusal)."""
    try:
        return restore(storage, location)
    except CloudCkptError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{url}: a storage saved on {location!r} cannot be restored with "
            f"map_location={map_location!r}: {short(exc)}. Pass a map_location naming a "
            "device this host has (e.g. map_location='cpu')."
        ) from None

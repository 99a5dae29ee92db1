"""The trust boundary: every pickle cloudckpt reads from storage is unpickled here.

A checkpoint in a shared bucket may have been written by anyone with write access to
it, so turning its bytes into objects is the one place where a hostile file could run
code, corrupt memory or change the loading process. :class:`RestrictedUnpickler` is a
pickle machine of our own (a dispatch over opcodes, in the manner of torch's
``torch/_weights_only_unpickler.py``) that runs under a :class:`Policy`:

* only the opcodes the policy lists; any other is refused;
* a global only if the policy's allow-list names it (``GLOBAL``, ``STACK_GLOBAL``);
* a constructor (``REDUCE``, ``NEWOBJ``) only on an allowed callable, with a tuple of
  arguments, never with a plain integer size for a tensor, storage or ``bytearray``
  (the legacy size constructors that allocate what the file asks for);
* ``BUILD``, ``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` only on objects the pickle
  built itself, of the kinds torch allows (lists, dicts, sets, tensors, parameters,
  instances of allowed classes): never on a global the pickle named, nor on a storage
  that ``persistent_load`` supplied;
* a persistent id only of the form ``('storage', <storage class>, key, location,
  numel)``;
* memory in proportion to the file: the memo is a dict, strings and byte strings are
  cut from the file's own bytes, and nothing is cached across loads.

Every ``weights_only=True`` load uses :func:`weights_only_policy`: exactly the globals
``torch.load(weights_only=True)`` allows at that moment (its list, then the user's
``add_safe_globals``/``safe_globals``), with torch's opcode set. DCP's ``.metadata``
uses a policy of its own (format/dcp/metadata.py). What is refused raises
:class:`~cloudckpt.errors.UnsafeCheckpointError`; bytes that are not a valid pickle
(damage, truncation, a constructor that fails on its arguments) raise
:class:`~cloudckpt.errors.CorruptCheckpointError`. ``tests/security`` checks both
against torch's own unpickler, differentially (docs/security.md).

The switch: ``CLOUDCKPT_UNPICKLER=torch`` (or :func:`set_unpickler`) sends every
weights-only unpickle of a torch archive through torch's own weights-only unpickler
instead (slower; the reference itself). ``weights_only=False`` is an explicit opt-in to
full pickle for files you trust.

Plain CPU tensors are rebuilt by the function :func:`_rebuilder` makes, which does what
``torch._utils._rebuild_tensor_v2`` does without its per-tensor fake-mode lookup (made
once per load instead); everything else goes through torch's own rebuild functions.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import sys
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CloudCkptError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from .gcpause import paused_gc

__all__ = [
    "Policy",
    "RestrictedUnpickler",
    "StorageRef",
    "StorageStandIn",
    "load_torch_bytes",
    "parse_persistent_id",
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


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


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
    if dtype is None or _text(tag) != "storage":
        raise CorruptCheckpointError(
            f"{url}: a persistent id in data.pkl names {type(storage_type).__name__}, "
            "not a storage class"
        )
    if type(key) not in (str, bytes) or type(location) not in (str, bytes):
        raise CorruptCheckpointError(f"{url}: malformed storage reference in data.pkl")
    if type(numel) is not int or numel < 0:
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


# --- the policy ------------------------------------------------------------------------


class _Refused(UnsafeCheckpointError):
    """Content the policy does not allow (raised inside the machine, named at the top)."""


def _o(name: str) -> int:
    return pickle.__dict__[name][0]


#: The opcodes torch's weights-only unpickler runs (protocol 2, as torch.save writes).
TORCH_OPCODES = frozenset(
    _o(n)
    for n in [
        "GLOBAL",
        "NEWOBJ",
        "REDUCE",
        "BUILD",
        "APPEND",
        "APPENDS",
        "SETITEM",
        "SETITEMS",
        "MARK",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "NONE",
        "NEWFALSE",
        "NEWTRUE",
        "EMPTY_TUPLE",
        "EMPTY_LIST",
        "EMPTY_DICT",
        "EMPTY_SET",
        "BININT",
        "BININT1",
        "BININT2",
        "BINFLOAT",
        "BINUNICODE",
        "SHORT_BINSTRING",
        "BINPERSID",
        "BINGET",
        "LONG_BINGET",
        "BINPUT",
        "LONG_BINPUT",
        "LONG1",
        "PROTO",
        "STOP",
    ]
)
#: What ``pickle.dumps`` adds in protocols 3 to 5 (DCP's ``.metadata`` is written so).
PROTOCOL4_OPCODES = TORCH_OPCODES | frozenset(
    _o(n)
    for n in [
        "FRAME",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "MEMOIZE",
        "STACK_GLOBAL",
        "SHORT_BINBYTES",
        "BINBYTES",
        "BINBYTES8",
        "ADDITEMS",
        "FROZENSET",
        "POP",
        "POP_MARK",
        "DUP",
    ]
)


@dataclass(frozen=True)
class Policy:
    """What one kind of pickle may contain.

    ``globals``: ``"module.name"`` -> the object that name decodes to (nothing else is
    importable). ``opcodes``: the opcodes allowed, at least torch's (the machine tests
    only the others). ``refuse_global(module, name)``: the error for a name outside
    ``globals``. ``map_python2_names``: map Python 2 names as torch's unpickler does.
    ``advice``: what a refusal's message ends with."""

    globals: Mapping[str, Any]
    opcodes: frozenset[int] = TORCH_OPCODES
    refuse_global: Callable[[str, str], Exception] | None = None
    map_python2_names: bool = True
    #: Said after a refusal: what a user who trusts the file can do.
    advice: str = (
        "If you trust this file, pass weights_only=False; to allow a specific class, use "
        "torch.serialization.add_safe_globals([...])."
    )

    def __post_init__(self) -> None:
        if not self.opcodes >= TORCH_OPCODES:
            raise ValueError("a policy admits at least torch's weights-only opcodes")


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


def _torch_allowed() -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """torch's weights-only allow-list right now (its own, then the user's) and its
    blocked modules, or None where this torch does not expose them."""
    try:
        from torch import _weights_only_unpickler as wo

        allowed = dict(wo._get_allowed_globals())
        allowed.update(wo._get_user_allowed_globals())
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
    if allowed.get("torch._utils._rebuild_tensor_v2") is _torch_rebuild_v2:
        from torch._guards import detect_fake_mode

        if detect_fake_mode(None) is None:
            allowed["torch._utils._rebuild_tensor_v2"] = _rebuilder(
                {} if spares is None else spares
            )
    return Policy(globals=allowed, opcodes=TORCH_OPCODES, refuse_global=_unsupported)


# --- the machine ------------------------------------------------------------------------

_SETITEM_TYPES = (dict, OrderedDict, Counter)
_unpack_i = struct.Struct("<i").unpack_from
_unpack_H = struct.Struct("<H").unpack_from
_unpack_I = struct.Struct("<I").unpack_from
_unpack_Q = struct.Struct("<Q").unpack_from
_unpack_d = struct.Struct(">d").unpack_from
_WIDTH = {4: _unpack_I, 8: _unpack_Q}
#: Protocol 3-5 opcodes of a length and bytes: (the length's width, whether text).
_SIZED = {0x8C: (1, True), 0x8D: (8, True), 0x43: (1, False), 0x42: (4, False), 0x8E: (8, False)}


class RestrictedUnpickler:
    """Unpickles ``data`` under ``policy``; ``persistent_load`` supplies storages.

    One load per instance. The object graph is built exactly as the C unpickler and
    torch's unpickler build it, so what both accept loads equal; everything outside
    the policy raises :class:`UnsafeCheckpointError`, everything malformed
    :class:`CorruptCheckpointError` (by :func:`run_restricted`)."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        policy: Policy,
        persistent_load: Callable[[Any], Any] | None = None,
        *,
        encoding: str = "utf-8",
    ) -> None:
        self.data = bytes(data) if not isinstance(data, bytes) else data
        self.policy = policy
        self.persistent_load = persistent_load
        self.encoding = encoding
        #: Ids of objects the pickle must not change: the globals it named and the
        #: storages persistent_load gave (kept alive in ``_held`` so ids stay unique).
        self._foreign: set[int] = {id(v) for v in policy.globals.values()}
        self._held: list[Any] = []
        self._callables = {id(v) for v in policy.globals.values() if callable(v)}
        self._classes = {id(v) for v in policy.globals.values() if isinstance(v, type)}
        self.sparse: list[Any] = []

    # The globals a pickle names, mapped as torch maps Python 2 names.
    def find_class(self, module: str, name: str) -> Any:
        policy = self.policy
        if policy.map_python2_names:
            if (module, name) in NAME_MAPPING:
                module, name = NAME_MAPPING[(module, name)]
            elif module in IMPORT_MAPPING:
                module = IMPORT_MAPPING[module]
        full_path = f"{module}.{name}"
        globals_ = policy.globals
        if full_path in globals_:
            return globals_[full_path]
        if policy.refuse_global is not None:
            raise policy.refuse_global(module, name)
        raise _Refused(f"the pickle names {full_path}, which this kind of file never holds")

    def _call(self, func: Any, args: Any, op: str) -> Any:
        """``func(*args)`` for REDUCE, after the policy's checks."""
        if id(func) not in self._callables:
            raise _Refused(f"{op} of {_describe(func)}, which is not an allowed callable")
        if type(args) is not tuple:
            raise _Refused(f"{op} of {_describe(func)} with {type(args).__name__} arguments")
        if func in _INT_SIZED_CLASSES and any(type(a) is int for a in args):
            raise _Refused(f"{op} of {_describe(func)} with a size: allocates what the file asks")
        if func is _rebuild_from_type_v2 and (
            len(args) < 2 or id(args[0]) not in self._callables or id(args[1]) not in self._classes
        ):
            raise _Refused("_rebuild_from_type_v2 of a callable or type that is not allowed")
        result = func(*args)
        if func in _SPARSE_CLASSES:
            self.sparse.append(result)
        return result

    def _newobj(self, cls: Any, args: Any) -> Any:
        if cls is torch.nn.Parameter:
            if type(args) is not tuple:
                raise _Refused(f"NEWOBJ of Parameter with {type(args).__name__} arguments")
            return torch.nn.Parameter(*args)
        if id(cls) not in self._classes:
            raise _Refused(f"NEWOBJ of {_describe(cls)}, which is not an allowed class")
        if type(args) is not tuple:
            raise _Refused(f"NEWOBJ of {_describe(cls)} with {type(args).__name__} arguments")
        if cls in _INT_SIZED_CLASSES and any(type(a) is int for a in args):
            raise _Refused(f"NEWOBJ of {_describe(cls)} with a size: allocates what the file asks")
        result = cls.__new__(cls, *args)
        if cls in _SPARSE_CLASSES:
            self.sparse.append(result)
        return result

    def _build(self, inst: Any, state: Any) -> None:
        """BUILD as torch's unpickler does it, only on an object the pickle built."""
        if id(inst) in self._foreign:
            raise _Refused(f"BUILD on {_describe(inst)}, which the pickle did not build")
        kind = type(inst)
        if kind is torch.Tensor:
            if type(state) is not tuple:
                raise _Refused(f"BUILD of a tensor from {type(state).__name__}")
            inst.set_(*state)  # the legacy tensor format
        elif kind is torch.nn.Parameter:
            inst.__setstate__(state)
        elif kind is OrderedDict:
            if type(state) is not dict:
                raise _Refused(f"BUILD of an OrderedDict from {type(state).__name__}")
            inst.__dict__.update(state)
        elif id(kind) in self._classes:
            setstate = getattr(inst, "__setstate__", None)
            if setstate is not None:
                setstate(state)
                return
            slotstate = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slotstate = state
            if state:
                inst.__dict__.update(state)
            if slotstate:
                for k, v in slotstate.items():
                    setattr(inst, k, v)
        else:
            raise _Refused(
                "BUILD can only fill a Tensor, Parameter, OrderedDict or an instance of an "
                f"allowed class, not {_describe(inst)}"
            )

    def _check_target(self, target: Any, kinds: tuple[type, ...], op: str) -> None:
        if type(target) not in kinds or id(target) in self._foreign:
            raise _Refused(f"{op} into {_describe(target)}")

    def _persistent(self, pid: Any) -> Any:
        if type(pid) is not tuple and type(pid) is not int:
            raise _Refused(f"a persistent id of type {type(pid).__name__}")
        if type(pid) is tuple and (not pid or _text(pid[0]) != "storage"):
            raise _Refused("a persistent id that does not name a storage")
        if self.persistent_load is None:
            raise _Refused("a persistent id in a pickle that holds no storages")
        found = self.persistent_load(pid)
        self._held.append(found)
        self._foreign.add(id(found))
        return found

    def load(self) -> Any:
        """The object the pickle describes. Opcodes are tested most frequent first (as
        ``torch.save`` writes them); the checks every policy shares are inlined for the
        common case and made in full by the methods above otherwise."""
        data = self.data
        end = len(data)
        extended = self.policy.opcodes
        plain_calls = self._callables - _SPECIAL_CALLABLE_IDS
        persistent = self._persistent
        stack: list[Any] = []
        append = stack.append
        marks: list[list[Any]] = []
        memo: dict[int, Any] = {}
        pos = 0
        while True:
            op = data[pos]  # IndexError past the end: damage
            pos += 1
            if op == 0x72:  # LONG_BINPUT
                memo[_unpack_I(data, pos)[0]] = stack[-1]
                pos += 4
            elif op == 0x68:  # BINGET
                append(memo[data[pos]])
                pos += 1
            elif op == 0x4B:  # BININT1
                append(data[pos])
                pos += 1
            elif op == 0x71:  # BINPUT
                memo[data[pos]] = stack[-1]
                pos += 1
            elif op == 0x58:  # BINUNICODE
                n = _unpack_I(data, pos)[0]
                pos += 4
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                append(str(data[pos : pos + n], "utf-8", "surrogatepass"))
                pos += n
            elif op == 0x28:  # MARK
                marks.append(stack)
                stack = []
                append = stack.append
            elif op == 0x74:  # TUPLE
                items = stack
                stack = marks.pop()
                append = stack.append
                append(tuple(items))
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                func = stack[-1]
                if id(func) in plain_calls and type(args) is tuple:
                    stack[-1] = func(*args)
                else:
                    stack[-1] = self._call(func, args, "REDUCE")
            elif op == 0x51:  # BINPERSID
                append(persistent(stack.pop()))
            elif op == 0x89:  # NEWFALSE
                append(False)
            elif op == 0x29:  # EMPTY_TUPLE
                append(())
            elif op == 0x6A:  # LONG_BINGET
                append(memo[_unpack_I(data, pos)[0]])
                pos += 4
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op == 0x88:  # NEWTRUE
                append(True)
            elif op == 0x4E:  # NONE
                append(None)
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = marks.pop()
                append = stack.append
                target = stack[-1]
                self._check_target(target, _SETITEM_TYPES, "SETITEMS")
                if len(items) % 2:
                    raise ValueError("SETITEMS with an odd number of items")
                for i in range(0, len(items), 2):
                    target[items[i]] = items[i + 1]
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                target = stack[-1]
                self._check_target(target, _SETITEM_TYPES, "SETITEM")
                target[key] = value
            elif op == 0x4A:  # BININT
                append(_unpack_i(data, pos)[0])
                pos += 4
            elif op == 0x4D:  # BININT2
                append(_unpack_H(data, pos)[0])
                pos += 2
            elif op == 0x63:  # GLOBAL
                stop = data.find(b"\n", pos)
                middle = data.find(b"\n", stop + 1) if stop >= 0 else -1
                if middle < 0:
                    raise EOFError("a GLOBAL runs past the end")
                module = data[pos:stop].decode("utf-8")
                name = data[stop + 1 : middle].decode("utf-8")
                pos = middle + 1
                append(self.find_class(module, name))
            elif op == 0x7D:  # EMPTY_DICT
                append({})
            elif op == 0x5D:  # EMPTY_LIST
                append([])
            elif op == 0x65:  # APPENDS
                items = stack
                stack = marks.pop()
                append = stack.append
                self._check_target(stack[-1], (list,), "APPENDS")
                stack[-1].extend(items)
            elif op == 0x61:  # APPEND
                item = stack.pop()
                self._check_target(stack[-1], (list,), "APPEND")
                stack[-1].append(item)
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                stack[-1] = self._newobj(stack[-1], args)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                self._build(stack[-1], state)
            elif op == 0x47:  # BINFLOAT
                append(_unpack_d(data, pos)[0])
                pos += 8
            elif op == 0x8A:  # LONG1
                n = data[pos]
                pos += 1
                if pos + n > end:
                    raise EOFError("a long runs past the end")
                append(int.from_bytes(data[pos : pos + n], "little", signed=True))
                pos += n
            elif op == 0x55:  # SHORT_BINSTRING
                n = data[pos]
                pos += 1
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                raw = data[pos : pos + n]
                append(raw if self.encoding == "bytes" else raw.decode(self.encoding, "strict"))
                pos += n
            elif op == 0x8F:  # EMPTY_SET
                append(set())
            elif op == 0x80:  # PROTO
                pos += 1
            elif op == 0x2E:  # STOP
                return stack.pop()
            elif op not in extended:  # everything below: not in torch's opcode set
                if op not in _OPCODES:  # not pickle at all: damage
                    raise ValueError(f"byte {op:#04x} at {pos - 1} is not a pickle opcode")
                raise _Refused(f"Unsupported operand {op} ({_opname(op)})")
            # Protocol 3-5 opcodes (DCP's .metadata); torch's policy never admits them.
            elif op == 0x95:  # FRAME: the frame's length, checked against the data
                if _unpack_Q(data, pos)[0] > end - pos - 8:
                    raise EOFError("a frame runs past the end")
                pos += 8
            elif op in _SIZED:  # SHORT_BINUNICODE, BINUNICODE8 and the BINBYTES
                width, text = _SIZED[op]
                n = data[pos] if width == 1 else _WIDTH[width](data, pos)[0]
                pos += width
                if pos + n > end:
                    raise EOFError("a string runs past the end")
                raw = data[pos : pos + n]
                append(str(raw, "utf-8", "surrogatepass") if text else raw)
                pos += n
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                if type(name) is not str or type(module) is not str:
                    raise _Refused("STACK_GLOBAL with names that are not strings")
                append(self.find_class(module, name))
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = marks.pop()
                append = stack.append
                self._check_target(stack[-1], (set,), "ADDITEMS")
                stack[-1].update(items)
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = marks.pop()
                append = stack.append
                append(frozenset(items))
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = marks.pop()
                    append = stack.append
            elif op == 0x31:  # POP_MARK
                stack = marks.pop()
                append = stack.append
            elif op == 0x32:  # DUP
                append(stack[-1])
            else:  # an opcode a policy lists but this machine lacks
                raise _Refused(f"Unsupported operand {op} ({_opname(op)})")


_OPNAMES = {ord(info.code): info.name for info in pickletools.opcodes}
_OPCODES = frozenset(_OPNAMES)


def _opname(op: int) -> str:
    return _OPNAMES.get(op, "not an opcode")


def _describe(value: Any) -> str:
    """Names what a value is without calling anything it defines (no repr)."""
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


_rebuild_from_type_v2 = getattr(torch._tensor, "_rebuild_from_type_v2", None)


def _tensor_and_storage_classes() -> frozenset[Any]:
    classes: set[Any] = {torch.Tensor, torch.nn.Parameter, torch.UntypedStorage, bytearray}
    classes.update(torch._tensor_classes)
    classes.update(_STORAGE_DTYPES)
    classes.add(torch.storage.TypedStorage)
    return frozenset(classes)


#: Classes whose constructor, given an integer, allocates that many elements.
_INT_SIZED_CLASSES = _tensor_and_storage_classes()
_SPARSE_CLASSES = frozenset(c for c in torch._tensor_classes if "sparse" in c.__module__)
#: Callables REDUCE checks further (RestrictedUnpickler._call): never on the fast path.
_SPECIAL_CALLABLE_IDS = frozenset(
    id(c) for c in (*_INT_SIZED_CLASSES, *_SPARSE_CLASSES, _rebuild_from_type_v2)
)


def run_restricted(
    data: bytes | bytearray | memoryview,
    policy: Policy,
    persistent_load: Callable[[Any], Any] | None,
    url: str,
    what: str = "data.pkl",
) -> Any:
    """Unpickle ``data`` under ``policy``: the result, or a typed error naming ``url``.

    Refused content raises :class:`UnsafeCheckpointError`; damage (any other failure,
    whatever its type) :class:`CorruptCheckpointError`; cloudckpt's own errors raised
    by ``persistent_load`` pass through."""
    machine = RestrictedUnpickler(data, policy, persistent_load)
    try:
        with paused_gc(kept=True):
            result = machine.load()
    except UnsafeCheckpointError as exc:  # the policy's refusal (_Refused or its own)
        advice = f". {policy.advice}" if policy.advice else ""
        raise UnsafeCheckpointError(
            f"{url}: {what} holds what loading does not allow: {exc}{advice}"
        ) from None
    except CloudCkptError:
        raise
    except Exception as exc:  # every other failure of a pickle is damage
        raise CorruptCheckpointError(
            f"{url}: {what} is not a valid pickle ({type(exc).__name__}: {_short(exc)})"
        ) from None
    _validate_sparse(machine.sparse, url)
    return result


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def _validate_sparse(tensors: Iterable[Any], url: str) -> None:
    """The invariants torch checks on sparse tensors after a load: those legacy sparse
    classes built, and those torch's ``_rebuild_sparse_tensor`` queued (in a list of
    torch's that this also empties)."""
    try:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
                torch._validate_sparse_coo_tensor_args(t._indices(), t._values(), t.size())
        torch._utils._validate_loaded_sparse_tensors()
    except Exception as exc:
        raise CorruptCheckpointError(f"{url}: a sparse tensor is malformed: {exc}") from None


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
        result = unpickler.load()
    except CloudCkptError:
        raise
    except pickle.UnpicklingError as exc:  # torch's refusal
        raise UnsafeCheckpointError(f"{url}: data.pkl is refused by torch: {exc}") from None
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{url}: data.pkl is not a valid pickle ({type(exc).__name__}: {_short(exc)})"
        ) from None
    try:
        torch._utils._validate_loaded_sparse_tensors()
    except Exception as exc:
        raise CorruptCheckpointError(f"{url}: a sparse tensor is malformed: {exc}") from None
    return result


def unpickle(
    data: bytes | bytearray | memoryview,
    persistent_load: Callable[[Any], Any],
    *,
    weights_only: bool,
    url: str,
    spares: dict[int, torch.Tensor] | None = None,
) -> Any:
    """Unpickle a torch archive's ``data.pkl``, ``persistent_load`` supplying storages
    (it must return the same object when asked for a storage again).

    ``spares``: tensors the first rebuild over a storage may take (see
    :func:`_rebuilder`); ``persistent_load`` may add to it as it goes."""
    if not weights_only:
        unpickler = _FullUnpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        try:
            return unpickler.load()
        except CloudCkptError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(
                f"{url}: data.pkl cannot be unpickled ({type(exc).__name__}: {_short(exc)})"
            ) from None
    policy = weights_only_policy(spares) if unpickler_choice() == "cloudckpt" else None
    if policy is None:
        return _torch_unpickle(data, persistent_load, url)
    return run_restricted(data, policy, persistent_load, url)


def load_torch_bytes(
    data: bytes | bytearray | memoryview,
    *,
    map_location: Any = None,
    weights_only: bool = True,
    url: str = "<bytes>",
) -> Any:
    """Load a whole ``torch.save`` archive held in memory (a DCP byte item, a test's
    file) through the boundary: every record checked by its CRC-32 first."""
    from .zipdir import check_records

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

    order = record(prefix + "byteorder")
    swap = order is not None and bytes(order) != sys.byteorder.encode()
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
        storage = torch.UntypedStorage(ref.nbytes)
        if ref.nbytes:
            target = torch.empty(0, dtype=torch.uint8).set_(storage)
            target.copy_(torch.frombuffer(raw, dtype=torch.uint8))
        if swap:
            storage.byteswap(ref.dtype)
        storage = restore_location(restore, storage, ref.location, map_location, url)
        found = loaded[ref.key] = torch.storage.TypedStorage(
            wrap_storage=storage, dtype=ref.dtype, _internal=True
        )
        return found

    pkl = record(names[0])
    assert pkl is not None
    return unpickle(pkl, persistent_load, weights_only=weights_only, url=url)


def inflate(stored: memoryview, size: int) -> bytes:
    """A deflated zip record's bytes, never more than ``size`` of them."""
    import zlib

    out = zlib.decompressobj(-15).decompress(stored, size)
    return out


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
            f"map_location={map_location!r}: {_short(exc)}. Pass a map_location naming a "
            "device this host has (e.g. map_location='cpu')."
        ) from None

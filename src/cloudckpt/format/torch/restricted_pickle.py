"""The restricted pickle machine: the one place cloudckpt turns stored pickles into objects.

:class:`RestrictedUnpickler` is a pickle machine of our own (a dispatch over opcodes, in
the manner of torch's ``torch/_weights_only_unpickler.py``) that runs under a
:class:`Policy`:

* only the opcodes the policy lists (at least torch's weights-only set); any other is
  refused, and a byte that is no opcode at all is damage;
* a global only if the policy's allow-list names it (``GLOBAL``, ``STACK_GLOBAL``);
* a constructor (``REDUCE``, ``NEWOBJ``) only on an allowed callable, with a tuple of
  arguments, never with a plain integer size for a tensor, storage or ``bytearray``
  (the legacy size constructors that allocate what the file asks);
* ``BUILD``, ``APPEND(S)``, ``SETITEM(S)`` and ``ADDITEMS`` only on objects the pickle
  built itself, of the kinds torch allows (lists, dicts, sets, tensors, parameters,
  instances of allowed classes): never on a global the pickle named, nor on a storage
  that ``persistent_load`` supplied;
* a persistent id only of the form ``('storage', ...)``;
* memory in proportion to the file: the memo is a dict, strings and byte strings are
  cut from the file's own bytes, and nothing is kept across loads.

:func:`run_restricted` runs it: what the policy refuses raises
:class:`~cloudckpt.errors.UnsafeCheckpointError`; bytes that are not a valid pickle
(damage, truncation, a constructor that fails on its arguments)
:class:`~cloudckpt.errors.CorruptCheckpointError`. The policies: torch's weights-only
one (format/torch/unpickle.py), DCP ``.metadata``'s (format/dcp/metadata.py) and the DCP
layout parse's (format/dcp/archive.py). docs/security.md says what this promises and
how ``tests/security`` proves it against torch's own unpickler.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import CloudCkptError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "PROTOCOL4_OPCODES",
    "TORCH_OPCODES",
    "Policy",
    "Refused",
    "RestrictedUnpickler",
    "as_text",
    "check_extent",
    "run_restricted",
    "short",
    "sparse_queue",
    "validate_sparse",
]


def as_text(value: Any) -> str:
    """A pickle's text field, which Python 2 pickles wrote as bytes."""
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


class Refused(UnsafeCheckpointError):
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
    ``advice``: what a refusal's message ends with. ``calls``: what runs when the pickle
    calls one of ``globals`` (by the global's ``id``), where that is not the global
    itself (a checked or faster version of it); the pickle still gets the global
    itself wherever it names it as a value."""

    globals: Mapping[str, Any]
    opcodes: frozenset[int] = TORCH_OPCODES
    refuse_global: Callable[[str, str], Exception] | None = None
    map_python2_names: bool = True
    #: Said after a refusal: what a user who trusts the file can do.
    advice: str = (
        "If you trust this file, pass weights_only=False; to allow a specific class, use "
        "torch.serialization.add_safe_globals([...])."
    )

    calls: Mapping[int, Callable[..., Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.opcodes >= TORCH_OPCODES:
            raise ValueError("a policy admits at least torch's weights-only opcodes")


_SETITEM_TYPES = (dict, OrderedDict, Counter)
_STORAGES = (torch.storage.TypedStorage, torch.UntypedStorage)
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
        #: What a call of each allowed callable runs (its override, else itself).
        self._runs = {id(v): policy.calls.get(id(v), v) for v in policy.globals.values()}
        self._classes = {id(v) for v in policy.globals.values() if isinstance(v, type)}

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
        raise Refused(f"the pickle names {full_path}, which this kind of file never holds")

    def _call(self, func: Any, args: Any, op: str) -> Any:
        """``func(*args)`` for REDUCE, after the policy's checks."""
        if id(func) not in self._callables:
            raise Refused(f"{op} of {_describe(func)}, which is not an allowed callable")
        if type(args) is not tuple:
            raise Refused(f"{op} of {_describe(func)} with {type(args).__name__} arguments")
        if func in _INT_SIZED_CLASSES and _sizes_only(args):
            raise Refused(f"{op} of {_describe(func)} with a size: allocates what the file asks")
        if func is _rebuild_from_type_v2:
            allowed = self._callables
            if len(args) < 2 or id(args[0]) not in allowed or id(args[1]) not in self._classes:
                raise Refused("_rebuild_from_type_v2 of a callable or type that is not allowed")
            args = (self._runs[id(args[0])], *args[1:])  # it calls args[0]: the checked one
        result = self._runs[id(func)](*args)
        if func in _SPARSE_CLASSES:  # validated after the load, as torch does
            sparse_queue().append(result)
        return result

    def _newobj(self, cls: Any, args: Any) -> Any:
        if cls is torch.nn.Parameter:
            if type(args) is not tuple:
                raise Refused(f"NEWOBJ of Parameter with {type(args).__name__} arguments")
            return torch.nn.Parameter(*args)
        if id(cls) not in self._classes:
            raise Refused(f"NEWOBJ of {_describe(cls)}, which is not an allowed class")
        if type(args) is not tuple:
            raise Refused(f"NEWOBJ of {_describe(cls)} with {type(args).__name__} arguments")
        if cls in _INT_SIZED_CLASSES and _sizes_only(args):
            raise Refused(f"NEWOBJ of {_describe(cls)} with a size: allocates what the file asks")
        result = cls.__new__(cls, *args)
        if cls in _SPARSE_CLASSES:
            sparse_queue().append(result)
        return result

    def _build(self, inst: Any, state: Any) -> None:
        """BUILD as torch's unpickler does it, only on an object the pickle built."""
        if id(inst) in self._foreign:
            raise Refused(f"BUILD on {_describe(inst)}, which the pickle did not build")
        kind = type(inst)
        if kind is torch.Tensor:
            if type(state) is not tuple:
                raise Refused(f"BUILD of a tensor from {type(state).__name__}")
            if len(state) == 4 and isinstance(state[0], _STORAGES):
                check_extent(state[0].nbytes(), *state[1:], inst.element_size())
            inst.set_(*state)  # the legacy tensor format
        elif kind is torch.nn.Parameter:
            inst.__setstate__(state)
        elif kind is OrderedDict:
            if type(state) is not dict:
                raise Refused(f"BUILD of an OrderedDict from {type(state).__name__}")
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
            raise Refused(
                "BUILD can only fill a Tensor, Parameter, OrderedDict or an instance of an "
                f"allowed class, not {_describe(inst)}"
            )

    def _check_target(self, target: Any, kinds: tuple[type, ...], op: str) -> None:
        if type(target) not in kinds or id(target) in self._foreign:
            raise Refused(f"{op} into {_describe(target)}")

    def _persistent(self, pid: Any) -> Any:
        if type(pid) is not tuple and type(pid) is not int:
            raise Refused(f"a persistent id of type {type(pid).__name__}")
        if type(pid) is tuple and (not pid or as_text(pid[0]) != "storage"):
            raise Refused("a persistent id that does not name a storage")
        if self.persistent_load is None:
            raise Refused("a persistent id in a pickle that holds no storages")
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
        runs = self._runs
        plain_calls = {i: runs[i] for i in self._callables - _SPECIAL_CALLABLE_IDS}
        plain_call = plain_calls.get
        persistent = self._persistent
        load_storage = self.persistent_load
        hold = self._held.append
        foreign = self._foreign.add
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
                run = plain_call(id(func))
                if run is not None and type(args) is tuple:
                    stack[-1] = run(*args)
                else:
                    stack[-1] = self._call(func, args, "REDUCE")
            elif op == 0x51:  # BINPERSID
                pid = stack.pop()
                if type(pid) is tuple and pid and pid[0] == "storage" and load_storage:
                    found = load_storage(pid)  # what _persistent does, inlined
                    hold(found)
                    foreign(id(found))
                    append(found)
                else:
                    append(persistent(pid))
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
                if data[pos] > pickle.HIGHEST_PROTOCOL:
                    raise ValueError(f"unsupported pickle protocol: {data[pos]}")
                pos += 1
            elif op == 0x2E:  # STOP
                return stack.pop()
            elif op not in extended:  # everything below: not in torch's opcode set
                if op not in _OPCODES:  # not pickle at all: damage
                    raise ValueError(f"byte {op:#04x} at {pos - 1} is not a pickle opcode")
                raise Refused(f"Unsupported operand {op} ({_opname(op)})")
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
                    raise Refused("STACK_GLOBAL with names that are not strings")
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
                raise Refused(f"Unsupported operand {op} ({_opname(op)})")


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
    classes.update(torch._storage_classes)
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
    sparse: list[Any] | None = None,
) -> Any:
    """Unpickle ``data`` under ``policy``: the result, or a typed error naming ``url``.

    Refused content raises :class:`UnsafeCheckpointError`; damage (any other failure,
    whatever its type) :class:`CorruptCheckpointError`; cloudckpt's own errors raised
    by ``persistent_load`` pass through. Sparse tensors the load built are checked
    (:func:`validate_sparse`) before this returns; or, where ``sparse`` is a list
    (their storages are still being read), moved into it for the caller to check."""
    machine = RestrictedUnpickler(data, policy, persistent_load)
    try:
        result = machine.load()  # the caller's entry point pauses the collector
    except BaseException as exc:
        # torch's _rebuild_sparse_tensor queues what it built in a list of torch's; a
        # load that stops must not leave it there (the next load would validate it)
        sparse_queue().clear()
        if isinstance(exc, UnsafeCheckpointError):  # the policy's (Refused or its own)
            advice = f". {policy.advice}" if policy.advice else ""
            raise UnsafeCheckpointError(
                f"{url}: {what} holds what loading does not allow: {exc}{advice}"
            ) from None
        if isinstance(exc, (CloudCkptError, KeyboardInterrupt, SystemExit)):
            raise
        if not isinstance(exc, Exception):
            raise
        raise CorruptCheckpointError(  # every other failure of a pickle is damage
            f"{url}: {what} is not a valid pickle ({type(exc).__name__}: {short(exc)})"
        ) from None
    built = sparse_queue()
    if sparse is None:
        validate_sparse(list(built), url)
    else:
        sparse.extend(built)
    built.clear()
    return result


def sparse_queue() -> list[Any]:
    """torch's process-wide list of sparse tensors to validate after a load."""
    found = getattr(torch._utils, "_sparse_tensors_to_validate", None)
    return found if isinstance(found, list) else []


def check_extent(nbytes: int, offset: Any, size: Any, stride: Any, itemsize: int) -> None:
    """Refuse a view (offset, size, stride, in elements of ``itemsize`` bytes) that
    reaches past a storage of ``nbytes``: ``torch.load``'s storages cannot grow, but a
    storage cloudckpt made can, and ``set_`` would resize it to what the file asks."""
    if type(offset) is not int or offset < 0:
        raise ValueError(f"storage offset {offset!r} is not a non-negative integer")
    if len(size) != len(stride):
        raise ValueError(f"size {tuple(size)} and stride {tuple(stride)} differ in length")
    last = offset
    empty = False
    for n, step in zip(size, stride, strict=True):
        if type(n) is not int or type(step) is not int or n < 0 or step < 0:
            raise ValueError(f"size {tuple(size)} or stride {tuple(stride)} is not valid")
        empty = empty or n == 0
        last += (n - 1) * step
    if not empty and (last + 1) * itemsize > nbytes:
        raise ValueError(
            f"a tensor of size {tuple(size)}, stride {tuple(stride)} at offset {offset} "
            f"reaches byte {(last + 1) * itemsize} of a storage of {nbytes}"
        )


def _sizes_only(args: tuple[Any, ...]) -> bool:
    """Arguments of a legacy size constructor (``Tensor(2, 3)``, ``FloatTensor(Size)``,
    ``bytearray(n)``): sizes only, which allocate what the file asks."""
    return bool(args) and all(type(a) is int or type(a) is torch.Size for a in args)


def short(exc: BaseException) -> str:
    """An exception's text, cut to 300 characters for a message."""
    text = str(exc)
    return text if len(text) <= 300 else text[:300] + "..."


def validate_sparse(tensors: list[Any], url: str) -> None:
    """torch's check of sparse tensors after a load, where sparse invariant checks are on
    (``torch.sparse.check_sparse_tensor_invariants``), made on ``tensors``: those
    ``_rebuild_sparse_tensor`` and the legacy sparse classes built."""
    if not tensors:
        return
    queue = sparse_queue()
    queue.extend(tensors)
    try:
        torch._utils._validate_loaded_sparse_tensors()
    except Exception as exc:
        raise CorruptCheckpointError(f"{url}: a sparse tensor is malformed: {exc}") from None
    finally:
        queue.clear()
